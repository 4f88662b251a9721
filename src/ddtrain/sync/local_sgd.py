"""``local-sgd``: every rank steps on its own gradients; parameters are averaged every K steps.

No per-step gradient synchronisation at all: between averagings the replicas drift apart
(different data, different dropout), and every ``--sync-every K`` steps (or at every epoch
end with ``--sync-every epoch``) their parameters and floating-point buffers are replaced by
the mean over all ranks, with ddtrain's ``ring`` all-reduce (traffic counted under "ring").
The run also ends with an averaging if steps were taken since the last one, so the model
every rank returns (and rank 0 saves) is the average.

Equivalence: with K=1 and plain SGD, averaging ``p - lr·g_r`` over the ranks is
``p - lr·mean(g_r)``, the one-process step with the global batch. Heavy-ball momentum keeps
that (the momentum buffers stay per rank, but they are linear in the gradients, so their
mean follows the global recursion; weight decay acts on parameters that are equal); Adam's
per-element normalisation is not linear and does not. With K > 1 the replicas see different
parameters between averagings and no optimizer is equivalent.
Rank 0's initial state is broadcast once (not counted), as DDP does.
"""
from __future__ import annotations

import time

import torch.distributed as dist

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.state import average_, broadcast_, state_tensors

ALGORITHM = "ring"


def wrap_local_sgd(model, optimizer, options: SyncOptions) -> Synced:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return Synced(model, optimizer, model, SyncStats(method="none: world size 1"))
    broadcast_(state_tensors(model), counted=False)
    stats = SyncStats()
    ledger = Ledger((ALGORITHM,))
    synced = Synced(model, optimizer, model, stats)
    monitor = DivergenceMonitor(model, stats, None, options.check_every)
    every = options.sync_every
    steps, averaged_at, averagings = [0], [0], [0]   # steps taken, steps at the last averaging, averagings

    def average() -> None:
        start = time.perf_counter()
        average_(state_tensors(model), algorithm=ALGORITHM)
        ledger.wait_s += time.perf_counter() - start
        averaged_at[0] = steps[0]
        averagings[0] += 1

    def after_step(step: int) -> None:
        steps[0] += 1
        due = every != "epoch" and steps[0] % every == 0
        if due:
            average()
        monitor.after_step(after_sync=due)

    def end_epoch(epoch: int) -> None:
        if every == "epoch":
            average()
        monitor.end_epoch(epoch, after_sync=every == "epoch")

    def finish() -> None:
        if steps[0] > averaged_at[0]:
            average()

    def update_stats() -> None:
        ledger.fill(stats)
        stats.extra["averagings"] = averagings[0]
        stats.extra["sync_every"] = every

    synced.after_step, synced.end_epoch = after_step, end_epoch
    synced.finish, synced.update_stats = finish, update_stats
    return synced
