"""``hybrid``: document 000's method -- ring all-reduce every step, rank 0's state broadcast every K steps.

"Decentralized training with a centralized parameter update" (000 ch. 5): gradients are
averaged every step by DDP with ddtrain's ``ring`` as the hook (traffic under "ring"), and every
``--sync-every K`` steps -- or once per epoch with ``--sync-every epoch``, the document's
setting -- rank 0's parameters (and its floating-point buffers, where DDP's broadcast_buffers
is off) are broadcast with the binomial-tree
``bcast`` (traffic under "bcast"). Its cost is 000 Table 5.1's "proposed" column,
``2·E·(N/R)·(R−1) + N·(R−1)`` values per epoch with one broadcast per epoch.
"""
from __future__ import annotations

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.allreduce import hooked_ddp
from ddtrain.sync.base import SyncOptions
from ddtrain.sync.periodic import PeriodicStrategy
from ddtrain.sync.state import broadcast_, state_tensors

ALGORITHM = "ring"


class HybridStrategy(PeriodicStrategy):
    """Ring-averaged gradients every step; rank 0's parameters and buffers broadcast when a sync is due."""

    SYNCS_NAME = "broadcasts"

    def __init__(self, model, optimizer, options: SyncOptions):
        ledger = Ledger((ALGORITHM, "bcast"))
        ddp, self.hook = hooked_ddp(model, options, ALGORITHM, ledger)
        self.ddp_broadcasts_buffers = options.broadcast_buffers
        super().__init__(ddp, optimizer, options, ledger=ledger, module=model)

    def sync_(self) -> None:
        # Our ring is bitwise deterministic (each element reduced on exactly one rank), so the
        # replicas are already identical and the divergence record shows it; the broadcast is
        # the document's insurance against reductions that are not, and per-rank state. Buffers
        # go only where DDP does not already send rank 0's before every forward (broadcast_buffers
        # off): sent after the step as well, they would replace what DDP leaves on the other ranks
        # between steps (rank 0's plus their own batch's update), which timm's distribute_bn reads.
        broadcast_(state_tensors(self.module, buffers=not self.ddp_broadcasts_buffers), counted=True)

    def replicas_identical(self, step: int) -> bool:
        return self.due(step)     # identical right after each broadcast of rank 0's state

    def close(self) -> None:
        self.hook.close()
