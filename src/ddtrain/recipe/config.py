"""The recipe section of ``TrainConfig``: batch, optimizer, learning-rate schedule, clipping, label smoothing.

A leaf (it imports only ``ddtrain.errors``) so that ``ddtrain.config`` can nest it; the recipe
itself, built from these settings, is ``ddtrain.recipe``. A field's ``metadata`` says whether
ranks must agree on it and what a resume requires (``ddtrain.config`` explains the words).
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field

from ddtrain.errors import ConfigError, check_choices

Optimizer = typing.Literal["sgd", "adam", "adamw"]
Schedule = typing.Literal["constant", "step", "multistep", "cosine", "onecycle", "linear"]
OPTIMIZERS = typing.get_args(Optimizer)
SCHEDULES = typing.get_args(Schedule)


@dataclass(kw_only=True)
class RecipeConfig:
    """The training recipe: batch, optimizer, learning rate and its schedule, clipping, label smoothing."""

    batch_size: int = field(default=64, metadata={"agree": True, "resume": "same-workers"})   # samples per micro-batch on each rank (set by --global-batch-size when given)
    global_batch_size: int = field(default=0, metadata={"agree": True, "resume": "same"})   # samples per optimizer update over all workers; per-rank batch = this / (workers x grad_accum) (0: batch_size x workers x grad_accum)
    grad_accum: int = field(default=1, metadata={"agree": True, "resume": "same-workers"})   # micro-batches per optimizer update (gradients communicated on the last one only)
    lr: float = field(default=0.05, metadata={"agree": True, "resume": "may-change"})   # peak learning rate (before --scale-lr)
    scale_lr: typing.Literal["none", "linear", "sqrt"] = field(default="none", metadata={"agree": True, "resume": "may-change"})   # multiply --lr by (global batch / --lr-reference-batch), or its square root
    lr_reference_batch: int = field(default=256, metadata={"agree": True, "resume": "may-change"})   # the global batch --lr is meant for (--scale-lr)
    lr_schedule: Schedule = field(default="constant", metadata={"agree": True, "resume": "may-change"})   # learning rate over the optimizer updates, after the warm-up
    lr_warmup_steps: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # optimizer updates of linear warm-up to the peak lr
    lr_warmup_epochs: float = field(default=0.0, metadata={"agree": True, "resume": "may-change"})   # warm-up in epochs (used when --warmup-steps is 0)
    lr_gamma: float = field(default=0.1, metadata={"agree": True, "resume": "may-change"})   # step/multistep: factor applied at each milestone
    lr_step_epochs: float = field(default=0.0, metadata={"agree": True, "resume": "may-change"})   # step: epochs between decays (0: a third of the run)
    lr_milestones: str = field(default="", metadata={"agree": True, "resume": "may-change"})   # multistep: epochs at which lr is multiplied by --lr-gamma, e.g. 30,60,80 (default: half and three quarters of the run)
    momentum: float = field(default=0.9, metadata={"agree": True, "resume": "may-change"})   # SGD momentum (heavy ball)
    weight_decay: float = field(default=0.0, metadata={"agree": True, "resume": "may-change"})   # weight decay (L2 for sgd/adam, decoupled for adamw)
    decay_exclude: typing.Literal["auto", "norms-biases", "none"] = field(default="auto", metadata={"agree": True, "resume": "same"})   # parameters kept out of weight decay (auto: norms and biases for adamw, none otherwise)
    optimizer: Optimizer = field(default="sgd", metadata={"agree": True, "resume": "same"})   # the optimizer
    clip_grad: float = field(default=0.0, metadata={"agree": True, "resume": "may-change"})   # clip the gradients' total norm to this before each update (0: off)
    label_smoothing: float = field(default=0.0, metadata={"agree": True, "resume": "may-change"})   # cross-entropy label smoothing (classification)

    def __post_init__(self):
        for name in ("batch_size", "grad_accum", "lr_reference_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        for name in ("global_batch_size", "lr_warmup_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        for name in ("lr", "momentum", "weight_decay", "lr_warmup_epochs", "lr_gamma", "lr_step_epochs", "clip_grad",
                     "label_smoothing"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(name, f"must be a finite number, got {value!r}")
        if not self.lr > 0:
            raise ConfigError("lr", f"must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError("momentum", f"must be in [0, 1), got {self.momentum}")
        for name in ("weight_decay", "lr_warmup_epochs", "lr_step_epochs", "clip_grad"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if not 0 < self.lr_gamma <= 1:
            raise ConfigError("lr_gamma", f"must be in (0, 1], got {self.lr_gamma}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError("label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")
        if not isinstance(self.lr_milestones, str):  # a config file may give a list
            self.lr_milestones = ",".join(str(v) for v in self.lr_milestones)
        check_choices(self)
