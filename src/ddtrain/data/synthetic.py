"""Synthetic stand-ins with the exact shapes of the documents' datasets, learnable, any size.

``synthetic:NAME`` for NAME in ``SHAPES``: mnist (1x28x28, 10 classes, 60,000 samples),
cifar10 (3x32x32, 10, 50,000), imagenet (3x224x224, 1000, 1,281,167) and hcp (document
000's 97-channel 192x192 slices, 2,175 of them = 15 subjects x 145, regression to one
T1-like channel). The benchmarks use these when the real data is not on the machine.

Every sample is a pure function of (``data_seed``, index), computed by a counter-based
hash in integer tensor arithmetic, so any index is computed on its own (lazily, a batch at
a time, on whatever device the dataset was moved to) and a million-sample ImageNet costs
no memory. Small datasets are materialised into an ``ArrayDataset`` (the fast path).

What makes them learnable, so loss and accuracy move:
- classification: label = hash(index) mod K; image = the label's fixed smooth pattern
  (random low-resolution template, upsampled) + uniform pixel noise of std ``NOISE``;
- hcp: each channel is a smooth random field (low-resolution noise, upsampled) inside a
  head-shaped ellipse filling 174x145 of 192x192 as the document's padded slices do; the
  target is ``tanh(w . x / sqrt(C))`` for fixed random weights ``w``, zero outside the head.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ddtrain.errors import DDTrainError, choice_error
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.transforms import BatchDataset, bool_option, int_option

# name -> (channels, side, num_classes or None for regression, default number of samples)
SHAPES = {
    "mnist": (1, 28, 10, 60_000),
    "cifar10": (3, 32, 10, 50_000),
    "imagenet": (3, 224, 1000, 1_281_167),
    "hcp": (97, 192, None, 2_175),
}
NOISE = 1.0                      # pixel-noise std against templates of std ~0.7
HEAD = (174 / 192, 145 / 192)    # document 000: 174x145 slices zero-padded to 192x192
MATERIALISE_BYTES = 256 << 20    # auto: keep in memory up to this many bytes of inputs
_MASK32 = 0xFFFFFFFF


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Mueller's), in place, kept in int64 so products never overflow."""
    x.bitwise_and_(_MASK32)
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(0x45D9F3B).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def hash_uniform(idx: torch.Tensor, n: int, *, seed: int, stream: int) -> torch.Tensor:
    """(len(idx), n) floats in [0, 1) on 65,536 levels, a fixed function of (seed, stream, idx, position).

    Each 32-bit hash of (sample key + position) gives two 16-bit values. Two samples' keys
    closer than n would share a shifted run of values: harmless for noise, and rare.
    """
    salt = (seed * 1_000_003 + stream * 7919) & _MASK32
    key = _mix_(_mix_(idx.to(torch.int64) + salt) + salt)[:, None]
    h = _mix_(torch.arange((n + 1) // 2, device=idx.device)[None, :] + key)
    return torch.cat([h & 0xFFFF, h >> 16], 1)[:, :n].to(torch.float32) * (1.0 / 65536)


def _unit_noise(idx, n, *, seed, stream):
    """Zero-mean, unit-variance (uniform) noise per (index, position)."""
    return (hash_uniform(idx, n, seed=seed, stream=stream) - 0.5) * math.sqrt(12.0)


class ClassPatterns:
    """label = hash(i) mod K; x = upsampled template[label] + noise. Picklable, movable."""

    def __init__(self, channels: int, size: int, classes: int, seed: int, device="cpu"):
        self.channels, self.size, self.classes, self.seed = channels, size, classes, seed
        low = max(2, min(8, size // 4))
        gen = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, channels, low, low, generator=gen).to(device)

    def __call__(self, idx: torch.Tensor):
        idx = idx.to(self.templates.device)
        labels = _mix_(idx + self.seed * 2654435761) % self.classes
        x = F.interpolate(self.templates[labels], size=(self.size, self.size), mode="bilinear",
                          align_corners=False)
        noise = _unit_noise(idx, self.channels * self.size * self.size, seed=self.seed, stream=1)
        return x + NOISE * noise.view_as(x), labels

    def to(self, device) -> ClassPatterns:
        moved = object.__new__(ClassPatterns)
        moved.__dict__.update(self.__dict__, templates=self.templates.to(device))
        return moved


class BrainSlices:
    """x: smooth fields in a head ellipse; y = tanh(w . x / sqrt(C)) in the head. Movable."""

    def __init__(self, channels: int, size: int, seed: int, device="cpu"):
        self.channels, self.size, self.seed = channels, size, seed
        self.low = max(2, size // 16)
        gen = torch.Generator().manual_seed(seed)
        self.weights = torch.randn(channels, generator=gen).view(1, channels, 1, 1).to(device)
        ys = (torch.arange(size) + 0.5 - size / 2) / (size * HEAD[0] / 2)
        xs = (torch.arange(size) + 0.5 - size / 2) / (size * HEAD[1] / 2)
        self.mask = ((ys[:, None] ** 2 + xs[None, :] ** 2) <= 1).float().to(device)

    def __call__(self, idx: torch.Tensor):
        idx = idx.to(self.mask.device)
        n, c, low = len(idx), self.channels, self.low
        fields = _unit_noise(idx, c * low * low, seed=self.seed, stream=2).view(n, c, low, low)
        side = (self.size, self.size)
        x = F.interpolate(fields, size=side, mode="bilinear", align_corners=False).mul_(self.mask)
        # Upsampling is linear, so mixing the channels before it gives the same target, cheaply.
        mixed = (fields * self.weights).sum(1, keepdim=True) / math.sqrt(c)
        y = torch.tanh(F.interpolate(mixed, size=side, mode="bilinear", align_corners=False)).mul_(self.mask)
        return x, y

    def to(self, device) -> BrainSlices:
        moved = object.__new__(BrainSlices)
        moved.__dict__.update(self.__dict__, weights=self.weights.to(device), mask=self.mask.to(device))
        return moved


def load_synthetic(name: str, *, samples=None, size=None, classes=None, channels=None,
                   data_seed=0, lazy=None):
    """``synthetic:NAME`` with options (all optional; strings from the command line are fine):

    samples    number of samples (default: the real dataset's training-set size)
    size       image side in pixels (default: the real one; e.g. 32 or 64 for CPU tests)
    classes    number of classes (classification only; default: the real one)
    channels   input channels (default: the real one, e.g. 97 for hcp)
    data_seed  which synthetic dataset (the data do not change with the training seed)
    lazy       compute batches on demand (default: only when the inputs exceed 256 MiB)
    """
    if name not in SHAPES:
        raise choice_error("synthetic dataset", name, SHAPES)
    fmt = f"synthetic:{name}"
    real_c, real_side, real_k, real_n = SHAPES[name]
    n = int_option("samples", samples if samples is not None else real_n, fmt=fmt)
    side = int_option("size", size if size is not None else real_side, minimum=2, fmt=fmt)
    c = int_option("channels", channels if channels is not None else real_c, fmt=fmt)
    seed = int_option("data_seed", data_seed, minimum=0, fmt=fmt)
    if real_k is None:
        if classes is not None:
            raise DDTrainError(f"{fmt} is a regression dataset; it takes no classes option")
        make, k = BrainSlices(c, side, seed), None
    else:
        k = int_option("classes", classes if classes is not None else real_k, minimum=2, fmt=fmt)
        make = ClassPatterns(c, side, k, seed)
    ds = BatchDataset(make, n, num_classes=k, sample_shape=(c, side, side))
    in_memory = n * c * side * side * 4 <= MATERIALISE_BYTES if lazy is None else not bool_option("lazy", lazy, fmt=fmt)
    if not in_memory:
        return ds
    xs, ys = zip(*(ds.batch(torch.arange(start, min(n, start + 4096))) for start in range(0, n, 4096)))
    return ArrayDataset(torch.cat(xs), torch.cat(ys), num_classes=k)
