"""Checkpoints, restarts and what to do when training goes wrong."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ddtrain.errors import ConfigError, DDTrainError, check_choices


@dataclass(kw_only=True)
class ReliabilityConfig:
    """Checkpoints and failure handling (docs/RELIABILITY.md)."""

    checkpoint_dir: str | None = None                # write checkpoints here (rank 0; see docs/RELIABILITY.md)
    checkpoint_every: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # steps between checkpoints (0: at the end of every epoch)
    keep: int = 3                                       # newest checkpoints to keep; older ones are deleted
    resume: bool = False                                # continue from the newest whole checkpoint in --checkpoint-dir
    resume_any: bool = False                            # with --resume: continue even from a checkpoint another run wrote into --checkpoint-dir (its lineage is adopted)
    resume_schedule_change: bool = False                # with --resume: continue even when the lr schedule's settings (--steps, --epochs, --lr-schedule, warm-up, milestones) give the updates already trained another lr than the checkpoint's; the updates after it follow this run's schedule
    resume_data_change: bool = False                    # with --resume: continue even when the training data differs from the checkpoint's (labels or a sample of inputs: another file of the same size and shape)
    max_restarts: int = 0                               # restart all workers this often after one fails (they resume from the last checkpoint)
    on_nonfinite: Literal["stop", "skip"] = field(default="stop", metadata={"agree": True, "resume": "may-change"})   # non-finite loss or gradients: stop naming step and rank, or skip the step on every rank
    on_mismatch: Literal["stop", "rebroadcast"] = field(default="stop", metadata={"agree": True, "resume": "may-change"})   # replicas differ at a --check-every check: stop, or copy rank 0's parameters to all
    checkpoint_sync: bool = False                       # write checkpoints on the training thread (default: copied there, written to disk in the background)
    preempt_signal: str = ""                            # with --checkpoint-dir, also stop and save on this signal (e.g. USR1 for sbatch --signal=USR1@120); SIGTERM and SIGINT always do (docs/RELIABILITY.md)
    preempt_grace_s: float = 120.0                      # after a stop signal, seconds the launcher gives its workers to finish the step and save before killing them
    requeue: bool = False                               # under SLURM, after a preemption checkpoint: requeue the job (scontrol requeue); the requeued job resumes by itself

    def __post_init__(self):
        for name in ("checkpoint_every", "max_restarts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        if not isinstance(self.keep, int) or isinstance(self.keep, bool) or self.keep < 1:
            raise ConfigError("keep", f"must be a positive integer, got {self.keep!r}")
        check_choices(self)
        if not isinstance(self.preempt_grace_s, (int, float)) or isinstance(self.preempt_grace_s, bool) \
                or not 0 < self.preempt_grace_s < float("inf"):
            raise ConfigError("preempt_grace_s", f"must be a positive number of seconds, got {self.preempt_grace_s!r}")
        from ddtrain.reliability.preemption import parse_signals
        try:
            parse_signals(self.preempt_signal)
        except DDTrainError as exc:
            raise ConfigError("preempt_signal", str(exc).split(" ", 1)[-1]) from None
        for name in ("resume_any", "resume_schedule_change", "resume_data_change"):
            if getattr(self, name) and not self.resume:
                raise ConfigError(name, "needs resume", mentions=("resume",))
        for name in ("resume", "checkpoint_every", "preempt_signal", "requeue"):
            if getattr(self, name) and not self.checkpoint_dir:
                raise ConfigError(name, "needs checkpoint_dir", mentions=(name,) if "_" not in name else ())

    def preempt_signals(self) -> tuple[str, ...]:
        """The signals that stop training with a checkpoint: SIGTERM, SIGINT and --preempt-signal's."""
        from ddtrain.reliability.preemption import ALWAYS, parse_signals
        return tuple(dict.fromkeys((*ALWAYS, *parse_signals(self.preempt_signal))))
