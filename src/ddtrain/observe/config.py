"""What to measure during a run: the step split, a trace, system monitors."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ddtrain.errors import ConfigError


@dataclass(kw_only=True)
class ProfileConfig:
    """Measurement (ddtrain bench scaling sets these; docs/PERFORMANCE.md defines every figure)."""

    profile: bool = False                 # add each rank's step split (data, compute, communication wait, optimizer) to the record
    trace: str | None = None           # write a Chrome-trace JSON of every rank on one clock (implies --profile)
    # Not "--monitor": torchrun's parser (which run_local feeds our flags through) would take it
    # for an abbreviation of its own --monitor-interval and stop.
    monitor_system: bool = False          # sample CPU, GPU and network per rank into the record (implies --profile)
    monitor_every: float = 0.5            # seconds between --monitor-system samples
    warmup_steps: int | Literal["auto"] = "auto"   # steps left out of the profile's times: auto (the first step, a lasting warm-up, recompilations under --compile: docs/PERFORMANCE.md) or the first N

    def __post_init__(self):
        if self.trace and not str(self.trace).endswith(".json"):
            raise ConfigError("trace", f"{self.trace!r} should name a .json file")
        if not isinstance(self.monitor_every, (int, float)) or not (self.monitor_every > 0 and math.isfinite(self.monitor_every)):
            raise ConfigError("monitor_every", f"must be positive, got {self.monitor_every}")
        if self.warmup_steps != "auto" and (not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool)
                                            or self.warmup_steps < 0):
            raise ConfigError("warmup_steps", f"must be auto or a number >= 0, got {self.warmup_steps!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.profile or self.trace or self.monitor_system)
