"""The data section of ``TrainConfig``: what to train on, its validation split, and how each rank gets its share.

The data package owns these settings (``load_dataset``, ``ShardSampler`` and ``ShardLoader``
read them). A field's ``metadata`` says whether ranks must agree on it and what a resume
requires (``ddtrain.config`` explains the words; ``reliability.consistency`` reads them).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from ddtrain.data.sharding import Sharding
from ddtrain.errors import ConfigError, check_choices

@dataclass(kw_only=True)
class DataConfig:
    """The data set, its validation split, and how samples are shared among ranks and loaded."""

    # The data set is compared by what it holds (its size, sample shape, dtype and classes are in the
    # start-up fingerprint), not by its spec, whose paths may differ between hosts: "content".

    data: str = field(default="digits", metadata={"agree": "content", "resume": "content"})   # data spec: digits, mnist:DIR, npz:FILE, ... (see ddtrain.data)
    data_args: dict = field(default_factory=dict, metadata={"agree": "content", "resume": "content"})   # data loader option, e.g. resize=128
    val_fraction: float = field(default=0.2, metadata={"agree": True, "resume": "same"})   # share of the data held out for validation
    sharding: Sharding = field(default="balanced", metadata={"agree": True, "resume": "same"})   # how samples are split over ranks (document 000 Tables 6.1/6.2)
    balance: typing.Literal["none", "measure", "speed"] = field(default="none", metadata={"agree": True, "resume": "may-change"})   # split the global batch by each worker's measured speed (speed; needs --global-batch-size), or only measure and report stragglers (measure); docs/BALANCE.md
    balance_every: int = field(default=10, metadata={"agree": True, "resume": "may-change"})   # steps between the --balance re-measures
    loader_workers: int = 0                # DataLoader processes per rank (0: load in the training process)
    data_on_device: typing.Literal["auto", "yes", "no"] = "auto"   # keep in-memory datasets on the GPU (auto: when training on CUDA)

    def __post_init__(self):
        check_choices(self)
        if not isinstance(self.loader_workers, int) or isinstance(self.loader_workers, bool) or self.loader_workers < 0:
            raise ConfigError("loader_workers", f"must be a non-negative integer, got {self.loader_workers!r}")
        if not isinstance(self.balance_every, int) or isinstance(self.balance_every, bool) or self.balance_every < 1:
            raise ConfigError("balance_every", f"must be a positive integer, got {self.balance_every!r}")
        value = self.val_fraction
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise ConfigError("val_fraction", f"must be in [0, 1), got {value!r}")
