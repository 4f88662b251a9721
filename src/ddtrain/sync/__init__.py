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
import torch.distributed as dist

from ddtrain.dist import runtime
from ddtrain.errors import choice_error
from ddtrain.sync.allreduce import strategy_for
from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.spec import StrategySpec
from ddtrain.sync.ddp import wrap_ddp
from ddtrain.sync.hybrid import wrap_hybrid
from ddtrain.sync.local_sgd import wrap_local_sgd
from ddtrain.sync.ps.server import wrap_param_server

STRATEGIES: dict[str, StrategySpec] = {}


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` to ``STRATEGIES`` (a new strategy from outside the package needs only this call)."""
    STRATEGIES[spec.name] = spec
    return spec


for _spec in (
    StrategySpec(name="ddp", build=wrap_ddp, summary="DDP with the backend's own all-reduce (the default)",
                 sync_in_backward=True, algorithm="native"),
    *(StrategySpec(name=name, build=strategy_for(name), sync_in_backward=True, algorithm=name,
                   summary=f"DDP with ddtrain's {name} all-reduce as its communication hook")
      for name in ("ring", "ring-async", "tree", "butterfly", "central")),
    StrategySpec(name="ps-sync", build=partial(wrap_param_server, asynchronous=False), uses_servers=True,
                 replicated=False, checkpointable=False, algorithm="central",  # the master pattern over workers + servers
                 summary="parameter servers on the last --servers ranks; each step waits for every worker"),
    StrategySpec(name="ps-async", build=partial(wrap_param_server, asynchronous=True), uses_servers=True,
                 replicated=False, checkpointable=False, synchronous=False,
                 summary="parameter servers applying each gradient as it arrives (--staleness bounds the lag)"),
    StrategySpec(name="hybrid", build=wrap_hybrid, replicated=False, sync_in_backward=True, periodic=True,
                 algorithm="ring", summary="ring all-reduce every step + rank 0's broadcast every --sync-every steps (000 ch. 5)"),
    StrategySpec(name="local-sgd", build=wrap_local_sgd, replicated=False, periodic=True, synchronous=False,
                 summary="local steps; parameters averaged every --sync-every steps"),
):
    register_strategy(_spec)


def strategy_spec(name: str) -> StrategySpec:
    """The record of strategy ``name``; an unknown name lists the valid ones."""
    if name not in STRATEGIES:
        raise choice_error("strategy", name, STRATEGIES)
    return STRATEGIES[name]


def wrap(strategy: str, model, optimizer, options: SyncOptions | None = None) -> Synced:
    """Apply ``strategy`` to a model already on its device and an optimizer over its parameters."""
    spec = strategy_spec(strategy)
    synced = spec.build(model, optimizer, options or SyncOptions())
    synced.spec = spec
    if synced.replicas_identical is None:
        synced.replicas_identical = lambda step: spec.replicated
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


__all__ = ["STRATEGIES", "StrategySpec", "SyncOptions", "SyncStats", "Synced", "register_strategy", "strategy_spec", "wrap"]
