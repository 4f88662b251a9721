"""In-memory datasets as two tensors: the fast path every small dataset takes.

Also the checks every array-backed loader applies before it builds one, so that a file
no model can train on correctly is refused at load time (in the launching process, before
any worker starts) with its name and the problem, never trained on silently. The checks
are vectorised: a few passes over the array, no per-sample Python.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from ddtrain.errors import DDTrainError

NUMERIC_KINDS = "biuf"    # numpy dtype kinds that hold numbers: bool, int, unsigned, float
DTYPE_WORDS = {"U": "text", "S": "bytes", "O": "Python objects", "c": "complex numbers",
               "V": "raw records", "M": "dates", "m": "time spans"}
CHECK_CHUNK = 8192        # samples per pass of the finiteness check: bounds its temporary memory
CLASS_GAP = 2             # max label + 1 may be at most this many times the number of distinct labels


class ArrayDataset(Dataset):
    """Inputs ``x`` (N, C, H, W) and targets ``y`` (N,) class indices or (N, ...) regression targets."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, *, num_classes: int | None = None):
        if len(x) != len(y):
            raise ValueError(f"{len(x)} inputs but {len(y)} targets")
        self.x, self.y = x, y
        self.num_classes = num_classes
        self.task = "classification" if num_classes else "regression"
        self.sample_shape = tuple(x.shape[1:])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def batch(self, idx: torch.Tensor):
        """Gather a whole batch at once (no per-sample Python, no collate)."""
        return self.x[idx], self.y[idx]

    def select(self, idx: torch.Tensor) -> ArrayDataset:
        return ArrayDataset(self.x[idx], self.y[idx], num_classes=self.num_classes)

    def to(self, device) -> ArrayDataset:
        """A copy resident on ``device`` (the GPU path: copied once, never per step)."""
        return ArrayDataset(self.x.to(device), self.y.to(device), num_classes=self.num_classes)


def check_samples(a: np.ndarray, source, name: str) -> None:
    """Refuse an array that is not one numeric, non-empty entry per sample."""
    if a.dtype.kind not in NUMERIC_KINDS:
        what = DTYPE_WORDS.get(a.dtype.kind, f"dtype {a.dtype}")
        raise DDTrainError(f"{source}: array {name} holds {what} (dtype {a.dtype}), not numbers")
    if a.ndim == 0:
        raise DDTrainError(f"{source}: array {name} is a single value (a 0-d array), not one entry per sample")
    if len(a) == 0:
        raise DDTrainError(f"{source}: array {name} is empty (shape {a.shape}): no samples")
    if a.size == 0:
        raise DDTrainError(f"{source}: array {name} has shape {a.shape}: every sample is empty "
                           f"(a dimension of size 0)")


def check_finite(a: np.ndarray, source, name: str) -> None:
    """Refuse NaN or infinity anywhere in a float array, naming how many samples hold one and the first."""
    if a.dtype.kind != "f" or a.size == 0:
        return
    rows = a.reshape(len(a), -1)
    bad = np.concatenate([~np.isfinite(rows[i:i + CHECK_CHUNK]).all(axis=1)
                          for i in range(0, len(rows), CHECK_CHUNK)])
    count = int(bad.sum())
    if count:
        first = int(bad.argmax())
        value = rows[first][~np.isfinite(rows[first])][0]
        raise DDTrainError(f"{source}: array {name} has non-finite values (NaN or infinity) in {count} of "
                           f"{len(rows)} samples, the first at index {first} ({value}); remove or repair them")


def class_labels(y: np.ndarray, source, num_classes: int | None = None) -> tuple[np.ndarray, int]:
    """(int64 labels, class count) from (N,) labels that must be integers 0..K-1.

    The class count is ``num_classes`` when given (every label must be below it), else the
    largest label + 1, which may exceed the number of distinct labels at most ``CLASS_GAP``
    times: a stray 999 among 0..9 would otherwise build a 1000-class head.
    """
    if y.dtype.kind == "f":
        check_finite(y, source, "y")
        fractional = y != np.round(y)
        if fractional.any():
            first = int(fractional.argmax())
            raise DDTrainError(f"{source}: y holds non-integer values ({int(fractional.sum())} of {len(y)}, "
                               f"the first {y[first]} at index {first}), so they are not class labels; "
                               f"if y holds regression targets, say so: --data-arg task=regression")
    low, high = y.min(), y.max()
    if low < 0:
        raise DDTrainError(f"{source}: y has a negative label ({_number(low)} at index {int(y.argmin())}); "
                           f"class labels must be 0..K-1")
    if num_classes is not None:
        if high >= num_classes:
            raise DDTrainError(f"{source}: label {_number(high)} (at index {int(y.argmax())}) is out of range "
                               f"for num_classes={num_classes}: labels must be 0..{num_classes - 1}")
        return y.astype(np.int64), num_classes
    distinct = np.unique(y)
    count = int(high) + 1
    if count > CLASS_GAP * len(distinct):
        shown = ", ".join(_number(v) for v in distinct[:12]) + (", ..." if len(distinct) > 12 else "")
        raise DDTrainError(f"{source}: labels run up to {_number(high)} (at index {int(y.argmax())}) but only "
                           f"{len(distinct)} distinct values occur ({shown}): that would be a {count}-class head; "
                           f"labels must be 0..K-1 with the largest + 1 at most {CLASS_GAP}x the number of "
                           f"distinct labels; relabel them, or give the class count: --data-arg num_classes=K")
    return y.astype(np.int64), count


def _number(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
