"""Checkpoints, restarts and what to do when training goes wrong."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ddtrain.errors import ConfigError


@dataclass(kw_only=True)
class ReliabilityConfig:
    """Checkpoints and failure handling (docs/RELIABILITY.md)."""

    checkpoint_dir: str | None = None                # write checkpoints here (rank 0; see docs/RELIABILITY.md)
    checkpoint_every: int = 0                           # steps between checkpoints (0: at the end of every epoch)
    keep: int = 3                                       # newest checkpoints to keep; older ones are deleted
    resume: bool = False                                # continue from the newest whole checkpoint in --checkpoint-dir
    resume_any: bool = False                            # with --resume: continue even from a checkpoint another run wrote into --checkpoint-dir (its lineage is adopted)
    resume_schedule_change: bool = False                # with --resume: continue even when the lr schedule's settings (--steps, --epochs, --lr-schedule, warm-up, milestones) give the updates already trained another lr than the checkpoint's; the updates after it follow this run's schedule
    max_restarts: int = 0                               # restart all workers this often after one fails (they resume from the last checkpoint)
    on_nonfinite: Literal["stop", "skip"] = "stop"      # non-finite loss or gradients: stop naming step and rank, or skip the step on every rank
    on_mismatch: Literal["stop", "rebroadcast"] = "stop"  # replicas differ at a --check-every check: stop, or copy rank 0's parameters to all

    def __post_init__(self):
        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError("keep", f"must be a positive integer, got {self.keep!r}")
        for name, allowed in (("on_nonfinite", ("stop", "skip")), ("on_mismatch", ("stop", "rebroadcast"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"{getattr(self, name)!r} is not one of: {', '.join(allowed)}")
        for name in ("resume_any", "resume_schedule_change"):
            if getattr(self, name) and not self.resume:
                raise ConfigError(name, "needs --resume")
        if not self.checkpoint_dir and (self.resume or self.checkpoint_every):
            raise ConfigError("resume" if self.resume else "checkpoint_every", "needs --checkpoint-dir DIR")
