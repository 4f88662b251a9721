"""The asynchronous parameter server of ``ps-async``: apply each gradient as it arrives, staleness bounded.

A gradient computed on parameters of version ``p`` and applied at version ``v`` has staleness
``v - p`` (002 §2.5's stale gradients; up to W-1 with W workers and no bound). ``--staleness K``
bounds it by two rules (stale-synchronous parallel, in versions; ``feasible``): a worker gets
fresh parameters only while at most K other gradients are outstanding, and a received gradient
is applied only if the outstanding ones, applied oldest first afterwards, stay within K (the
oldest is always applicable, so nothing deadlocks). The realised staleness of every update is
recorded (``staleness_histogram``, ``staleness_max``) and never exceeds K.

By default (``SyncOptions.async_rule = "dana"``, DANA-Zero) each update's step size is divided
by the number of workers, each worker's gradients go into a momentum buffer of its own, and a
worker is sent look-ahead parameters (``ServerCore.lookahead``) instead of the current ones;
``"staleness"`` divides the step by ``1 + staleness`` and lowers the momentum instead
(``server.staleness_rule``; docs/ALGORITHMS.md has the reasons and the measurement);
``async_rule = "plain"`` applies every gradient with the workers' hyper-parameters as they are.
"""
from __future__ import annotations

import datetime
import time
from collections import Counter

import torch
import torch.distributed as dist

from ddtrain.comm import traffic
from ddtrain.comm.p2p import CommError, wait
from ddtrain.errors import DDTrainError
from ddtrain.reliability.faults import maybe_inject
from ddtrain.sync.ps.server import ServerCore, dana_applies, delay_compensate_
from ddtrain.sync.ps.protocol import (ADD, ASIDE, CONTROL_SUFFIX, FINAL, GRAD, HELLO, PARAMS, PAUSE, STOP, STOP_SUFFIX,
                                     reattribute)

MIN_SLEEP_S, MAX_SLEEP_S = 50e-6, 2e-3     # NCCL polling: idle sleeps from 50 us, doubling up to 2 ms


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def feasible(outstanding: dict, worker: int, version: int, bound: int) -> bool:
    """May ``worker``'s gradient (computed on ``outstanding[worker]``) be applied now at ``version``?"""
    if version - outstanding[worker] > bound:
        return False
    rest = sorted(p for w, p in outstanding.items() if w != worker)
    return all(version + 1 + i - p <= bound for i, p in enumerate(rest))


class Arrivals:
    """The next message from any worker ("whichever arrives first"), into ``core.inbox[worker]``.

    On Gloo one receive *from any source* (``dist.irecv`` without ``src``; Gloo's
    ``recv_anysource``) into a free buffer, waited for with a deadline; the work names the
    sender. NCCL has no receive from any source, so there one receive stays posted per worker
    and ``is_completed()`` is polled (Gloo's point-to-point works do not update it before
    ``wait``), sleeping longer each idle round so as not to steal cores. NCCL runs a group's
    transfers in order on one stream, so on NCCL each worker-server pair has a group of its own
    (``Plan.route``): a receive for one worker would otherwise hold the answers to all the
    others (a hang on 4 H200s, fixed).
    """

    def __init__(self, core: ServerCore):
        self.core, self.plan = core, core.plan
        self.anysource = (self.plan.pairs is None and self.plan.device.type == "cpu"
                          and "gloo" in str(dist.get_backend()).lower())
        self.free = [self.plan.message(core.index, to_server=True) for _ in range(2)] if self.anysource else []
        self.posted = {}          # anysource: {None: (work, message)}; polling: {worker: pending}

    def expect(self, worker: int) -> None:
        """``worker`` may send now (its previous message, if any, has been consumed)."""
        if self.anysource:
            self.free.append(self.core.inbox.pop(worker, None) or self.plan.message(self.core.index, to_server=True))
        else:
            self.posted[worker] = self.core.post_receive(self.plan.comm(), worker, f"message {self.core.version}")

    def release(self, worker: int) -> None:
        """``worker`` will send nothing more (STOP): its landing buffer can be reused."""
        if self.anysource:
            self.free.append(self.core.inbox.pop(worker))

    def next(self, timeout_s: float) -> int | None:
        """The worker whose message landed, or None when ``timeout_s`` passed with none."""
        return self._next_anysource(timeout_s) if self.anysource else self._next_polled(timeout_s)

    def _next_anysource(self, timeout_s: float) -> int | None:
        if None not in self.posted:
            message = self.free.pop() if self.free else self.plan.message(self.core.index, to_server=True)
            self.posted[None] = (dist.irecv(message.buffer, group=self.plan.group), message)
        work, message = self.posted[None]
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(timeout_s, 1e-3)))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                return None
            raise CommError(f"{self.plan.name}: receive from any worker failed: {exc}") from exc
        del self.posted[None]
        worker = work._source_rank()     # a group rank: every model's group holds all ranks in order
        self.core.inbox[worker] = message
        traffic.record(self.plan.name, bytes_received=message.buffer.numel(), messages_received=1)
        return worker

    def _next_polled(self, timeout_s: float) -> int | None:
        deadline, sleep = time.monotonic() + timeout_s, MIN_SLEEP_S
        while True:
            for worker in sorted(self.posted):
                if all(work.is_completed() for work in self.posted[worker].works):
                    pending = self.posted.pop(worker)
                    wait(pending.comm, pending)
                    return worker
            if time.monotonic() > deadline:
                return None
            time.sleep(sleep)
            sleep = min(sleep * 2, MAX_SLEEP_S)


