"""The asynchronous parameter server of ``ps-async``: apply each gradient as it arrives, staleness bounded.

A worker computes a gradient on the parameters of version ``p`` (the server's update count
when it pulled them); when the server applies it at version ``v`` its **staleness** is
``v - p``, the number of other updates that happened meanwhile (002 §2.5's stale gradients).
With W workers and no bound it is typically up to W-1. ``--staleness K`` bounds it, and the
server keeps the bound with two rules (stale-synchronous parallel, in versions):

* **Answer gate.** A worker gets fresh parameters (and may start its next gradient) only
  while at most K other gradients are outstanding (being computed or received, not applied).
  The newcomer's gradient is then at most K updates behind if the outstanding ones are
  applied oldest first.
* **Apply order.** A received gradient is applied only if every other outstanding gradient,
  applied oldest first afterwards, would still be within K; otherwise it waits for the older
  ones. The oldest outstanding gradient is always applicable, so nothing deadlocks.

So a worker too far ahead waits (for its answer), and the realised staleness of every update
is recorded in the server's stats (``staleness_histogram``, ``staleness_max``): it never
exceeds K. K >= W-1 never makes anyone wait.

"Whichever worker arrives first": one receive stays posted per worker and the server polls
``is_completed()`` (Gloo and NCCL), sleeping a little longer each idle round (50 us up to
2 ms) so that it does not steal the workers' cores. A worker that has parameters but sends
nothing within the timeout is reported by name (see ``param_server.ServerCore.fail``).
"""
from __future__ import annotations

import time
from collections import Counter

from ..comm.p2p import CommError, wait
from ..errors import DDTrainError
from ..faults import maybe_inject
from .param_server import FINAL, GRAD, HELLO, HELLO_SUFFIX, PARAMS, STOP, STOP_SUFFIX, ServerCore, reattribute

MIN_SLEEP_S, MAX_SLEEP_S = 50e-6, 2e-3


def feasible(outstanding: dict, worker: int, version: int, bound: int) -> bool:
    """May ``worker``'s gradient (computed on ``outstanding[worker]``) be applied now at ``version``?"""
    if version - outstanding[worker] > bound:
        return False
    rest = sorted(p for w, p in outstanding.items() if w != worker)
    return all(version + 1 + i - p <= bound for i, p in enumerate(rest))


def serve_async(core: ServerCore, bound: int) -> None:
    """Serve until every worker has sent STOP; then send all of them the final parameters."""
    plan = core.plan
    active = set(plan.workers)
    posted = {}                   # worker -> pending receive
    expected_since = {}           # worker -> when we started waiting for its next message
    outstanding: dict[int, int] = {}   # worker -> version its gradient is (being) computed on
    received: dict[int, int] = {}      # worker -> version, gradient here but not applied yet
    answer: list[int] = []        # workers waiting for parameters, first come first served
    stopped: list[int] = []
    staleness = Counter()
    start = time.monotonic()

    def post(w):
        posted[w] = core.post_receive(plan.comm(), w, f"message {core.version}")

    for w in sorted(active):
        post(w)
        expected_since[w] = start
    sleep = MIN_SLEEP_S
    while active:
        progressed = False
        with core.ledger.timed():
            for w in sorted(posted):
                pending = posted[w]
                if not all(work.is_completed() for work in pending.works):
                    if w in expected_since and time.monotonic() - expected_since[w] > plan.timeout_s:
                        core.fail(w, f"no message for {plan.timeout_s:g}s", answer + list(received) + stopped)
                    continue
                try:
                    wait(plan.comm(), pending)
                except CommError as exc:
                    core.fail(w, str(exc), answer + list(received) + stopped)
                del posted[w]
                expected_since.pop(w, None)
                kind, version = core.inbox[w].read_header()
                progressed = True
                if kind in (HELLO, STOP):
                    reattribute(plan.name, HELLO_SUFFIX if kind == HELLO else STOP_SUFFIX,
                                core.inbox[w].buffer.numel(), 1)
                if kind == HELLO:
                    answer.append(w)
                    post(w)
                elif kind == GRAD:
                    if w not in outstanding or outstanding[w] != version:
                        raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: worker rank {w} "
                                           f"sent a gradient of version {version} it was never given")
                    received[w] = version
                elif kind == STOP:
                    active.discard(w)
                    outstanding.pop(w, None)
                    stopped.append(w)
                else:
                    raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: unexpected message "
                                       f"kind {kind} from worker rank {w}")
        for w in sorted(received, key=lambda w: (received[w], w)):     # oldest first
            if not feasible(outstanding, w, core.version, bound):
                continue
            staleness[core.version - received[w]] += 1
            maybe_inject(core.version, core.rank)
            core.apply_(core.inbox[w].payload)
            del received[w], outstanding[w]
            answer.append(w)
            post(w)
            progressed = True
        with core.ledger.timed():
            while answer and len(outstanding) <= bound:
                w = answer.pop(0)
                core.send(plan.comm(), [w], PARAMS, f"parameters {core.version}")
                outstanding[w] = core.version
                expected_since[w] = time.monotonic()
                progressed = True
        if progressed:
            sleep = MIN_SLEEP_S
        else:
            with core.ledger.timed():
                time.sleep(sleep)
            sleep = min(sleep * 2, MAX_SLEEP_S)
    extra = core.stats.extra
    extra["updates"] = core.version
    extra["staleness_bound"] = bound
    extra["staleness_histogram"] = {str(k): v for k, v in sorted(staleness.items())}
    extra["staleness_max"] = max(staleness, default=0)
    with core.ledger.timed():
        core.send(plan.comm(suffix=STOP_SUFFIX), stopped, FINAL, "final parameters")


def hello_before_first_forward(module, link) -> None:
    """Make the worker's first forward pass wait for parameters from the servers (the staleness gate)."""
    def pre_hook(_module, _args):
        handle.remove()
        link.exchange(HELLO, "hello")

    handle = module.register_forward_pre_hook(pre_hook)
