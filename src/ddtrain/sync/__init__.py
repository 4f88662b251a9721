"""How replicas stay consistent during training: one module per strategy, one line in STRATEGIES.

A strategy is a function ``wrap(model, optimizer, options) -> Synced``: it returns the model
to call (e.g. DDP-wrapped), the optimizer to step (wrapped where the strategy syncs inside
``step()``), and a ``SyncStats`` that reports traffic and waiting. At world size 1 every
strategy returns the model and optimizer unchanged.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch.distributed as dist

from ..errors import choice_error
from .allreduce import strategy_for
from .base import Synced, SyncOptions, SyncStats
from .ddp import wrap_ddp
from .hybrid import wrap_hybrid
from .local_sgd import wrap_local_sgd
from .param_server import wrap_param_server

STRATEGIES: dict[str, Callable[..., Synced]] = {
    "ddp": wrap_ddp,
    "ring": strategy_for("ring"),
    "ring-async": strategy_for("ring-async"),
    "tree": strategy_for("tree"),
    "butterfly": strategy_for("butterfly"),
    "central": strategy_for("central"),
    "ps-sync": partial(wrap_param_server, asynchronous=False),
    "ps-async": partial(wrap_param_server, asynchronous=True),
    "hybrid": wrap_hybrid,
    "local-sgd": wrap_local_sgd,
}


def wrap(strategy: str, model, optimizer, options: SyncOptions | None = None) -> Synced:
    """Apply ``strategy`` to a model already on its device and an optimizer over its parameters."""
    if strategy not in STRATEGIES:
        raise choice_error("strategy", strategy, STRATEGIES)
    synced = STRATEGIES[strategy](model, optimizer, options or SyncOptions())
    if synced.workers is None:  # every rank trains unless the strategy says otherwise
        synced.workers = dist.get_world_size() if dist.is_initialized() else 1
        synced.worker_rank = dist.get_rank() if dist.is_initialized() else 0
    return synced
