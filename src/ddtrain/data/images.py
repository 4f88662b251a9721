"""What the image formats (``imagefolder``, ``packed``) share: labels, transforms, bad files, the two paths.

An ``ImageDataset`` knows its samples' labels and how to ``read(i)`` one: encoded bytes (a file,
a JPEG in a packed shard) or a (H, W, 3) uint8 array (raw pixels in a packed shard). From there
two paths lead to the training batch, chosen by the ``pipeline`` option:

* ``cpu``: per sample, in ``DataLoader`` worker processes: Pillow decodes, crops and resizes
  (``crop(box).resize(size, BILINEAR)``, torchvision's PIL path) to a uint8 tensor; the batch
  travels to the device as uint8 (a quarter of float32's bytes) and is turned into normalised
  float32 there, in one batched operation (``finish``);
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

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import Dataset

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
        """(uint8 (3, size, size) tensor, label) or (``Problem``, label): the CPU path's transform."""
        label = int(self.labels[i])
        try:
            pixels = self.pixels(i)
        except BadImage as exc:
            return Problem(self.name(i), str(exc), SKIPPED), label
        except OSError as exc:  # a file that vanished or cannot be read since the scan
            return Problem(self.name(i), f"cannot be read ({exc.strerror or exc})", SKIPPED), label
        return torch.from_numpy(transform(pixels, self.size, self.train)), label

    def __getitem__(self, i):
        """(float32 (3, size, size), label); a file that cannot be decoded raises one DDTrainError naming it."""
        x, label = self.sample(i)
        if isinstance(x, Problem):
            raise DDTrainError(x.line())
        return self.finish(x[None])[0], label

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (N, 3, H, W) -> float32 in [0, 1], normalised if asked (one batched op, on x's device)."""
        out = x.float()
        for c in range(3):   # scalar ops per channel: no small tensor copied to the device (no host wait)
            a, b = ((1 / 255 / IMAGENET_STD[c], -IMAGENET_MEAN[c] / IMAGENET_STD[c]) if self.normalize
                    else (1 / 255, 0.0))
            out[:, c].mul_(a).add_(b)
        return out

    def collate(self, samples, finish: bool = False):
        """Stack the CPU path's samples into (x, labels, problems); a skipped sample's place is filled.

        x is uint8, or float32 (``finish``: when training on the CPU, the loader processes do it in parallel).
        """
        x, y, problems = fill_batch([s[0] for s in samples], [s[1] for s in samples], (3, self.size, self.size))
        return (self.finish(x) if finish else x), y, problems

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
        return BatchPipeline(self, device, threads=threads, decoder=decoder)

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
    """The CPU path: (H, W, 3) uint8 -> (3, size, size) uint8, torchvision's PIL transforms.

    Training: ``RandomResizedCrop`` (``crop(box).resize``) and a flip half the time, from torch's
    global generator (DataLoader seeds it per worker). Evaluation: ``Resize(floor(size/0.875))``
    (the long side ``int(side * long / short)``) then ``CenterCrop(size)``.
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
    if flip:
        out = out[:, ::-1]
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def fill_batch(images: list, labels: list, shape: tuple) -> tuple[torch.Tensor, torch.Tensor, list[Problem]]:
    """(stacked uint8 images, labels, problems) of the CPU path; a ``Problem`` among ``images`` is filled
    as ``pipeline.fill_skipped`` says."""
    from ddtrain.data.pipeline import fill_skipped
    problems = [x for x in images if isinstance(x, Problem)]
    images = [None if isinstance(x, Problem) else x for x in images]
    images, labels, problems = fill_skipped(images, labels, problems, lambda: torch.zeros(shape, dtype=torch.uint8))
    # numpy's stack: torch.stack of uint8 runs in parallel threads, slow on a busy machine (18 ms against 0.5)
    stacked = torch.from_numpy(np.stack([x.numpy() for x in images]))
    return stacked, torch.as_tensor(labels, dtype=torch.long), problems


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
