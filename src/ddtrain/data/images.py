"""What the image formats (``imagefolder``, ``packed``) share: labels, transforms, bad files, the two paths.

An ``ImageDataset`` knows its samples' labels and how to ``read(i)`` one: encoded bytes (a file,
a JPEG in a packed shard) or a (H, W, 3) uint8 array (raw pixels in a packed shard). From there
two paths lead to the training batch, chosen by the ``pipeline`` option:

* ``cpu``: per sample, in ``DataLoader`` worker processes: Pillow decodes, crops and resizes
  (``crop(box).resize(size, BILINEAR)``, torchvision's PIL path) to a (size, size, 3) uint8
  array; the batch is stacked in shared memory, travels to a GPU as uint8 (a quarter of
  float32's bytes) and is turned into normalised float32 there in one batched operation
  (``finish``); training on the CPU, the loader processes make it float themselves;
* ``gpu``: per batch, in a background thread one batch ahead of the training step
  (``ddtrain.data.pipeline``): file reads in threads, nvjpeg decode on the training GPU
  (``ddtrain.data.decode``), crop/resize/flip/normalise as batched tensor ops on a side CUDA
  stream (``ddtrain.data.augment``).

``auto`` (the default) takes ``gpu`` when the training device is CUDA (and, for encoded images,
torchvision can decode JPEGs there), else ``cpu``.

Bad files never stop an epoch: a file Pillow cannot decode (corrupt, truncated, empty) is
*skipped*: its place in the batch is taken by another sample of the same batch (so batch
shapes stay fixed: compiled graphs and batch norm see the batch size they expect), and it is
reported once per rank as a ``Problem``, counted in the results record. On the GPU path a file
nvjpeg does not take (PNG or CMYK saved as .jpg, a failed batched decode) is *decoded on the
CPU* instead, and reported too.
"""
from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ddtrain.data import augment
from ddtrain.data.decode import SKIPPED, BadImage, Problem, decode_pillow
from ddtrain.data.transforms import IMAGENET_MEAN, IMAGENET_STD, random_resized_crop_box
from ddtrain.errors import DDTrainError

PIPELINES = ("auto", "gpu", "cpu")
MAX_LISTED = 200          # problems listed one by one in the record (all are counted)


def pipeline_option(value, fmt: str) -> str:
    text = str(value).strip().lower()
    if text not in PIPELINES:
        raise DDTrainError(f"{fmt}: option pipeline={value!r} is not one of: {', '.join(PIPELINES)}")
    if text == "gpu" and not torch.cuda.is_available():
        raise DDTrainError(f"{fmt}: pipeline=gpu decodes and augments on the training GPU, and this machine has "
                           f"no CUDA device (pipeline=cpu or auto)")
    return text