def held_for(worker: int, received: dict, outstanding: dict, bound: int) -> str:
    """The gradients waiting for ``worker``'s (the staleness bound), as a failure names them; '' if none."""
    held = sorted(w for w in received if w != worker)
    if not held or worker not in outstanding:
        return ""
    return (f"the gradient(s) of worker rank(s) {', '.join(map(str, held))} wait for its own (staleness bound {bound}): "
            "a worker that waits for the others outside ddtrain's collectives deadlocks with them")


def serve_async(core: ServerCore, bound: int, rule: str = "staleness", on_add=None, arrivals=None) -> None:
    """Serve until every worker has sent STOP; then send all of them the final parameters.

    ``rule``: "staleness" (the default correction, see the module docstring) or "plain".
    ``on_add``: called once every active worker has sent ADD. ``arrivals``: where messages come
    from (tests pass a scripted one; default ``Arrivals(core)``).
    """
    plan = core.plan
    if rule == "dana" and not dana_applies(core.optimizer):
        rule = "staleness"     # DANA's look-ahead is defined for heavy-ball SGD only (docs/ALGORITHMS.md)
    core.stats.extra["async_rule"] = rule
    active = set(plan.workers)
    arrivals = arrivals or Arrivals(core)
    adding: list[int] = []             # workers that have sent ADD, waiting for the others
    expected_since = {}                # worker -> when we started waiting for its next message
    outstanding: dict[int, int] = {}   # worker -> version its gradient is (being) computed on
    received: dict[int, int] = {}      # worker -> version, gradient here but not applied yet
    answer: list[tuple[int, str]] = [] # (worker, traffic suffix) waiting for parameters, first come first served
    stopped: list[int] = []
    staleness = Counter()
    snapshots: dict[int, torch.Tensor] = {}   # version -> this shard's flat parameters (rules dc-*: DC-ASGD)
    mean_square = None
    start = time.monotonic()
    if not arrivals.anysource:
        for w in sorted(active):
            arrivals.expect(w)
    expected_since = dict.fromkeys(active, start)
    while active:
        if not expected_since:   # cannot happen: the oldest outstanding gradient is always applicable
            raise DDTrainError(f"{plan.name}: parameter server rank {core.rank} has nothing to wait for "
                               f"(outstanding {outstanding}, received {received}, waiting {answer})")
        with core.ledger.timed():
            oldest = min(expected_since.items(), key=lambda item: (item[1], item[0]))
            try:
                w = arrivals.next(oldest[1] + plan.timeout_s - time.monotonic())
            except CommError as exc:
                core.fail(oldest[0], str(exc))
        if w is None:
            core.fail(oldest[0], f"no message for {plan.timeout_s:g}s", held_for(oldest[0], received, outstanding, bound))
        expected_since.pop(w, None)
        core.heard(w)
        kind, version = core.inbox[w].read_header()
        if kind != GRAD:
            reattribute(plan.name, STOP_SUFFIX if kind == STOP else CONTROL_SUFFIX, core.inbox[w].buffer.numel(), 1)
        if kind in ASIDE:
            # answered at once and not gated: the worker waits for this answer only
            with core.ledger.timed():
                core.aside(plan.comm(suffix=CONTROL_SUFFIX), w, kind)
            arrivals.expect(w)
            expected_since[w] = time.monotonic()
        elif kind == ADD:
            # another model is prepared: like PAUSE, the worker computes nothing until every
            # worker has said ADD and all ranks have set the model up together
            outstanding.pop(w, None)
            adding.append(w)
            if len(adding) == len(active):
                with core.ledger.timed():
                    core.send(plan.comm(suffix=CONTROL_SUFFIX), adding, PARAMS, "parameters (add)")
                on_add()
                for a in adding:
                    arrivals.expect(a)
                    expected_since[a] = time.monotonic()
                adding = []
        elif kind == HELLO:
            answer.append((w, CONTROL_SUFFIX))
        elif kind == PAUSE:
            # The worker is about to wait for the other workers (epoch-end metrics, validation,
            # a divergence check): answer at once, outside the gate, and take it out of the
            # outstanding set until its next HELLO. Gated, it and the others waiting for it at
            # a collective would wait for each other forever.
            outstanding.pop(w, None)
            with core.ledger.timed():
                core.send(plan.comm(suffix=CONTROL_SUFFIX), [w], PARAMS, "parameters (pause)")
            arrivals.expect(w)
            expected_since[w] = time.monotonic()     # it will say HELLO or STOP
        elif kind == GRAD:
            if outstanding.get(w) != version:
                raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: worker rank {w} "
                                   f"sent a gradient of version {version} it was never given")
            received[w] = version
        elif kind == STOP:
            active.discard(w)
            outstanding.pop(w, None)
            stopped.append(w)
            arrivals.release(w)
        else:
            raise DDTrainError(f"{plan.name}: parameter server rank {core.rank}: unexpected message "
                               f"kind {kind} from worker rank {w}")
        for w in sorted(received, key=lambda w: (received[w], w)):     # oldest first
            if not feasible(outstanding, w, core.version, bound):
                continue
            lag = core.version - received[w]
            staleness[lag] += 1
            maybe_inject(core.version, core.rank)
            mean = sum(k * n for k, n in staleness.items()) / sum(staleness.values())
            grads = core.inbox[w].payload.to(plan.dtype)   # widened back from fp16/bf16 (else the payload itself)
            if rule.startswith("dc-"):
                now = flat(core.params)
                if mean_square is None:
                    mean_square = torch.zeros_like(now)
                delay_compensate_(grads, now, snapshots[received[w]], mean_square)
            core.apply_(grads, core.inbox[w], staleness=None if rule == "plain" else lag,
                        mean_staleness=mean, rule=rule, worker=w)
            del received[w], outstanding[w]
            for v in set(snapshots) - set(outstanding.values()):
                del snapshots[v]
            answer.append((w, ""))
        with core.ledger.timed():
            while answer and len(outstanding) <= bound:
                w, suffix = answer.pop(0)
                core.send(plan.comm(suffix=suffix), [w], PARAMS, f"parameters {core.version}",
                          params=core.lookahead() if rule == "dana" else None)
                # Only now: on NCCL a receive posted before this send would sit ahead of it on the
                # stream, waiting for a message the worker sends only after these parameters.
                arrivals.expect(w)
                outstanding[w] = core.version
                if rule.startswith("dc-") and core.version not in snapshots:
                    snapshots[core.version] = flat(core.params)
                expected_since[w] = time.monotonic()
    extra = core.stats.extra
    extra["updates"] = core.version
    extra["staleness_bound"] = bound
    extra["staleness_histogram"] = {str(k): v for k, v in sorted(staleness.items())}
    extra["staleness_max"] = max(staleness, default=0)
    with core.ledger.timed():
        core.send(plan.comm(suffix=STOP_SUFFIX), stopped, FINAL, "final parameters")
