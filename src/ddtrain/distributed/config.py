"""How this process joins the job: the backend and the one deadline every wait obeys."""
from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass
from typing import Literal

from ddtrain.errors import ConfigError, check_choices

# 300 s: long enough for a slow first NCCL connect or a big checkpoint gather on shared disks,
# short enough that a dead peer is reported within minutes.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DDTRAIN_TIMEOUT_S"   # the default for library users who never build a DistConfig
Backend = Literal["gloo", "nccl"]   # the process-group backends (--backend's choices, DDTRAIN_BACKEND's values)
BACKENDS = typing.get_args(Backend)


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


def size_range(value, field: str, flag: str | None = None) -> tuple[int, int]:
    """(MIN, MAX) of a size given as ``N`` or ``MIN:MAX`` (torchrun's ``--nnodes`` form); ConfigError otherwise.

    ``N`` means exactly N (MIN = MAX = N). Checked before anything starts: whole numbers, MIN >= 1, MIN <= MAX.
    """
    flag = flag or "--" + field.replace("_", "-")
    text = str(value).strip() if not isinstance(value, bool) else repr(value)
    low, sep, high = text.partition(":")
    if isinstance(value, bool) or not (low.strip().isdecimal() and (not sep or high.strip().isdecimal())):
        raise ConfigError(field, f"must be a whole number N or a range MIN:MAX of whole numbers (e.g. 2:4), "
                                 f"got {value!r}", flag=flag)
    least, most = int(low), int(high) if sep else int(low)
    if least < 1:
        raise ConfigError(field, f"{'MIN ' if sep else ''}must be at least 1, got {text!r}", flag=flag)
    if least > most:
        raise ConfigError(field, f"MIN {least} is more than MAX {most} in {text!r}; write MIN:MAX with MIN <= MAX",
                          flag=flag)
    return least, most


@dataclass(kw_only=True)
class DistConfig:
    """Process group settings."""

    backend: Backend | None = None   # override the backend choice (NCCL when every local rank has a GPU)
    timeout: float = DEFAULT_TIMEOUT_S                   # seconds any rank waits on another before failing
    nnodes: int | str = 1                          # nodes of a multi-node launch (run the same command on each), or MIN:MAX for an elastic job that goes on with MIN..MAX nodes (needs --max-restarts)
    node_rank: int = 0                                   # this node's index, 0..nnodes-1 (without restarts; with --max-restarts the rendezvous assigns it)
    rdzv_endpoint: str | None = None                  # HOST:PORT of node 0 for a multi-node launch (every node passes the same)
    skip_doctor: bool = False                            # skip comparing Python/torch/CUDA/NCCL across nodes at the start of a multi-node job

    def __post_init__(self):
        check_choices(self)
        if not isinstance(self.timeout, (int, float)) or not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ConfigError("timeout", f"must be a positive number of seconds, got {self.timeout!r}")
        least, most = size_range(self.nnodes, "nnodes")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < most:
            raise ConfigError("node_rank", f"must be in 0..{most - 1} for nnodes {self.nnodes}, got {self.node_rank!r}",
                              mentions=("nnodes",))
        if most > 1:
            host, _, port = (self.rdzv_endpoint or "").rpartition(":")
            if not host or not port.isdecimal() or not 0 < int(port) < 65536:
                raise ConfigError("rdzv_endpoint", f"a multi-node launch needs HOST:PORT of node 0 (the same on "
                                                   f"every node), got {self.rdzv_endpoint!r}")

    @property
    def min_nodes(self) -> int:
        """The fewest nodes the job goes on with (``--nnodes MIN:MAX``; ``N`` alone: N)."""
        return size_range(self.nnodes, "nnodes")[0]

    @property
    def max_nodes(self) -> int:
        """The most nodes the job runs on (``--nnodes MIN:MAX``; ``N`` alone: N)."""
        return size_range(self.nnodes, "nnodes")[1]
