"""The synchronous parameter server of ``ps-sync``: each round one gradient from every worker, their mean applied once.

The mean is summed in worker order, whatever the arrival order, so ps-sync takes the steps of
one process with the global batch: the hyper-parameters are those the workers sent with the
round's gradients (worker order's first), and a parameter gets a gradient when some worker's
has one (the others' count as zeros, as in one process where part of the batch does not use
it). SET, STATE and LOAD are answered as they come, outside the rounds; when every worker has
sent ADD (another model is prepared) ``on_add`` sets it up; when every worker has sent STOP the
server answers with the final parameters.
"""
from __future__ import annotations

import time

from ddtrain.comm.p2p import CommError
from ddtrain.errors import DDTrainError
from ddtrain.reliability.faults import maybe_inject
from ddtrain.sync.ps.protocol import (ADD, ASIDE, CONTROL_SUFFIX, FINAL, GRAD, KIND_NAMES, PARAMS, STOP, STOP_SUFFIX,
                                     reattribute)
from ddtrain.sync.ps.serve_async import Arrivals
from ddtrain.sync.ps.server import ServerCore


def serve_sync(core: ServerCore, on_add=None) -> None:
    """Each round: a gradient from every worker, their mean applied once, fresh parameters to all.

    Messages are taken in arrival order (``Arrivals``: whichever worker speaks first), so that a
    worker's SET/STATE/LOAD is answered while another worker still computes, or waits for it in
    a collective among workers, instead of after that worker's next gradient.
    """
    plan, active = core.plan, list(core.plan.workers)
    arrivals = Arrivals(core)
    if not arrivals.anysource:
        for w in active:
            arrivals.expect(w)
    while True:
        maybe_inject(core.version, core.rank)
        kinds: dict[int, int] = {}
        deadline = time.monotonic() + plan.timeout_s
        while len(kinds) < len(active):
            missing = min(w for w in active if w not in kinds)
            with core.ledger.timed():
                try:
                    w = arrivals.next(deadline - time.monotonic())
                except CommError as exc:
                    core.fail(missing, str(exc))
            if w is None:
                sent = sorted(w for w in kinds if kinds[w] == GRAD)
                core.fail(missing, f"no message for update {core.version} in {plan.timeout_s:g}s",
                          f"worker rank(s) {', '.join(map(str, sent))} sent their gradient for it" if sent else "")
            kind = core.heard(w)
            if kind in ASIDE:
                reattribute(plan.name, CONTROL_SUFFIX, core.inbox[w].buffer.numel(), 1)
                with core.ledger.timed():
                    core.aside(plan.comm(suffix=CONTROL_SUFFIX), w, kind)
                arrivals.expect(w)
                continue
            if w in kinds:
                raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: worker rank {w} sent "
                                   f"{KIND_NAMES.get(kind, kind)} before its answer to update {core.version}")
            kinds[w] = kind
        if all(k == ADD for k in kinds.values()):
            reattribute(plan.name, CONTROL_SUFFIX, len(active) * core.inbox[active[0]].buffer.numel(), len(active))
            with core.ledger.timed():
                core.send(plan.comm(suffix=CONTROL_SUFFIX), active, PARAMS, "parameters (add)")
            on_add()
            for w in active:
                arrivals.expect(w)
            continue
        if all(k == STOP for k in kinds.values()):
            reattribute(plan.name, STOP_SUFFIX, len(active) * core.inbox[active[0]].buffer.numel(), len(active))
            with core.ledger.timed():
                core.send(plan.comm(suffix=STOP_SUFFIX), active, FINAL, "final parameters")
            return
        if any(k != GRAD for k in kinds.values()):
            odd = {w: KIND_NAMES.get(k, k) for w, k in kinds.items() if k != GRAD}
            raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: at update {core.version} "
                               f"workers sent {odd} instead of gradients (do all workers run the same steps?)")
        total = core.inbox[active[0]].payload.to(plan.dtype, copy=True)   # widened back from fp16/bf16
        has_grad = core.has_grad(core.inbox[active[0]])
        for w in active[1:]:              # worker order, whatever the arrival order
            total.add_(core.inbox[w].payload)
            has_grad = [a or b for a, b in zip(has_grad, core.has_grad(core.inbox[w]))]
        core.apply_(total.div_(len(active)), core.inbox[active[0]], has_grad=has_grad)
        core.stats.extra["updates"] = core.version
        with core.ledger.timed():
            core.send(plan.comm(), active, PARAMS, f"parameters {core.version}")
        for w in active:                  # after the send: on NCCL a receive posted before it would sit ahead of it
            arrivals.expect(w)
