"""A parameter-server worker's side: ``WorkerLink`` pushes gradients and pulls parameters, ``WorkerOptimizer`` steps with it.

Every wait has the deadline of the plan's timeout plus ``WORKER_MARGIN_S``; a failed wait reads
the server's ``FailureNote`` and names the worker the server lost, or, without a note, the server.
"""
from __future__ import annotations

import torch

from ddtrain.comm.p2p import CommError, exchange, wait
from ddtrain.dist import runtime
from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.ps.protocol import FINAL, GRAD, HELLO, KIND_NAMES, PARAMS, PAUSE, SUFFIX, FailureNote, Plan

# Workers wait this much longer than servers, so that a server, which started waiting for a
# dead worker earlier than any live worker started waiting for the server, always times out first.
WORKER_MARGIN_S = 2.0
NOTE_WAIT_S = 1.0            # after losing its server's connection, how long a worker looks for a note


class WorkerLink:
    """A worker's side: push gradients, pull parameters, one message each way per server."""

    def __init__(self, plan: Plan, ledger: Ledger, note: FailureNote):
        self.plan, self.ledger, self.note = plan, ledger, note
        self.push = [plan.message(s) for s in range(len(plan.servers))]
        self.pull = [plan.message(s) for s in range(len(plan.servers))]
        self.versions = [0] * len(plan.servers)
        self.steps = 0
        self.paused = False          # ps-async: must say HELLO before computing again

    def exchange(self, kind: int, what: str) -> None:
        """Send ``kind`` to every server, wait for each answer, and install the parameters it brings."""
        plan = self.plan
        with self.ledger.timed():
            comm = plan.comm(plan.timeout_s + WORKER_MARGIN_S, suffix=SUFFIX[kind])
            pending = []
            for s, server in enumerate(plan.servers):
                if kind == GRAD:
                    self.push[s].pack_(plan.shards[s], grads=True)
                self.push[s].set_header(kind, self.versions[s])
                link, peer = plan.route(comm, runtime.rank(), server)
                pending.append((link, exchange(link, sends=[(peer, self.push[s].buffer)],
                                               recvs=[(peer, self.pull[s].buffer)], label=f"{what} {self.steps}")))
            for s, server in enumerate(plan.servers):
                try:
                    wait(*pending[s])
                except CommError as exc:
                    # a server that timed out on a dead worker closes all its connections at once,
                    # then writes its note; a server that merely went silent leaves none
                    note = self.note.read(0.0 if "timed out" in str(exc) else NOTE_WAIT_S)
                    if note:
                        raise DDTrainError(f"{plan.name}: {note}; worker rank {runtime.rank()} stops") from None
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} did not answer {what} "
                                       f"{self.steps} of worker rank {runtime.rank()}: {exc}") from exc
                answer, version = self.pull[s].read_header()
                if answer not in (PARAMS, FINAL):
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} answered "
                                       f"{KIND_NAMES.get(answer, answer)} to {what}; expected PARAMS")
                self.versions[s] = version
                self.pull[s].unpack_(plan.shards[s])

    def step(self) -> None:
        self.exchange(GRAD, "step")
        self.steps += 1

    def pause(self) -> None:
        """ps-async: tell the servers this worker stops computing (before waiting on other workers)."""
        if not self.paused:
            self.exchange(PAUSE, "pause")
            self.paused = True

    def hello_if_paused(self, module, _args) -> None:
        """Forward pre-hook: a paused worker asks for parameters before a training forward pass."""
        if self.paused and module.training and torch.is_grad_enabled():
            self.exchange(HELLO, "hello")
            self.paused = False


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

    def __getattr__(self, name):
        return getattr(self._inner, name)
