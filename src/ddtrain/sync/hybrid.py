"""``hybrid``: document 000's method -- ring all-reduce every step, rank 0's state broadcast every K steps.

"Decentralized training with a centralized parameter update" (000 ch. 5): every step the
gradients are averaged with the ring all-reduce (DDP + ddtrain's ``ring`` as the
communication hook, so bucketing and overlap stay), and every ``--sync-every K`` steps -- or
once per epoch with ``--sync-every epoch``, the document's setting -- rank 0 broadcasts its
parameters and floating-point buffers and every rank overwrites its own, so replicas cannot
drift apart. The broadcast is ddtrain's binomial-tree ``bcast`` of one flat buffer per dtype
(traffic counted under "bcast"; the ring's under "ring").

With a bitwise-deterministic ring (ours: every element is reduced on exactly one rank) the
replicas are already identical, and the divergence record shows it; the broadcast is the
insurance the document buys against reductions that are not (and against per-rank state
outside the gradients). Its cost is 000 Table 5.1's "proposed" column:
``2·E·(N/R)·(R−1) + N·(R−1)`` values per epoch with one broadcast per epoch.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.allreduce import hooked_ddp
from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.state import broadcast_, state_tensors

ALGORITHM = "ring"


def wrap_hybrid(model, optimizer, options: SyncOptions) -> Synced:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return Synced(model, optimizer, model, SyncStats(method="none: world size 1"))
    stats = SyncStats()
    ledger = Ledger((ALGORITHM, "bcast"))
    ddp, hook = hooked_ddp(model, options, ALGORITHM, ledger)
    synced = Synced(ddp, optimizer, model, stats)
    monitor = DivergenceMonitor(model, stats, None, options.check_every)
    every = options.sync_every
    steps, broadcasts = [0], [0]

    def broadcast() -> None:
        start = time.perf_counter()
        broadcast_(state_tensors(model), counted=True)
        ledger.wait_s += time.perf_counter() - start
        broadcasts[0] += 1

    def after_step(step: int) -> None:
        steps[0] += 1
        due = every != "epoch" and steps[0] % every == 0
        if due:
            broadcast()
        monitor.after_step(after_sync=due)

    def end_epoch(epoch: int) -> None:
        if every == "epoch":
            broadcast()
        monitor.end_epoch(epoch, after_sync=every == "epoch")

    def update_stats() -> None:
        ledger.fill(stats)
        stats.extra["broadcasts"] = broadcasts[0]
        stats.extra["sync_every"] = every

    synced.after_step, synced.end_epoch = after_step, end_epoch
    # identical right after each broadcast of rank 0's state
    synced.replicas_identical = lambda step: every != "epoch" and step % every == 0
    synced.finish, synced.update_stats = hook.close, update_stats
    return synced
