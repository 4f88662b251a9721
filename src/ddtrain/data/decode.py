"""Image decoding: Pillow on the CPU for everything, nvjpeg on the GPU for the JPEGs it can take.

The GPU decoder is ``torchvision.io.decode_jpeg(list_of_uint8_tensors, device="cuda")`` (one
batched nvjpeg call per batch; torchvision is optional and imported only here). Which file goes
where is decided from its first bytes, never from its name: a JPEG with 1 or 3 colour
components goes to nvjpeg; anything else (PNG or another format saved as ``.jpg``, CMYK/YCCK
JPEGs, which nvjpeg's RGB output does not convert) is decoded by Pillow, and so is every image
of a batch whose batched call fails (then tried one by one: nvjpeg alone, else Pillow). Each
file that left the GPU path is a ``Problem`` with ``action="decoded on the CPU"``; a file
Pillow cannot decode either (corrupt, truncated, empty) is a ``Problem`` with
``action="skipped"``, and the caller fills its place in the batch.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np

from ddtrain.errors import DDTrainError

JPEG_MAGIC = b"\xff\xd8\xff"
# Start-of-frame markers (baseline, extended, progressive, lossless, arithmetic): the frame header
# after them holds the number of colour components. C4 (huffman tables), C8 and CC are not frames.
SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
SKIPPED, ON_CPU = "skipped", "decoded on the CPU"


@dataclass(frozen=True)
class Problem:
    """A file that could not take the intended path: where it went and why."""

    file: str
    reason: str
    action: str      # SKIPPED (its place in the batch is filled by another sample) or ON_CPU

    def line(self) -> str:
        return f"{self.file}: {self.reason} ({self.action})"


class BadImage(Exception):
    """Pillow could not decode the bytes (the message says why)."""


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DDTrainError("decoding images needs Pillow: pip install ddtrain[imaging]") from None
    return Image


def kind(data) -> str:
    """What the bytes are, from their first bytes: ``jpeg``, ``jpeg-cmyk``, ``png``, ``empty`` or ``other``."""
    if len(data) == 0:
        return "empty"
    if bytes(data[:3]) == JPEG_MAGIC:
        return "jpeg-cmyk" if jpeg_components(data) == 4 else "jpeg"
    if bytes(data[:8]) == b"\x89PNG\r\n\x1a\n":
        return "png"
    return "other"


def jpeg_components(data) -> int | None:
    """Colour components of a JPEG from its frame header (1 grey, 3 YCbCr/RGB, 4 CMYK/YCCK); None if not found."""
    view, pos, n = memoryview(data), 2, len(data)
    while pos + 4 <= n:
        if view[pos] != 0xFF:
            return None
        marker = view[pos + 1]
        if marker == 0xFF:             # fill byte before a marker
            pos += 1
            continue
        if marker == 0xD8 or marker == 0x01 or 0xD0 <= marker <= 0xD7:   # markers without a length
            pos += 2
            continue
        length = (view[pos + 2] << 8) | view[pos + 3]
        if marker in SOF_MARKERS:
            return int(view[pos + 9]) if pos + 9 < n else None
        if marker == 0xDA:             # start of scan before any frame header: malformed
            return None
        pos += 2 + length
    return None


def decode_pillow(data) -> np.ndarray:
    """Decode image bytes to (H, W, 3) uint8 RGB with Pillow (grey, palette, CMYK converted); ``BadImage`` if it cannot."""
    if len(data) == 0:
        raise BadImage("empty file (0 bytes)")
    Image = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as image:
            return np.asarray(image.convert("RGB"))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadImage(f"unreadable image ({exc})") from None


def gpu_decoder():
    """torchvision's batched nvjpeg decode (``images, device -> CHW uint8 tensors``), or None without torchvision."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception:   # not installed, or a build that does not match torch: the CPU decodes
        return None

    def decode(tensors, device):
        return decode_jpeg(tensors, mode=ImageReadMode.RGB, device=device)
    return decode


def split_for_gpu(blobs: list) -> tuple[list[int], list[tuple[int, str]]]:
    """(positions nvjpeg should take, [(position, why not) for the rest]) of a batch's encoded images."""
    gpu, cpu = [], []
    for i, data in enumerate(blobs):
        what = kind(data)
        if what == "jpeg":
            gpu.append(i)
        elif what != "empty":
            cpu.append((i, "a CMYK JPEG (nvjpeg's RGB output does not convert it)" if what == "jpeg-cmyk"
                        else f"not a JPEG ({'PNG' if what == 'png' else 'another format'})"))
        else:
            cpu.append((i, "empty file (0 bytes)"))
    return gpu, cpu