@dataclass
class ImageDataset(Dataset):
    """Labels and transforms of an image format; subclasses say how to ``read`` and ``name`` a sample."""

    classes: list[str]
    labels: np.ndarray
    size: int = 224
    train: bool = True
    normalize: bool = True
    pipeline: str = "auto"
    # the batched GPU path with loader processes: the fraction of each batch's JPEGs those processes decode
    # (Pillow) while nvjpeg decodes the rest on the GPU, which the training step shares (ddtrain.data.pipeline)
    cpu_decode: float = 0.0
    # files found unusable before training (empty files in a folder): reported and counted once
    scan_problems: list[Problem] = field(default_factory=list)

    task = "classification"
    encoded = True           # read() gives encoded bytes (False: (H, W, 3) uint8 pixels)

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return (3, self.size, self.size)

    def __len__(self) -> int:
        return len(self.labels)

    # -- what a format provides -------------------------------------------------------
    def read(self, i: int):
        """Sample ``i``'s encoded bytes, or its (H, W, 3) uint8 pixels."""
        raise NotImplementedError

    def name(self, i: int) -> str:
        """How messages name sample ``i`` (its file)."""
        raise NotImplementedError

    def _take(self, idx: np.ndarray) -> dict:
        """The fields of a subset (``select``) besides the labels."""
        raise NotImplementedError

    # -- the CPU path: one sample at a time -------------------------------------------
    def pixels(self, i: int) -> np.ndarray:
        """(H, W, 3) uint8 pixels of sample ``i``; ``BadImage`` if they cannot be decoded."""
        data = self.read(i)
        return decode_pillow(data) if self.encoded else data

    def sample(self, i: int):
        """((size, size, 3) uint8 array, label) or (``Problem``, label): the CPU path's transform."""
        label = int(self.labels[i])
        try:
            pixels = self.pixels(i)
        except BadImage as exc:
            return Problem(self.name(i), str(exc), SKIPPED), label
        except OSError as exc:  # a file that vanished or cannot be read since the scan
            return Problem(self.name(i), f"cannot be read ({exc.strerror or exc})", SKIPPED), label
        return transform(pixels, self.size, self.train), label

    def __getitem__(self, i):
        """(float32 (3, size, size), label); a file that cannot be decoded raises one DDTrainError naming it."""
        x, label = self.sample(i)
        if isinstance(x, Problem):
            raise DDTrainError(x.line())
        return self.collate([(x, label)], finish=True)[0][0], label

    def finish(self, x: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> float32 in [0, 1], normalised if asked: one pass on x's device.

        The result is channels-last if asked, else contiguous (the layout conversion is part of the
        same copy); in a loader process it is made in shared memory, so sending it copies nothing.
        """
        out = _float_batch(x.shape, channels_last, x.device)
        out.copy_(x)
        return self._normalise_(out)

    def _normalise_(self, out: torch.Tensor) -> torch.Tensor:
        for k in range(out.shape[1]):   # scalar ops per channel: no small tensor copied to the device (no host wait)
            a, b = ((1 / 255 / IMAGENET_STD[k], -IMAGENET_MEAN[k] / IMAGENET_STD[k]) if self.normalize
                    else (1 / 255, 0.0))
            out[:, k].mul_(a).add_(b)
        return out

    def collate(self, samples, finish: bool = False, channels_last: bool = False):
        """Stack the CPU path's samples into (x, labels, problems); a skipped sample's place is filled.

        x is a uint8 (N, 3, H, W) view of (N, H, W, 3) memory (channels-last strides: the samples
        are stacked as Pillow gives them, never transposed one by one), or float32 (``finish``:
        when training on the CPU, the loader processes do that too, in parallel).
        """
        from ddtrain.data.pipeline import fill_skipped
        arrays = [s[0] for s in samples]
        problems = [x for x in arrays if isinstance(x, Problem)]
        arrays = [None if isinstance(x, Problem) else x for x in arrays]
        side = self.size
        arrays, labels, problems = fill_skipped(arrays, [s[1] for s in samples], problems,
                                                lambda: np.zeros((side, side, 3), np.uint8))
        y = torch.as_tensor(labels, dtype=torch.long)
        if finish:   # each sample converted straight into the float batch: no uint8 batch in between
            out = _float_batch((len(arrays), 3, side, side), channels_last, "cpu")
            host = out.numpy()       # numpy converts and transposes in one copy, flipped (negative-stride) views too
            for k, a in enumerate(arrays):
                np.copyto(host[k], a.transpose(2, 0, 1), casting="unsafe")
            return self._normalise_(out), y, problems
        # numpy's stack: torch.stack of uint8 runs in threads, slow on a busy machine (18 ms against 0.5)
        stacked = _buffer((len(arrays), side, side, 3), torch.uint8)
        np.stack(arrays, out=stacked.numpy())
        return stacked.permute(0, 3, 1, 2), y, problems

    # -- the GPU path: a batch at a time ----------------------------------------------
    def batch_pipeline(self, device: torch.device, threads: int):
        """The batched pipeline for ``device`` if this dataset takes it there (``pipeline`` option), else None."""
        from ddtrain.data.decode import gpu_decoder
        from ddtrain.data.pipeline import BatchPipeline
        if self.pipeline == "cpu" or (self.pipeline == "auto" and device.type != "cuda"):
            return None
        decoder = gpu_decoder() if self.encoded and device.type == "cuda" else None
        if self.pipeline == "auto" and self.encoded and decoder is None:
            return None   # without nvjpeg the per-sample loader processes decode as fast as threads would
        return BatchPipeline(self, device, threads=threads, decoder=decoder, readers=threads,
                             cpu_decode=self.cpu_decode if decoder is not None else 0.0)

    def describe(self, device: torch.device, threads: int) -> dict:
        """Which path the samples take on ``device`` (for the results record)."""
        pipe = self.batch_pipeline(device, threads)
        if pipe is not None:
            return pipe.describe()
        return {"pipeline": "cpu", "decoder": "pillow" if self.encoded else "none (raw pixels)",
                "augment": "per sample, Pillow crop+resize in the loader processes", "option": self.pipeline}

    # -- splits ------------------------------------------------------------------------
    def select(self, idx) -> ImageDataset:
        idx = np.asarray(torch.as_tensor(idx).cpu(), dtype=np.int64)
        return replace(self, labels=self.labels[idx], **self._take(idx))

    def eval_view(self) -> ImageDataset:
        """The same images with the evaluation transform (resize + centre crop, no flip)."""
        return replace(self, train=False)


def transform(pixels: np.ndarray, size: int, train: bool) -> np.ndarray:
    """The CPU path: (H, W, 3) uint8 -> (size, size, 3) uint8, torchvision's PIL transforms.

    Training: ``RandomResizedCrop`` (``crop(box).resize``) and a flip half the time, from torch's
    global generator (DataLoader seeds it per worker). Evaluation: ``Resize(floor(size/0.875))``
    (the long side ``int(side * long / short)``) then ``CenterCrop(size)``. A flip is a view
    (negative stride): the batch's stack copies it once.
    """
    from PIL import Image
    image = Image.fromarray(pixels)
    height, width = pixels.shape[:2]
    if train:
        box = random_resized_crop_box(width, height)
        image = image.crop(box).resize((size, size), Image.BILINEAR)
        flip = bool(torch.rand(()) < 0.5)
    else:
        side = augment.eval_resize_side(size)
        w, h = (side, int(side * height / width)) if width <= height else (int(side * width / height), side)
        top, left = int(round((h - size) / 2)), int(round((w - size) / 2))
        image = image.resize((w, h), Image.BILINEAR).crop((left, top, left + size, top + size))
        flip = False
    out = np.asarray(image)
    return out[:, ::-1] if flip else out


def _float_batch(shape: tuple, channels_last: bool, device) -> torch.Tensor:
    """An empty float32 (N, C, H, W) batch, channels-last or contiguous (see ``_buffer``)."""
    n, c, h, w = shape
    if channels_last:
        return _buffer((n, h, w, c), torch.float32, device).permute(0, 3, 1, 2)
    return _buffer((n, c, h, w), torch.float32, device)


def _buffer(shape: tuple, dtype: torch.dtype, device=None) -> torch.Tensor:
    """An empty batch tensor; in a loader process in shared memory, as torch's default_collate makes its batches,
    so that sending it to the training process copies nothing (``_new_shared`` is the call default_collate uses)."""
    if (device is None or torch.device(device).type == "cpu") and get_worker_info() is not None:
        try:
            storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))
            return torch.empty(0, dtype=dtype).new(storage).view(shape)
        except (AttributeError, RuntimeError):   # a torch without it: an ordinary tensor, sent by a copy
            pass
    return torch.empty(shape, dtype=dtype, device=device)


class ProblemLog:
    """The bad files one rank met: each reported once (``report``), all counted (``as_dict``)."""

    def __init__(self, report: Callable[[Problem], None] | None = None):
        self.report = report or (lambda p: print(f"data: {p.line()}", file=sys.stderr, flush=True))
        self.first: dict[str, Problem] = {}
        self.times: Counter = Counter()

    def add(self, problems) -> None:
        for p in problems:
            if p.file not in self.first:
                self.first[p.file] = p
                self.report(p)
            self.times[p.file] += 1

    def as_dict(self) -> dict:
        return summarise([self])


def summarise(logs) -> dict:
    """One record section from the ranks' logs (``ProblemLog``s, or their ``as_dict``s)."""
    first, times = {}, Counter()
    for log in logs:
        if isinstance(log, ProblemLog):
            entries = [(f, p.reason, p.action, log.times[f]) for f, p in log.first.items()]
        else:
            entries = [(e["file"], e["reason"], e["action"], e["times"]) for e in log.get("files", [])]
        for f, reason, action, n in entries:
            first.setdefault(f, (reason, action))
            times[f] += n
    skipped = [f for f, (_, action) in first.items() if action.startswith(SKIPPED)]
    listed = [{"file": f, "reason": r, "action": a, "times": times[f]} for f, (r, a) in sorted(first.items())]
    return {"files_skipped": len(skipped), "samples_skipped": sum(times[f] for f in skipped),
            "files_decoded_on_cpu": len(first) - len(skipped),
            "samples_decoded_on_cpu": sum(times[f] for f in first if f not in skipped),
            "files": listed[:MAX_LISTED], "files_not_listed": max(0, len(listed) - MAX_LISTED)}
