"""NumPy archives with arrays ``x`` and ``y``, the way document 000 stores its data.

``x`` is (N, H, W), (N, H, W, C) channels-last (the document's layout) or (N, C, H, W).
``y`` is (N,) class indices, (N, K) one-hot rows (the document's labels), or a float array
of per-sample targets (regression, e.g. T1 slices for the U-Net).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import torch

from ddtrain.errors import DDTrainError
from ddtrain.data.arrays import ArrayDataset


def load_npz(path: str) -> ArrayDataset:
    file = Path(path)
    if not file.is_file():
        raise DDTrainError(f"npz: file {file} does not exist")
    try:
        with np.load(file, allow_pickle=False) as arrays:
            missing = {"x", "y"} - set(arrays.files)
            if missing:
                raise DDTrainError(f"{file}: missing array(s) {sorted(missing)}; has {arrays.files}")
            x, y = arrays["x"], arrays["y"]
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as exc:
        raise DDTrainError(f"{file}: not a readable .npz archive ({exc})") from None
    if len(x) != len(y):
        raise DDTrainError(f"{file}: {len(x)} inputs in x but {len(y)} targets in y")
    x = _to_nchw(x, file)
    if y.ndim == 1 and np.issubdtype(y.dtype, np.integer):
        return ArrayDataset(x, torch.from_numpy(y.astype(np.int64)), num_classes=int(y.max()) + 1)
    if y.ndim == 2 and set(np.unique(y)).issubset({0, 1}):  # one-hot rows
        return ArrayDataset(x, torch.from_numpy(y.argmax(1).astype(np.int64)), num_classes=y.shape[1])
    target = y.astype(np.float32)
    if target.ndim == 1:
        target = target[:, None]
    elif target.ndim == 3:
        target = target[:, None]  # (N, H, W) -> (N, 1, H, W)
    return ArrayDataset(x, torch.from_numpy(target), num_classes=None)


def _to_nchw(x: np.ndarray, file: Path) -> torch.Tensor:
    x = x.astype(np.float32)
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] < x.shape[1]:
        x = x.transpose(0, 3, 1, 2)  # channels-last, as the document stores it
    elif x.ndim not in (2, 4):
        raise DDTrainError(f"{file}: x has shape {x.shape}; expected (N, H, W), (N, H, W, C) or (N, C, H, W)")
    return torch.from_numpy(np.ascontiguousarray(x))
