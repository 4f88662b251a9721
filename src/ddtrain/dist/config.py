"""How this process joins the job: the backend and the one deadline every wait obeys."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal, Optional

from ddtrain.errors import ConfigError

# 300 s: long enough for a slow first NCCL connect or a big checkpoint gather on shared disks,
# short enough that a dead peer is reported within minutes.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DDTRAIN_TIMEOUT_S"   # the default for library users who never build a DistConfig


def default_timeout_s() -> float:
    """``DDTRAIN_TIMEOUT_S`` if set (checked), else 300 s."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(TIMEOUT_ENV, f"must be a number of seconds, got {raw!r}", flag=TIMEOUT_ENV) from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(TIMEOUT_ENV, f"must be a positive number of seconds, got {raw!r}", flag=TIMEOUT_ENV)
    return value


@dataclass(kw_only=True)
class DistConfig:
    """Process group settings."""

    backend: Optional[Literal["gloo", "nccl"]] = None   # override the backend choice (NCCL when every local rank has a GPU)
    timeout: float = DEFAULT_TIMEOUT_S                   # seconds any rank waits on another before failing

    def __post_init__(self):
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError("backend", f"{self.backend!r} is not one of: gloo, nccl")
        if not isinstance(self.timeout, (int, float)) or not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError("timeout", f"must be a positive number of seconds, got {self.timeout!r}")
