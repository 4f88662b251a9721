"""In-memory datasets as two tensors: the fast path every small dataset takes."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


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

    def select(self, idx: torch.Tensor) -> "ArrayDataset":
        return ArrayDataset(self.x[idx], self.y[idx], num_classes=self.num_classes)

    def to(self, device) -> "ArrayDataset":
        """A copy resident on ``device`` (the GPU path: copied once, never per step)."""
        return ArrayDataset(self.x.to(device), self.y.to(device), num_classes=self.num_classes)
