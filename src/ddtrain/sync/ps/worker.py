"""A parameter-server worker's side: ``WorkerLink`` pushes gradients and pulls parameters, ``WorkerOptimizer`` steps with it.

Every gradient travels with the hyper-parameters the worker's optimizer has at that step (a
scheduler or a hand edit on the worker is what the servers apply) and with which parameters
have a gradient. Parameters changed on the worker outside training (a checkpoint loaded after
``prepare``) are noticed by their version counters and sent to the servers before the next
exchange; the optimizer state lives on the servers and ``optimizer.state_dict()`` /
``load_state_dict()`` fetch and install it there (``state`` / ``load_state``).

Every wait has the deadline of the plan's timeout plus ``WORKER_MARGIN_S``; a failed wait reads
the server's ``FailureNote`` and names the worker the server lost, or, without a note, the server.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ddtrain.comm.p2p import CommError, exchange, wait
from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.ps.protocol import (FINAL, GRAD, HELLO, KIND_NAMES, LOAD, PARAMS, PAUSE, SET, STATE, SUFFIX, FailureNote,
                                     Plan, flat_bytes, read_hyper)
from ddtrain.sync.ps.server import chunks, from_bytes, to_bytes

# Workers wait this much longer than servers, so that a server, which started waiting for a
# dead worker earlier than any live worker started waiting for the server, always times out first.
WORKER_MARGIN_S = 2.0
NOTE_WAIT_S = 1.0            # after losing its server's connection, how long a worker looks for a note


class WorkerLink:
    """A worker's side: push gradients, pull parameters, one message each way per server."""

    def __init__(self, plan: Plan, ledger: Ledger, note: FailureNote, optimizer=None):
        self.plan, self.ledger, self.note = plan, ledger, note
        self.optimizer = optimizer   # whose param_groups' current values travel with every gradient
        self.push = [plan.message(s, to_server=True) for s in range(len(plan.servers))]   # 16-bit with fp16/bf16
        self.pull = [plan.message(s) for s in range(len(plan.servers))]
        self.versions = [0] * len(plan.servers)
        self.steps = 0
        self.paused = False          # ps-async: must say HELLO before computing again
        self.seen = self._param_versions()
        self.marks = self._grad_marks()

    def _param_versions(self) -> list[list[int]]:
        """Each parameter's in-place version counter: bumped by load_state_dict or a hand edit, not by us after install."""
        return [[p._version for p in shard] for shard in self.plan.shards]

    def _grad_marks(self) -> list:
        """Each parameter's gradient as it is now: (a weak reference to the tensor, its version), or None."""
        return [None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
                for shard in self.plan.shards for p in shard]

    def holds_gradient(self) -> bool:
        """Did a backward pass since the last exchange leave a gradient that the next step will send?

        A gradient tensor that is new or changed in place since then (``set_to_none`` zeroing
        leaves None, which holds nothing). Zeroing in place counts as a change.
        """
        return any(p.grad is not None and (mark is None or mark[0]() is not p.grad or mark[1] != p.grad._version)
                   for p, mark in zip((p for shard in self.plan.shards for p in shard), self.marks))

    def exchange(self, kind: int, what: str, aux: int = 0, on_state=None) -> None:
        """Send ``kind`` to every server, wait for each answer, and install the parameters it brings."""
        plan = self.plan
        if kind in (GRAD, HELLO):
            self.push_changed_parameters()
        with self.ledger.timed():
            comm = plan.comm(plan.timeout_s + WORKER_MARGIN_S, suffix=SUFFIX[kind])
            pending = []
            hyper = read_hyper(self.optimizer.param_groups, plan.hyper) if self.optimizer is not None else []
            for s, server in enumerate(plan.servers):
                if kind == GRAD:
                    self.push[s].pack_(plan.shards[s], grads=True)
                    self.push[s].set_values(hyper + [float(p.grad is not None) for p in plan.shards[s]])
                elif kind == SET:
                    self.push[s].pack_(plan.shards[s])
                self.push[s].set_header(kind, self.versions[s], aux)
                link, peer = plan.route(comm, dist.get_rank(), server)
                pending.append((link, exchange(link, sends=[(peer, self.push[s].buffer)],
                                               recvs=[(peer, self.pull[s].buffer)], label=f"{what} {self.steps}")))
            for s, server in enumerate(plan.servers):
                self._wait(pending[s], server, what)
                answer, version = self.pull[s].read_header()
                if answer == STATE and kind == STATE:
                    # this server's bytes follow: take them now, before waiting for the next server's
                    # header. Servers send their chunks one worker at a time and block until that worker
                    # receives; a worker that first waited for every header could wait on server B while
                    # server A waits on it, with another worker the other way round (a deadlock seen
                    # about 1 run in 4 with 2 workers and 2 servers at finish).
                    on_state(s, server)
                    continue
                if answer not in (PARAMS, FINAL):
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} answered "
                                       f"{KIND_NAMES.get(answer, answer)} to {what}; expected PARAMS")
                self.versions[s] = version
                self.pull[s].unpack_(plan.shards[s])
                self.seen[s] = [p._version for p in plan.shards[s]]
        if kind in (GRAD, HELLO, PAUSE):     # what the servers have seen of this worker's gradients
            self.marks = self._grad_marks()

    def _wait(self, pending, server: int, what: str) -> None:
        plan = self.plan
        try:
            wait(*pending)
        except CommError as exc:
            # a server that timed out on a dead worker closes all its connections at once,
            # then writes its note; a server that merely went silent leaves none
            note = self.note.read(0.0 if "timed out" in str(exc) else NOTE_WAIT_S)
            if note:
                raise DDTrainError(f"{plan.name}: {note}; worker rank {dist.get_rank()} stops") from None
            raise DDTrainError(f"{plan.name}: parameter server rank {server} did not answer {what} "
                               f"{self.steps} of worker rank {dist.get_rank()}: {exc}") from exc

    def push_changed_parameters(self) -> None:
        """SET: parameters changed here since the servers last sent them (a loaded checkpoint) go to the servers."""
        if self._param_versions() != self.seen:
            if self.plan.compressed:   # the 16-bit payload would round them: full precision, as bytes after the header
                self.send_bytes(SET, [flat_bytes(shard) for shard in self.plan.shards], "set parameters")
            else:
                self.exchange(SET, "set parameters")

    def step(self) -> None:
        self.exchange(GRAD, "step")
        self.steps += 1

    def state(self) -> dict:
        """The optimizer state the servers hold, keyed as ``optimizer.state_dict()["state"]`` keys it."""
        self.push_changed_parameters()
        merged = {}
        comm = self.plan.comm(self.plan.timeout_s + WORKER_MARGIN_S, suffix=SUFFIX[STATE])

        def receive(s: int, server: int) -> None:   # server s's bytes, right after its header (``exchange``)
            message = self.pull[s]
            nbytes, room = message.aux(), message.payload_bytes.numel()
            data = torch.empty(nbytes, dtype=torch.uint8)
            for c in range(chunks(nbytes, message)):
                link, peer = self.plan.route(comm, dist.get_rank(), server)
                self._wait((link, exchange(link, recvs=[(peer, message.buffer)], label="optimizer state")),
                           server, "optimizer state")
                part = data[c * room:(c + 1) * room]
                part.copy_(message.payload_bytes[:part.numel()])
            merged.update(from_bytes(data))

        self.exchange(STATE, "optimizer state", on_state=receive)
        return dict(sorted(merged.items()))

    def load_state(self, state: dict) -> None:
        """LOAD: every server installs its part of ``state`` (``optimizer.state_dict()["state"]``)."""
        data = to_bytes(state)
        self.send_bytes(LOAD, [data] * len(self.plan.servers), "load optimizer state")

    def send_bytes(self, kind: int, datas: list, what: str) -> None:
        """LOAD or SET: ``datas[s]`` to server ``s`` as bytes in full-size messages after the header; PARAMS answers."""
        plan = self.plan
        with self.ledger.timed():
            comm = plan.comm(plan.timeout_s + WORKER_MARGIN_S, suffix=SUFFIX[kind])
            for s, server in enumerate(plan.servers):
                data = datas[s]
                message = self.push[s]
                message.set_header(kind, self.versions[s], data.numel())
                link, peer = plan.route(comm, dist.get_rank(), server)
                sends = [(peer, message.buffer.clone())]
                room = message.payload_bytes.numel()
                for c in range(chunks(data.numel(), message)):
                    part = data[c * room:(c + 1) * room]
                    message.payload_bytes[:part.numel()].copy_(part)
                    sends.append((peer, message.buffer.clone()))
                self._wait((link, exchange(link, sends=sends, recvs=[(peer, self.pull[s].buffer)],
                                           label=what)), server, what)
                answer, version = self.pull[s].read_header()
                if answer != PARAMS:
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} answered "
                                       f"{KIND_NAMES.get(answer, answer)} to {KIND_NAMES[kind]}; expected PARAMS")
                if kind == SET:
                    self.versions[s] = version
                    self.pull[s].unpack_(plan.shards[s])
                    self.seen[s] = [p._version for p in plan.shards[s]]

    def pause(self, reason: int = 0) -> None:
        """ps-async: tell the servers this worker stops computing (before waiting on other workers).

        ``reason`` (``protocol.PAUSE_REASONS``) travels in the header, so that a server that
        waits too long for this worker can say what it was doing.
        """
        if not self.paused:
            self.exchange(PAUSE, "pause", aux=reason)
            self.paused = True

    def hello_if_paused(self) -> None:
        """A paused worker asks for parameters before a training forward pass."""
        if self.paused:
            self.exchange(HELLO, "hello")
            self.paused = False


def run_post_hooks(optimizer) -> None:
    """The user's optimizer's step post-hooks (a schedule stepped by them), after an update the servers made.

    Its pre-hooks do not run here: they would act on this worker's own gradient before the
    average (a clipping hook runs on the servers, which hold the same optimizer in ``fit``).
    """
    from torch.optim.optimizer import _global_optimizer_post_hooks
    for hook in [*_global_optimizer_post_hooks.values(), *optimizer._optimizer_step_post_hooks.values()]:
        hook(optimizer, (), {})


class WorkerOptimizer:
    """What a worker's loop steps: ``step()`` pushes the gradients and pulls fresh parameters.

    Everything else (``zero_grad``, ``param_groups``, ``state_dict``) is the user's optimizer,
    whose own ``step`` never runs on a worker: the servers hold the optimizer state.
    """

    def __init__(self, inner, link: WorkerLink):
        self._inner, self._link = inner, link

    def step(self, closure=None):
        if closure is not None:
            raise DDTrainError("ps-sync/ps-async: optimizer.step(closure) is not supported on workers")
        self._link.step()
        run_post_hooks(self._inner)

    def __getattr__(self, name):
        return getattr(self._inner, name)
