"""Training settings, checked when built: the CLI fills this dataclass, the library accepts it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import ast

from ddtrain.errors import DDTrainError

AMP_MODES = ("off", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adam")


@dataclass(kw_only=True)
class TrainConfig:
    """One training run. Batch size is per rank (the global batch is batch_size × workers)."""

    model: str = "simple-cnn"              # name in ddtrain.models.MODELS
    data: str = "digits"                   # data spec, see ddtrain.data
    strategy: str = "ddp"                  # name in ddtrain.sync.STRATEGIES
    epochs: int = 1                        # passes over the data
    steps: int = 0                         # stop after this many steps in all (0: no limit)
    batch_size: int = 64                   # samples per step on each rank
    lr: float = 0.05                       # learning rate
    momentum: float = 0.9                  # SGD momentum (heavy ball)
    weight_decay: float = 0.0
    optimizer: str = "sgd"                 # sgd or adam
    seed: int = 0                          # model init, shuffling and dropout
    val_fraction: float = 0.2              # share of the data held out for validation
    sharding: str = "balanced"             # balanced or contiguous (document 000 Tables 6.1/6.2)
    loader_workers: int = 0                # DataLoader processes per rank (0: load in the training process)
    data_on_device: str = "auto"           # keep in-memory data on the GPU: auto, yes, no
    amp: str = "off"                       # autocast precision: off, bf16, fp16 (with a gradient scaler)
    channels_last: bool = False            # NHWC memory layout for convolutions
    compile: bool = False                  # torch.compile the model
    model_args: dict = field(default_factory=dict)   # extra builder options, e.g. {"hidden": (256, 128)}
    data_args: dict = field(default_factory=dict)    # extra loader options, e.g. {"resize": 128}
    sync_every: int | str = 1              # hybrid / local-sgd: steps between parameter syncs, or "epoch"
    servers: int = 1                       # ps-sync / ps-async: ranks holding parameters
    staleness: int = 4                     # ps-async: most versions a gradient may lag
    check_every: int = 0                   # steps between replica-divergence checks (0: epoch ends)
    log_every: int = 0                     # also print a line every N steps (0: epoch lines only)
    quiet: bool = False                    # no per-epoch lines or progress bar
    out: str | None = None                 # results record (JSON)
    save: str | None = None                # final model (.pt state dict or .safetensors)
    checkpoint_dir: str | None = None      # where checkpoints go (rank 0 writes, see ddtrain.reliability.checkpoint)
    checkpoint_every: int = 0              # steps between checkpoints (0: at every epoch end)
    keep: int = 3                          # checkpoints kept; older ones are deleted
    resume: bool = False                   # continue from the newest whole checkpoint in checkpoint_dir
    max_restarts: int = 0                  # torchrun restarts all workers this often after a failure
    on_nonfinite: str = "stop"             # non-finite loss or gradients: stop, or skip the step on every rank
    on_mismatch: str = "stop"              # replicas differ at a check: stop, or rebroadcast rank 0's parameters

    def __post_init__(self):
        positive = {"batch_size": self.batch_size, "servers": self.servers}
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise DDTrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        non_negative = {"epochs": self.epochs, "steps": self.steps, "loader_workers": self.loader_workers,
                        "staleness": self.staleness, "check_every": self.check_every, "log_every": self.log_every}
        for name, value in non_negative.items():
            if not isinstance(value, int) or value < 0:
                raise DDTrainError(f"--{name.replace('_', '-')} must be a non-negative integer, got {value!r}")
        if self.epochs == 0 and self.steps == 0:
            raise DDTrainError("nothing to do: --epochs and --steps are both 0")
        if not self.lr > 0:
            raise DDTrainError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise DDTrainError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.val_fraction < 1:
            raise DDTrainError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        for name, value, allowed in (("amp", self.amp, AMP_MODES), ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("data-on-device", self.data_on_device, ("auto", "yes", "no")),
                                     ("sharding", self.sharding, ("balanced", "contiguous"))):
            if value not in allowed:
                raise DDTrainError(f"--{name} {value!r} is not one of: {', '.join(allowed)}")
        if self.sync_every != "epoch" and (not isinstance(self.sync_every, int) or self.sync_every < 1):
            raise DDTrainError(f"--sync-every must be a positive integer or 'epoch', got {self.sync_every!r}")
        self._check_reliability()

    def _check_reliability(self):
        import math
        for name, value in (("lr", self.lr), ("momentum", self.momentum), ("weight_decay", self.weight_decay)):
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DDTrainError(f"--{name.replace('_', '-')} must be a finite number, got {value!r}")
        if self.weight_decay < 0:
            raise DDTrainError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise DDTrainError(f"--seed must be a non-negative integer, got {self.seed!r}")
        for name, value in (("checkpoint-every", self.checkpoint_every), ("max-restarts", self.max_restarts)):
            if not isinstance(value, int) or value < 0:
                raise DDTrainError(f"--{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise DDTrainError(f"--keep must be a positive integer, got {self.keep!r}")
        for name, value in (("on-nonfinite", self.on_nonfinite), ("on-mismatch", self.on_mismatch)):
            allowed = ("stop", "skip") if name == "on-nonfinite" else ("stop", "rebroadcast")
            if value not in allowed:
                raise DDTrainError(f"--{name} {value!r} is not one of: {', '.join(allowed)}")
        if not self.checkpoint_dir and (self.resume or self.checkpoint_every):
            flag = "--resume" if self.resume else "--checkpoint-every"
            raise DDTrainError(f"{flag} needs --checkpoint-dir DIR")
        from ddtrain.sync import strategy_spec  # here: the registry imports torch.distributed
        if self.checkpoint_dir and not strategy_spec(self.strategy).checkpointable:
            raise DDTrainError(f"checkpoints are not supported with --strategy {self.strategy}: the parameter "
                               "servers' state lives outside the training loop (use --max-restarts alone, which "
                               "restarts from step 0)")

    def as_dict(self) -> dict:
        return asdict(self)


def parse_kv(items: list[str], flag: str) -> dict:
    """``["hidden=256,128", "dropout=0"]`` -> ``{"hidden": (256, 128), "dropout": 0}``."""
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise DDTrainError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word stays a string
        out[key.replace("-", "_")] = value
    return out
