"""Per-batch datasets, image geometry and option checks shared by the data formats.

``BatchDataset`` is the lazy sibling of ``ArrayDataset``: it holds an index map and a
function that computes samples a whole batch at a time (``make(idx) -> (x, y)``), so a
million-sample synthetic ImageNet or CIFAR-10 resized to 128x128 costs no memory, and on a
GPU the batch is computed there. It has the same surface as ``ArrayDataset`` (``batch``,
``select``, ``to``, ``num_classes``, ``sample_shape``, ``task``); a training loop can
duck-type on ``batch``.

The crop geometry is torchvision's (random-resized-crop scale 0.08..1, aspect 3/4..4/3,
ten tries then a centre crop; eval resize to size/0.875 then centre crop), written here
because CPU builds of torchvision do not exist everywhere.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ddtrain.errors import DDTrainError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_CROP_FRACTION = 0.875  # 224 of 256: the usual ImageNet evaluation crop


class BatchDataset(Dataset):
    """Samples computed a batch at a time by ``make(idx) -> (x, y)``; stores indices, not data.

    ``make`` is a picklable object with ``__call__(idx: LongTensor)`` and ``to(device)``
    (so DataLoader workers and the GPU-resident path both work).
    """

    def __init__(self, make, n: int, *, num_classes: int | None, sample_shape: tuple,
                 index: torch.Tensor | None = None, device="cpu"):
        self.make, self.n, self.index = make, n, index
        self.device = torch.device(device)  # where batches are computed (``to`` moves it)
        self.num_classes = num_classes
        self.task = "classification" if num_classes else "regression"
        self.sample_shape = tuple(sample_shape)

    def __len__(self) -> int:
        return self.n if self.index is None else len(self.index)

    def __getitem__(self, i):
        if not -len(self) <= int(i) < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        x, y = self.batch(torch.tensor([int(i) % len(self)]))
        return x[0], y[0]

    def batch(self, idx: torch.Tensor):
        """The samples at positions ``idx`` (computed now, on the dataset's device)."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        if self.index is not None:
            idx = self.index[idx.to(self.index.device)]
        return self.make(idx)

    def select(self, idx: torch.Tensor) -> BatchDataset:
        idx = torch.as_tensor(idx, dtype=torch.long)
        index = idx if self.index is None else self.index[idx]
        return BatchDataset(self.make, self.n, num_classes=self.num_classes,
                            sample_shape=self.sample_shape, index=index.clone(), device=self.device)

    def to(self, device) -> BatchDataset:
        index = None if self.index is None else self.index.to(device)
        return BatchDataset(self.make.to(device), self.n, num_classes=self.num_classes,
                            sample_shape=self.sample_shape, index=index, device=device)

    def nbytes(self) -> int:
        """Bytes of inputs and targets if every sample were computed and kept."""
        x, y = self.batch(torch.zeros(1, dtype=torch.long, device=self.device))
        return len(self) * (x.numel() * x.element_size() + y.numel() * y.element_size())

    def materialise(self, *, channels_last: bool = False, chunk_bytes: int = 256 << 20):
        """Every sample computed now, on the dataset's device, into an ``ArrayDataset`` there."""
        from ddtrain.data.arrays import ArrayDataset
        x0, y0 = self.batch(torch.zeros(1, dtype=torch.long, device=self.device))
        n, chunk = len(self), max(1, chunk_bytes // max(1, x0.numel() * x0.element_size()))
        layout = torch.channels_last if channels_last and x0.dim() == 4 else torch.contiguous_format
        x = torch.empty((n, *x0.shape[1:]), dtype=x0.dtype, device=x0.device, memory_format=layout)
        y = torch.empty((n, *y0.shape[1:]), dtype=y0.dtype, device=y0.device)
        for start in range(0, n, chunk):
            xb, yb = self.batch(torch.arange(start, min(n, start + chunk), device=self.device))
            x[start:start + len(xb)] = xb
            y[start:start + len(yb)] = yb
        return ArrayDataset(x, y, num_classes=self.num_classes)


def resize_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """Resize (N, C, H, W) to (N, C, size, size): bilinear, antialiased when shrinking."""
    if x.shape[-2:] == (size, size):
        return x
    shrink = size < x.shape[-1] or size < x.shape[-2]
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)


def random_resized_crop_box(width: int, height: int, generator: torch.Generator | None = None,
                            scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """A (left, top, right, bottom) box covering a random area fraction and aspect ratio."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        r = torch.rand(2, generator=generator).tolist()
        target = area * (scale[0] + r[0] * (scale[1] - scale[0]))
        aspect = math.exp(log_ratio[0] + r[1] * (log_ratio[1] - log_ratio[0]))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, (1,), generator=generator))
            top = int(torch.randint(0, height - h + 1, (1,), generator=generator))
            return left, top, left + w, top + h
    # Fallback (as torchvision): the whole image, centre-cropped to the nearest allowed aspect.
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def normalize_(x: torch.Tensor, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> torch.Tensor:
    """Subtract the per-channel mean and divide by the std, in place, for (C, H, W) or (N, C, H, W)."""
    shape = (-1, 1, 1)
    x.sub_(torch.tensor(mean, dtype=x.dtype).view(shape)).div_(torch.tensor(std, dtype=x.dtype).view(shape))
    return x


def int_option(name: str, value, *, minimum: int = 1, fmt: str = "data") -> int:
    """An integer option (it may arrive as a string from the command line), checked."""
    try:
        number = int(value)
        if number != float(value):
            raise ValueError
    except (TypeError, ValueError):
        raise DDTrainError(f"{fmt}: option {name}={value!r} is not an integer") from None
    if number < minimum:
        raise DDTrainError(f"{fmt}: option {name}={number} must be at least {minimum}")
    return number


def fraction_option(name: str, value, *, fmt: str = "data") -> float:
    """A number from 0 to 1 (it may arrive as a string from the command line), checked."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DDTrainError(f"{fmt}: option {name}={value!r} is not a number") from None
    if not 0.0 <= number <= 1.0:
        raise DDTrainError(f"{fmt}: option {name}={value!r} must be from 0 to 1")
    return number


def bool_option(name: str, value, *, fmt: str = "data") -> bool:
    """A yes/no option; accepts bools and the strings true/false/yes/no/1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise DDTrainError(f"{fmt}: option {name}={value!r} is not a yes/no value (true/false)")
