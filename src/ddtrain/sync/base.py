"""What every strategy returns and reports."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn


@dataclass(kw_only=True)
class SyncOptions:
    """Strategy settings; each strategy reads the ones it needs."""

    sync_every: int | str = 1        # hybrid / local-sgd: steps between parameter syncs, or "epoch"
    servers: int = 1                 # ps-*: how many ranks hold parameters
    staleness: int = 4               # ps-async: most versions a gradient may lag
    bucket_cap_mb: float = 25.0      # DDP gradient bucket size
    check_every: int = 0             # steps between replica-divergence checks (0: at epoch ends only)
    timeout_s: float | None = None   # ps-*: seconds a rank waits on a peer (None: ddtrain.init()'s timeout)

    def __post_init__(self):
        if self.sync_every != "epoch" and (not isinstance(self.sync_every, int) or self.sync_every < 1):
            raise ValueError(f"sync_every must be a positive integer or 'epoch', got {self.sync_every!r}")
        if self.servers < 1:
            raise ValueError(f"servers must be at least 1, got {self.servers}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.check_every < 0:
            raise ValueError(f"check_every must be >= 0, got {self.check_every}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")


@dataclass
class SyncStats:
    """Traffic and waiting of this rank. ``method`` says whether bytes were counted or computed."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    comm_wait_s: float = 0.0
    method: str = "counted"
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "comm_wait_s": round(self.comm_wait_s, 6), "method": self.method, **self.extra}


def _noop(*_args, **_kwargs):
    return None


@dataclass
class Synced:
    """A strategy applied: call ``model``, step ``optimizer``, read ``stats``.

    ``role`` is "worker" for ranks that train on data, "server" for parameter-server ranks,
    which run ``serve()`` instead of the training loop. ``after_step(step)`` and
    ``end_epoch(epoch)`` are called by the loop (and by ``prepare``'s optimizer wrapper).
    """

    model: nn.Module
    optimizer: object
    module: nn.Module                       # the bare model, for evaluation and saving
    stats: SyncStats = field(default_factory=SyncStats)
    role: str = "worker"
    workers: int | None = None              # ranks that train on data (None: every rank)
    worker_rank: int | None = None          # this rank's index among them (None: its rank)
    group: object = None                    # process group of the workers (None: every rank)
    after_step: Callable[[int], None] = _noop
    end_epoch: Callable[[int], None] = _noop
    serve: Callable[[], None] = _noop
    finish: Callable[[], None] = _noop     # called once when training ends
    update_stats: Callable[[], None] = _noop  # refresh ``stats`` before reading
    replicas_identical: Callable[[int], bool] | None = None  # None: ``spec.replicated`` at every step
    spec: object = None                     # the StrategySpec it was built from (set by ``wrap``)
