"""NumPy archives with arrays ``x`` and ``y``, the way document 000 stores its data.

``x`` is (N, H, W), (N, H, W, C) channels-last (the document's layout), (N, C, H, W) or
(N, F) features. ``y`` is, for classification, (N,) class labels 0..K-1 (integers, or floats
with integral values such as 1.0) or (N, K) one-hot rows (the document's labels); for
regression, per-sample targets (N,) or (N, ...) (e.g. T1 slices for the U-Net).

The task is read from ``y`` unless the ``task`` option says it: (N,) or (N, 1) labels mean
classification, and non-integer values there are refused rather than silently turned into
regression (``--data-arg task=regression`` says that is what they are); other shapes that
are not one-hot rows mean regression. The class count is the largest label + 1 (see
``arrays.class_labels`` for the rule that refuses a stray label) or ``num_classes``.
Everything is checked here, at load time: empty, 0-d and non-numeric arrays, mismatched
lengths, negative or out-of-range labels and NaN/infinity in x or in regression targets.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from ddtrain.errors import DDTrainError
from ddtrain.data.arrays import ArrayDataset, check_finite, check_samples, class_labels
from ddtrain.data.transforms import int_option

TASKS = ("auto", "classification", "regression")


def load_npz(path: str, *, task: str = "auto", num_classes=None) -> ArrayDataset:
    """``npz:FILE`` with options:

    task         auto (default: read from y), classification or regression
    num_classes  the class count, when labels do not reach it (default: largest label + 1)
    """
    if task not in TASKS:
        raise DDTrainError(f"npz: option task={task!r} is not one of {', '.join(TASKS)}")
    if num_classes is not None:
        if task == "regression":
            raise DDTrainError("npz: option num_classes is for classification, not task=regression")
        num_classes = int_option("num_classes", num_classes, minimum=2, fmt="npz")
    file = Path(path)
    if not file.is_file():
        raise DDTrainError(f"npz: {file} is a folder, not a .npz file" if file.is_dir() else
                           f"npz: file {file} does not exist")
    x, y = _read(file)
    check_samples(x, file, "x")
    check_samples(y, file, "y")
    if len(x) != len(y):
        raise DDTrainError(f"{file}: {len(x)} inputs in x but {len(y)} targets in y")
    x = _to_nchw(x, file)
    if task != "regression":
        labels = _labels(y, file, task, num_classes)
        if labels is not None:
            return ArrayDataset(x, torch.from_numpy(labels[0]), num_classes=labels[1])
    target = y.astype(np.float32)
    check_finite(target, file, "y")
    if target.ndim == 1:
        target = target[:, None]
    elif target.ndim == 3:
        target = target[:, None]  # (N, H, W) -> (N, 1, H, W)
    return ArrayDataset(x, torch.from_numpy(target), num_classes=None)


def _read(file: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(file, allow_pickle=False) as arrays:
            missing = {"x", "y"} - set(arrays.files)
            if missing:
                raise DDTrainError(f"{file}: missing array(s) {sorted(missing)}; has {arrays.files}")
            read = {}
            for name in ("x", "y"):
                try:
                    read[name] = arrays[name]
                except ValueError as exc:
                    if "allow_pickle" not in str(exc):
                        raise
                    raise DDTrainError(f"{file}: array {name} holds Python objects (stored as a pickle), "
                                       f"which ddtrain does not load; store numbers") from None
            return read["x"], read["y"]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise DDTrainError(f"{file}: not a readable .npz archive ({exc})") from None


def _labels(y: np.ndarray, file: Path, task: str, num_classes: int | None):
    """(labels, class count) when ``y`` holds class labels; None when it is regression targets (task auto)."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim == 1:
        return class_labels(y, file, num_classes)
    if y.ndim == 2 and y.shape[1] >= 2 and np.isin(y, (0, 1)).all():  # one-hot rows
        sums = y.sum(axis=1)
        if (sums != 1).any():
            row = int((sums != 1).argmax())
            raise DDTrainError(f"{file}: y looks one-hot ({y.shape[1]} columns of 0/1) but row {row} has "
                               f"{_count(sums[row])} ones ({int((sums != 1).sum())} such rows); each row needs "
                               f"exactly one, or say --data-arg task=regression")
        if num_classes is not None and num_classes != y.shape[1]:
            raise DDTrainError(f"{file}: y has {y.shape[1]} one-hot columns but num_classes={num_classes}")
        return y.argmax(1).astype(np.int64), y.shape[1]
    if task == "classification":
        raise DDTrainError(f"{file}: y has shape {y.shape}, not class labels: task=classification needs "
                           f"(N,) labels 0..K-1 or (N, K) one-hot rows")
    return None


def _count(value) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _to_nchw(x: np.ndarray, file: Path) -> torch.Tensor:
    with np.errstate(over="ignore"):  # reported just below, naming the sample
        x = x.astype(np.float32)
    check_finite(x, file, "x")  # after the cast: float64 values beyond float32's range become inf here
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] < x.shape[1]:
        x = x.transpose(0, 3, 1, 2)  # channels-last, as the document stores it
    elif x.ndim not in (2, 4):
        raise DDTrainError(f"{file}: x has shape {x.shape}; expected (N, H, W), (N, H, W, C) or (N, C, H, W)")
    return torch.from_numpy(np.ascontiguousarray(x))
