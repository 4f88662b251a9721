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
    nnodes: int = 1                                      # nodes of a multi-node launch; run the same command on each
    node_rank: int = 0                                   # this node's index, 0..nnodes-1 (without restarts; with --max-restarts the rendezvous assigns it)
    rdzv_endpoint: Optional[str] = None                  # HOST:PORT of node 0 for a multi-node launch (every node passes the same)
    skip_doctor: bool = False                            # skip comparing Python/torch/CUDA/NCCL across nodes at the start of a multi-node job

    def __post_init__(self):
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError("backend", f"{self.backend!r} is not one of: gloo, nccl")
        if not isinstance(self.timeout, (int, float)) or not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError("timeout", f"must be a positive number of seconds, got {self.timeout!r}")
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise ConfigError("nnodes", f"must be at least 1, got {self.nnodes!r}")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("node_rank", f"must be in 0..{self.nnodes - 1} for --nnodes {self.nnodes}, "
                                           f"got {self.node_rank!r}")
        if self.nnodes > 1:
            host, _, port = (self.rdzv_endpoint or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError("rdzv_endpoint", f"a multi-node launch needs HOST:PORT of node 0 (the same on "
                                                   f"every node), got {self.rdzv_endpoint!r}")
