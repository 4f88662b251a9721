"""What a strategy moved and how long it waited: per-rank bookkeeping shared by every strategy.

A strategy names the ``ddtrain.comm.traffic`` operations that carry its synchronisation
("ring", "bcast", "ps-sync", ...). The ledger snapshots the counters when the strategy is
applied and, on ``fill``, writes the difference for exactly those operations into the
strategy's ``SyncStats``: traffic of anything else in the process (a benchmark, the loop's
metric reduction, the divergence checks) never leaks into a strategy's numbers. ``timed()``
adds the seconds spent inside a communication call to ``comm_wait_s``.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import fields

from ddtrain.comm import traffic
from ddtrain.sync.base import SyncStats


class Ledger:
    """Counters of ``operations`` since construction, and seconds spent communicating."""

    def __init__(self, operations: tuple[str, ...]):
        self.operations = tuple(operations)
        self.start = traffic.snapshot()
        self.wait_s = 0.0

    @contextlib.contextmanager
    def timed(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    def fill(self, stats: SyncStats) -> None:
        """Write this rank's counted traffic and waiting into ``stats`` (method "counted")."""
        delta = traffic.difference(traffic.snapshot(), self.start)
        picked = {name: counts for name, counts in delta.by_operation.items() if name in self.operations}
        total = traffic.Counts()
        for counts in picked.values():
            total.add(counts)
        stats.bytes_sent, stats.bytes_received = total.bytes_sent, total.bytes_received
        stats.messages_sent, stats.messages_received = total.messages_sent, total.messages_received
        stats.comm_wait_s = self.wait_s
        stats.method = "counted" if total.method == traffic.COUNTED else total.method
        stats.extra["by_operation"] = {name: {f.name: getattr(c, f.name) for f in fields(traffic.Counts)}
                                       for name, c in sorted(picked.items())}
