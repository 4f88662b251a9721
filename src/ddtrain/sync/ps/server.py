"""``ps-sync`` and ``ps-async``: parameter servers (000 Fig 4.1-4.2, 002 §2.5-2.6).

Roles: with ``--servers S`` the **last S ranks** are servers and ranks 0..W-1 (W = world - S)
are workers, so rank 0 -- the one that logs and writes the record -- is always a worker, and
worker ranks equal their index among the workers. Every rank calls ``dist.new_group`` for
the workers' group, in the same order, when the strategy is applied; rank 0's parameters and
buffers are then broadcast once, so servers and workers start from the same state.

Each server holds a shard of the parameters (``ps_messages``: greedy by size) and runs the
user's optimizer on its own parameters only (the others never get a gradient, and torch's
optimizers skip those), so momentum and weight decay behave as in one process. A worker's
``optimizer.step()`` sends its gradients to every server and installs the parameters each
answers with; the user's optimizer never steps on a worker.

``ps-sync`` (here): each round the server waits for a gradient from every worker, applies
their mean once (summed in worker order, whatever the arrival order) and answers every worker
with the new parameters -- one process with the global batch, step for step. ``ps-async``
(``ps_async``) applies each gradient as it arrives. When every worker has sent STOP the
servers answer with the final parameters, so every worker ends with the servers' model.

Failure: every wait has the deadline of ``options.timeout_s`` (default: ``ddtrain.init``'s).
A server that hears nothing from a worker in time (or loses its connection) leaves a note
in the job's store naming the worker and fails naming it; a worker whose wait on a server
fails reads the note and names the lost worker, or, without a note, names the server.
Workers wait ``WORKER_MARGIN_S`` longer than servers, so that a server, which started
waiting for a dead worker earlier than any live worker started waiting for the server,
always times out first. The synchronous server is here; the asynchronous one is ``ps_async``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.dist import runtime
from ddtrain.comm.p2p import CommError, exchange, wait
from ddtrain.errors import DDTrainError
from ddtrain.reliability.faults import maybe_inject
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.ps.protocol import (FINAL, GRAD, HELLO, KIND_NAMES, PARAMS, PAUSE, STOP, STOP_SUFFIX, SUFFIX, FailureNote,
                          Plan, make_plan, reattribute)
from ddtrain.sync.state import broadcast_, state_tensors

WORKER_MARGIN_S = 2.0        # workers wait this much longer than servers (see the module docstring)
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


class ServerCore:
    """A server's state: its parameters, the optimizer over them, an inbox per worker, one outbox."""

    def __init__(self, plan: Plan, optimizer, index: int, ledger: Ledger, stats: SyncStats, note: FailureNote):
        self.plan, self.optimizer, self.index, self.ledger, self.stats = plan, optimizer, index, ledger, stats
        self.note = note
        self.params = plan.shards[index]
        self.inbox = {w: plan.message(index) for w in plan.workers}
        self.outbox = plan.message(index)       # one answer, sent to every worker that gets it
        self.version = 0
        self.rank = plan.servers[index]

    @torch.no_grad()
    def apply_(self, grads: torch.Tensor) -> None:
        """One optimizer step of this server's parameters with the flat gradient ``grads``."""
        offset = 0
        for p in self.params:
            p.grad = grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        with torch.enable_grad():
            self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.version += 1

    def post_receive(self, comm, worker: int, what: str):
        """Post the receive of ``worker``'s next message; wait for it with ``wait(pending.comm, pending)``."""
        link, peer = self.plan.route(comm, worker, self.rank)
        return exchange(link, recvs=[(peer, self.inbox[worker].buffer)], label=f"{what} from worker")

    def send(self, comm, workers, kind: int, label: str) -> None:
        """Send ``kind`` (with the current parameters) to ``workers`` and wait until it has left."""
        self.outbox.pack_(self.params)
        self.outbox.set_header(kind, self.version)
        posted = []
        for w in workers:
            link, peer = self.plan.route(comm, w, self.rank)
            posted.append((w, link, exchange(link, sends=[(peer, self.outbox.buffer)], label=label)))
        for w, link, p in posted:
            try:
                wait(link, p)
            except CommError as exc:
                self.fail(w, f"could not send {KIND_NAMES[kind]} to worker rank {w}: {exc}")

    def fail(self, worker: int, why: str) -> None:
        """Leave a note naming ``worker`` for the other workers, then raise naming it."""
        self.note.post(f"worker rank {worker} failed or stopped answering (reported by parameter server "
                       f"rank {self.rank})")
        raise DDTrainError(f"{self.plan.name}: parameter server rank {self.rank}: worker rank {worker} "
                           f"failed or stopped answering (timeout {self.plan.timeout_s:g}s): {why}")


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


