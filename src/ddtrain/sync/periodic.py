"""What ``hybrid`` and ``local-sgd`` share: a parameter sync every ``--sync-every K`` steps, or at each epoch end.

A subclass says what the sync is (``sync_()``: rank 0's broadcast, an average) and the name of
its count in the stats; this class counts the steps, decides when a sync is due, times it into
the ledger and tells the divergence monitor which checks ran right after one.
"""
from __future__ import annotations

import time

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Strategy, SyncOptions
from ddtrain.sync.divergence import DivergenceMonitor


class PeriodicStrategy(Strategy):
    """Sync every ``options.sync_every`` steps (an int) or at every epoch end ("epoch")."""

    SYNCS_NAME = "syncs"      # the count's key in ``stats.extra`` ("broadcasts", "averagings")

    def __init__(self, model, optimizer, options: SyncOptions, *, ledger: Ledger, module=None):
        super().__init__(model, optimizer, module=module)
        self.every = options.sync_every
        self.ledger = ledger
        self.monitor = DivergenceMonitor(self.module, self.stats, None, options.check_every)
        self.steps = 0            # steps taken
        self.synced_at = 0        # steps taken at the last sync
        self.syncs = 0

    def sync_(self) -> None:
        """Make the replicas agree (the subclass's action)."""
        raise NotImplementedError

    def sync(self) -> None:
        start = time.perf_counter()
        self.sync_()
        self.ledger.wait_s += time.perf_counter() - start
        self.synced_at = self.steps
        self.syncs += 1

    def due(self, steps: int) -> bool:
        """Is a sync due after ``steps`` steps (never with "epoch": those come from ``end_epoch``)?"""
        return self.every != "epoch" and steps % self.every == 0

    def after_step(self, step: int) -> None:
        self.steps += 1
        due = self.due(self.steps)
        if due:
            self.sync()
        self.monitor.after_step(after_sync=due)

    def due_at_epoch_end(self) -> bool:
        """Is a sync due at this epoch's end? ("epoch" only; local SGD's warm-up also says no.)"""
        return self.every == "epoch"

    def end_epoch(self, epoch: int) -> None:
        at_epoch_end = self.due_at_epoch_end()
        if at_epoch_end:
            self.sync()
        self.monitor.end_epoch(epoch, after_sync=at_epoch_end)

    def state_dict(self) -> dict:
        # the schedule counts steps since the start of training, not since this process started
        return {"steps": self.steps, "synced_at": self.synced_at, "syncs": self.syncs}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.steps, self.synced_at, self.syncs = state["steps"], state["synced_at"], state["syncs"]

    def update_stats(self) -> None:
        self.ledger.fill(self.stats)
        self.stats.extra[self.SYNCS_NAME] = self.syncs
        self.stats.extra["sync_every"] = self.every
