"""MNIST in its IDX files (gzipped or not), checked against the format before use.

A directory holds ``<split>-images-idx3-ubyte[.gz]`` and ``<split>-labels-idx1-ubyte[.gz]``
for split ``train`` or ``t10k``; ``split="auto"`` takes train when present, else t10k.
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ddtrain.errors import DDTrainError
from ddtrain.data.arrays import ArrayDataset

IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049


def _find(root: Path, split: str, kind: str) -> Path:
    for name in (f"{split}-{kind}", f"{split}-{kind}.gz"):
        if (root / name).is_file():
            return root / name
    return None


def read_idx(path: Path, magic: int) -> np.ndarray:
    """Read one IDX file, checking its magic number and that its size matches its header."""
    try:
        if path.suffix != ".gz":
            raw = path.read_bytes()
        else:
            with gzip.open(path, "rb") as f:
                raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        if path.suffix == ".gz" and not isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
            # zlib.error ("Error -3 ..."), BadGzipFile (CRC, header) and EOFError (cut short)
            raise DDTrainError(f"{path}: damaged gzip file, cannot decompress it ({exc}); "
                               f"download it again") from None
        raise DDTrainError(f"{path}: cannot read ({exc})") from None
    if len(raw) < 8:
        raise DDTrainError(f"{path}: file too short to be an IDX file ({len(raw)} bytes)")
    found = struct.unpack(">I", raw[:4])[0]
    if found != magic:
        raise DDTrainError(f"{path}: magic number {found} is not {magic}; not an MNIST IDX file of this kind")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    expected = 4 + 4 * ndim + int(np.prod(dims))
    if len(raw) != expected:
        raise DDTrainError(f"{path}: header promises {dims} ({expected} bytes) but the file has "
                           f"{len(raw)} bytes; it is truncated or corrupt")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_mnist(path: str, *, split: str = "auto") -> ArrayDataset:
    root = Path(path)
    if not root.is_dir():
        raise DDTrainError(f"mnist: {root} is a file, not the folder of MNIST's .gz files" if root.exists() else
                           f"mnist: data directory {root} does not exist")
    splits = ["train", "t10k"] if split == "auto" else [split]
    for s in splits:
        images, labels = _find(root, s, "images-idx3-ubyte"), _find(root, s, "labels-idx1-ubyte")
        if images and labels:
            break
    else:
        raise DDTrainError(f"mnist: no {' or '.join(splits)} images/labels IDX files in {root} "
                           f"(expected e.g. t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz)")
    x, y = read_idx(images, IMAGES_MAGIC), read_idx(labels, LABELS_MAGIC)
    if x.ndim != 3 or y.ndim != 1:
        raise DDTrainError(f"{images}: expected (N, H, W) images and (N,) labels, got {x.shape} and {y.shape}")
    if len(x) != len(y):
        raise DDTrainError(f"{images}: {len(x)} images but {labels.name} has {len(y)} labels")
    if y.max(initial=0) > 9:
        raise DDTrainError(f"{labels}: label {int(y.max())} is not a digit")
    xs = torch.from_numpy(x.astype(np.float32) / 255.0).unsqueeze(1)
    return ArrayDataset(xs, torch.from_numpy(y.astype(np.int64)), num_classes=10)
