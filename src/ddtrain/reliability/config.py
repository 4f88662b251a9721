"""Checkpoints, restarts and what to do when training goes wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ddtrain.errors import ConfigError, check_choices


@dataclass(kw_only=True)
class ReliabilityConfig:
    """Checkpoints and failure handling (docs/RELIABILITY.md)."""

    checkpoint_dir: str | None = None                # write checkpoints here (rank 0; see docs/RELIABILITY.md)
    checkpoint_every: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # steps between checkpoints (0: at the end of every epoch)
    keep: int = 3                                       # newest checkpoints to keep; older ones are deleted
    resume: bool = False                                # continue from the newest whole checkpoint in --checkpoint-dir
    resume_any: bool = False                            # with --resume: continue even from a checkpoint another run wrote into --checkpoint-dir (its lineage is adopted)
    max_restarts: int = 0                               # restart all workers this often after one fails (they resume from the last checkpoint)
    on_nonfinite: Literal["stop", "skip"] = field(default="stop", metadata={"agree": True, "resume": "may-change"})   # non-finite loss or gradients: stop naming step and rank, or skip the step on every rank
    on_mismatch: Literal["stop", "rebroadcast"] = field(default="stop", metadata={"agree": True, "resume": "may-change"})   # replicas differ at a --check-every check: stop, or copy rank 0's parameters to all

    def __post_init__(self):
        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError("keep", f"must be a positive integer, got {self.keep!r}")
        check_choices(self)
        if self.resume_any and not self.resume:
            raise ConfigError("resume_any", "needs resume", mentions=("resume",))
        if not self.checkpoint_dir and (self.resume or self.checkpoint_every):
            raise ConfigError("resume" if self.resume else "checkpoint_every", "needs checkpoint_dir")
