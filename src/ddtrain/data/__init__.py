"""Data formats, one file each, looked up by the spec's prefix in DATASETS.

A spec is ``FORMAT`` or ``FORMAT:ARG`` (``digits``, ``mnist:DIR``, ``npz:FILE``, ...). Each
loader returns an ``ArrayDataset`` (or any map-style torch Dataset with the same
attributes); ``load_dataset`` adds the validation split. Nothing here knows about
distribution except ``sharding``, which only computes index lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch
from torch.utils.data import Dataset, Subset

from ddtrain.errors import ConfigError, DDTrainError, choice_error
from ddtrain.data.arrays import ArrayDataset  # noqa: F401  (re-exported: ddtrain.data.ArrayDataset)
from ddtrain.data.cifar10 import load_cifar10
from ddtrain.data.digits import load_digits
from ddtrain.data.imagefolder import load_imagefolder
from ddtrain.data.mnist import load_mnist
from ddtrain.data.nifti import load_nifti
from ddtrain.data.npz import load_npz
from ddtrain.data.packed import load_packed
from ddtrain.data.synthetic import load_synthetic

DATASETS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "mnist": load_mnist,
    "npz": load_npz,
    "cifar10": load_cifar10,
    "imagefolder": load_imagefolder,
    "packed": load_packed,
    "nifti": load_nifti,
    "synthetic": load_synthetic,
}
NEEDS_ARG = {"mnist": "DIR", "npz": "FILE", "cifar10": "DIR", "imagefolder": "DIR", "packed": "DIR",
             "nifti": "DIR", "synthetic": "NAME"}


@dataclass
class Data:
    """A dataset split for training: what the model builder and the loop need to know."""

    name: str
    train: Dataset
    val: Dataset | None
    num_classes: int | None      # None for regression targets
    sample_shape: tuple[int, ...]  # (C, H, W) of one input
    task: str                    # "classification" or "regression"


def parse_spec(spec: str) -> tuple[str, str | None]:
    fmt, sep, arg = spec.partition(":")
    if fmt not in DATASETS:
        raise choice_error("data format", fmt, [f"{k}:{v}" if k in NEEDS_ARG else k
                                                for k, v in {**dict.fromkeys(DATASETS), **NEEDS_ARG}.items()])
    if fmt in NEEDS_ARG and not arg:
        raise DDTrainError(f"data spec {spec!r} needs a path: {fmt}:{NEEDS_ARG[fmt]}")
    return fmt, (arg or None)


def load_dataset(spec: str, *, val_fraction: float = 0.2, seed: int = 0, **options) -> Data:
    """Load ``spec`` and split off ``val_fraction`` of it (a fixed, seeded choice) for validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError("val_fraction", f"must be in [0, 1), got {val_fraction}")
    fmt, arg = parse_spec(spec)
    loader = DATASETS[fmt]
    full = loader(arg, **options) if fmt in NEEDS_ARG or arg else loader(**options)
    n = len(full)
    n_val = int(round(n * val_fraction))
    if n - n_val < 1:
        raise DDTrainError(f"{spec}: {n} samples leave nothing to train on after the validation split")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    if n_val:  # a dataset with train-time augmentation validates on its eval_view
        evaluated = full.eval_view() if hasattr(full, "eval_view") else full
        train, val = _subset(full, order[n_val:]), _subset(evaluated, order[:n_val])
    else:
        train, val = full, None
    return Data(spec, train, val, full.num_classes, tuple(full.sample_shape), full.task)


def _subset(ds: Dataset, idx: torch.Tensor) -> Dataset:
    if hasattr(ds, "select"):  # ArrayDataset, BatchDataset, ImageDataset: stay lazy and batchable
        return ds.select(idx)
    sub = Subset(ds, idx.tolist())
    for attr in ("num_classes", "sample_shape", "task"):
        setattr(sub, attr, getattr(ds, attr))
    return sub
