"""``local-sgd``: every rank steps on its own gradients; parameters are averaged every K steps.

No per-step gradient synchronisation: between averagings the replicas drift apart, and every
``--sync-every K`` steps (or at every epoch end with ``--sync-every epoch``) their parameters and
floating-point buffers are replaced by the mean over all ranks with ddtrain's ``ring``
(traffic under "ring"). The run ends with an averaging if steps were taken since the last one,
so the model every rank returns (and rank 0 saves) is the average. Rank 0's initial state is
broadcast once (not counted), as DDP does.
"""
from __future__ import annotations

from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import SyncOptions
from ddtrain.sync.periodic import PeriodicStrategy
from ddtrain.sync.state import average_, broadcast_, state_tensors

ALGORITHM = "ring"


class LocalSGDStrategy(PeriodicStrategy):
    """Plain local steps; parameters and buffers averaged when a sync is due, and once more at the end.

    With K=1 and plain SGD, averaging ``p - lr·g_r`` over the ranks is ``p - lr·mean(g_r)``, the
    one-process step with the global batch. Heavy-ball momentum keeps that (its buffers stay per
    rank but are linear in the gradients; weight decay acts on equal parameters); Adam's
    per-element normalisation does not. With K > 1 no optimizer is equivalent.
    """

    SYNCS_NAME = "averagings"

    def __init__(self, model, optimizer, options: SyncOptions):
        broadcast_(state_tensors(model), counted=False)
        super().__init__(model, optimizer, options, ledger=Ledger((ALGORITHM,)))

    def sync_(self) -> None:
        average_(state_tensors(self.module), algorithm=ALGORITHM)

    def close(self) -> None:
        if self.steps > self.synced_at:
            self.sync()
