"""How replicas stay consistent during training: one module per strategy, one line in STRATEGIES.

    ddp                  DDP with the backend's own all-reduce (the default)              ddp.py
    ring, ring-async,    DDP with that ddtrain.comm all-reduce as the communication       allreduce.py
    tree, butterfly,     hook (bucketing and overlap kept)
    central
    ps-sync, ps-async    parameter servers on the last --servers ranks                   param_server.py,
                                                                                          ps_async.py
    hybrid               ring every step + rank 0's broadcast every K steps (000 ch. 5)   hybrid.py
    local-sgd            local steps, parameters averaged every K steps                   local_sgd.py

A strategy is a function ``wrap(model, optimizer, options) -> Synced``: it returns the model
to call (e.g. DDP-wrapped), the optimizer to step (wrapped where the strategy syncs inside
``step()``), the rank's role, and a ``SyncStats`` that reports traffic (``accounting``),
waiting and the replica divergence (``divergence``). At world size 1 every strategy returns
the model and optimizer unchanged.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch.distributed as dist

from ddtrain.dist import runtime
from ddtrain.errors import choice_error
from ddtrain.sync.allreduce import strategy_for
from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.ddp import wrap_ddp
from ddtrain.sync.hybrid import wrap_hybrid
from ddtrain.sync.local_sgd import wrap_local_sgd
from ddtrain.sync.ps.server import wrap_param_server

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
    _finish_once(synced)
    return synced


def _finish_once(synced: Synced) -> None:
    """``finish`` runs exactly once: when the loop calls it, or else at ``ddtrain.shutdown()``.

    ``fit`` calls it; a script on the ``prepare`` path only calls ``ddtrain.shutdown()``, and
    parameter servers (waiting for STOP) and local SGD (a last averaging) need it there too.
    """
    inner, done = synced.finish, []

    def finish() -> None:
        if done:
            return
        done.append(True)
        if finish in runtime.AT_SHUTDOWN:   # not there when shutdown() is the caller
            runtime.AT_SHUTDOWN.remove(finish)
        inner()

    runtime.AT_SHUTDOWN.append(finish)
    synced.finish = finish


__all__ = ["STRATEGIES", "SyncOptions", "SyncStats", "Synced", "wrap"]