def connect_peers(plan, rank: int, device) -> None:
    """On NCCL, connect every worker-server pair at once, before the first message.

    NCCL sets up a pair's connection at the pair's first transfer, inside the group call that
    posts it. Servers post one worker at a time, so with two or more workers those set-ups
    could wait on each other (seen on 4 H200s: a hang with 2 workers, an NCCL internal error
    with 3). One group call per rank naming all its peers lets NCCL connect them together.
    """
    if dist.get_backend() != "nccl":
        return
    if plan.pairs is not None:  # each pair's own group, pairs in one global order (no waiting cycle)
        for (w, srv), group in sorted(plan.pairs.items(), key=lambda kv: kv[0]):
            if rank in (w, srv):
                token = torch.zeros(2, dtype=torch.uint8, device=device)
                peer = srv if rank == w else w
                for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, token[:1], peer, group=group),
                                                    dist.P2POp(dist.isend, token[1:], peer, group=group)]):
                    work.wait()
        return
    peers = plan.workers if rank in plan.servers else plan.servers
    token = torch.zeros(2 * len(peers), dtype=torch.uint8, device=device)
    ops = []
    for i, peer in enumerate(peers):
        ops += [dist.P2POp(dist.irecv, token[2 * i:2 * i + 1], peer), dist.P2POp(dist.isend, token[2 * i + 1:2 * i + 2], peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def wrap_param_server(model, optimizer, options: SyncOptions, *, asynchronous: bool = False) -> Synced:
    """Apply ``ps-sync`` (or ``ps-async``); see the module docstring for roles and messages."""
    name = "ps-async" if asynchronous else "ps-sync"
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return Synced(model, optimizer, model, SyncStats(method="none: world size 1"))
    if options.servers >= world:
        raise DDTrainError(f"{name}: --servers {options.servers} leaves no worker among {world} ranks; "
                           f"use at least {options.servers + 1} processes")
    rank = dist.get_rank()
    plan = make_plan(name, model, options.servers, options.timeout_s, world)
    worker_group = dist.new_group(plan.workers)          # every rank, same order
    if asynchronous and dist.get_backend() == "nccl":
        # a group per worker-server pair, created by every rank in the same order (see ps_async)
        plan.pairs = {(w, srv): dist.new_group([w, srv]) for w in plan.workers for srv in plan.servers}
    broadcast_(state_tensors(model), counted=False)      # servers and workers start alike
    connect_peers(plan, rank, next(model.parameters()).device)
    ledger, stats, note = Ledger(plan.operations()), SyncStats(), FailureNote(name)
    common = dict(workers=len(plan.workers), update_stats=lambda: ledger.fill(stats))
    if rank in plan.servers:
        core = ServerCore(plan, optimizer, plan.servers.index(rank), ledger, stats, note)
        if asynchronous:
            from ddtrain.sync.ps.serve_async import serve_async
            serve = lambda: serve_async(core, options.staleness)  # noqa: E731
        else:
            serve = lambda: serve_sync(core)  # noqa: E731
        stats.extra["server_parameters"] = sum(p.numel() for p in core.params)
        return Synced(model, optimizer, model, stats, role="server", worker_rank=0, serve=serve, **common)
    link = WorkerLink(plan, ledger, note)
    monitor = DivergenceMonitor(model, stats, worker_group, options.check_every)
    synced = Synced(model, WorkerOptimizer(optimizer, link), model, stats, worker_rank=rank,
                    group=worker_group, **common)
    if asynchronous:
        # The staleness gate must know which workers compute: a worker starts paused, says
        # HELLO before its first training forward, and pauses before anything that waits on
        # the other workers (divergence checks, the loop's epoch-end metrics and validation).
        link.paused = True
        model.register_forward_pre_hook(link.hello_if_paused)

    def after_step(step: int) -> None:
        if asynchronous and monitor.check_due():
            link.pause()
        monitor.after_step()

    def end_epoch(epoch: int) -> None:
        if asynchronous:
            link.pause()
        monitor.end_epoch(epoch)

    synced.after_step, synced.end_epoch = after_step, end_epoch
    synced.finish = lambda: link.exchange(STOP, "stop")
    return synced
