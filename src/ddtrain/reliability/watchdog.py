"""Named hangs where the backend would abort first: a deadline on this rank's own progress.

On Gloo a timed-out collective raises in the training thread, and ``stall.watched`` turns the
exception into a line naming the step, the operation and the missing rank. NCCL does not raise:
its collectives are enqueued and the host runs on until something synchronises, and at the
process group's timeout NCCL's watchdog thread aborts the process with PyTorch's generic
"Watchdog caught collective operation timeout" (issue 20). So on NCCL this thread watches the
rank's own progress marks (``stall.mark``, set by the loop every step): when they have not moved
for the deadline, it reads the other ranks' marks from the store, prints the same one line as on
Gloo and ends the process, before NCCL's watchdog, whose timeout ``ddtrain.init`` sets
``dist.runtime.WATCHDOG_SLACK_S`` later. ``DDTRAIN_WATCHDOG=1`` turns it on for Gloo too (the CPU tests of this
path); ``=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.distributed.launch import PEER_STOPPED_EXIT
from ddtrain.distributed.runtime import watchdog_wanted as wanted
from ddtrain.reliability import stall
from ddtrain.distributed.job import restart_attempt


class ProgressWatchdog:
    """Ends the process with a named stall when this rank's mark stays put for ``deadline_s``."""

    def __init__(self, *, what: str, deadline_s: float, rank: int, ranks: list[int], period_s: float = 1.0,
                 exit_code: int = 1):
        self.what, self.deadline_s, self.rank, self.ranks = what, deadline_s, rank, ranks
        self.period_s, self.exit_code = min(period_s, deadline_s / 4), exit_code
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddtrain-watchdog", daemon=True)

    def __enter__(self) -> ProgressWatchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1)

    def _run(self) -> None:
        seen, since = stall.where(), time.monotonic()
        while not self._stop.wait(self.period_s):
            now = stall.where()
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since >= self.deadline_s:
                self._fire(*now)
                return

    def _fire(self, step, op) -> None:
        notes = stall.missing_peers(self.rank, self.ranks, stale_s=max(5.0, 5 * self.period_s))
        if len(notes) > (len(self.ranks) - 1) / 2:
            # Most ranks are elsewhere: this one is likely the odd one out (the rank that skipped),
            # and its report would blame the many. Let a rank of the majority speak first.
            time.sleep(3 * self.period_s)
        waiting = ("; waiting for " + ", ".join(notes)) if notes else \
            "; every rank reports the same step and operation, so one of them is stuck inside it"
        message = (f"stalled at step {step} in {op} ({self.what}): no progress within the "
                   f"{self.deadline_s:g} s deadline{waiting}")
        code = PEER_STOPPED_EXIT  # the launcher names the rank that reported, not one that stopped for it
        if _first_to_report():  # one line for the job, not one per waiting rank
            sys.stderr.write(f"[rank {self.rank}] ddtrain: error: {message}\n")
            sys.stderr.flush()
            code = self.exit_code
        # A thread cannot interrupt a training thread blocked in a CUDA synchronisation or a NCCL
        # wait: ending the process is the only exit that beats NCCL's abort.
        os._exit(code)


def _first_to_report() -> bool:
    store = stall._store()
    if store is None:
        return True
    try:
        return store.add(f"ddtrain/watchdog/{restart_attempt()}", 1) == 1
    except Exception:  # the store is gone with rank 0: say it anyway
        return True


def guard(what: str, deadline_s: float):
    """The watchdog for this rank when the backend wants one (NCCL, or DDTRAIN_WATCHDOG=1), else a no-op."""
    if not (dist.is_initialized() and dist.get_world_size() > 1 and wanted(runtime.backend())):
        return contextlib.nullcontext()
    return ProgressWatchdog(what=what, deadline_s=deadline_s, rank=dist.get_rank(),
                            ranks=list(range(dist.get_world_size())))
