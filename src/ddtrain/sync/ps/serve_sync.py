"""The synchronous parameter server of ``ps-sync``: each round one gradient from every worker, their mean applied once.

The mean is summed in worker order, whatever the arrival order, so ps-sync takes the steps of
one process with the global batch. When every worker has sent STOP the server answers with the
final parameters.
"""
from __future__ import annotations

from ddtrain.comm.p2p import CommError, wait
from ddtrain.errors import DDTrainError
from ddtrain.reliability.faults import maybe_inject
from ddtrain.sync.ps.protocol import FINAL, GRAD, KIND_NAMES, PARAMS, STOP, STOP_SUFFIX, reattribute
from ddtrain.sync.ps.server import ServerCore


def serve_sync(core: ServerCore) -> None:
    """Each round: a gradient from every worker, their mean applied once, fresh parameters to all."""
    plan, active = core.plan, list(core.plan.workers)
    while True:
        maybe_inject(core.version, core.rank)
        with core.ledger.timed():
            comm = plan.comm()
            pending = {w: core.post_receive(comm, w, f"step {core.version}") for w in active}
            kinds = {}
            for w in active:
                try:
                    wait(pending[w].comm, pending[w])
                except CommError as exc:
                    core.fail(w, str(exc))
                kinds[w] = core.inbox[w].read_header()[0]
        if all(k == STOP for k in kinds.values()):
            reattribute(plan.name, STOP_SUFFIX, len(active) * core.inbox[active[0]].buffer.numel(), len(active))
            with core.ledger.timed():
                core.send(plan.comm(suffix=STOP_SUFFIX), active, FINAL, "final parameters")
            return
        if any(k != GRAD for k in kinds.values()):
            odd = {w: KIND_NAMES.get(k, k) for w, k in kinds.items() if k != GRAD}
            raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: at update {core.version} "
                               f"workers sent {odd} instead of gradients (do all workers run the same steps?)")
        total = core.inbox[active[0]].payload.clone()
        for w in active[1:]:              # worker order, whatever the arrival order
            total.add_(core.inbox[w].payload)
        core.apply_(total.div_(len(active)))
        core.stats.extra["updates"] = core.version
        with core.ledger.timed():
            core.send(plan.comm(), active, PARAMS, f"parameters {core.version}")
