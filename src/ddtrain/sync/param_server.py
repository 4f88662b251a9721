"""``ps-sync`` and ``ps-async``: parameter servers (000 Fig 4.1-4.2, 002 §2.5-2.6).

Roles: with ``--servers S`` the **last S ranks** are servers and ranks 0..W-1 (W = world - S)
are workers, so rank 0 -- the one that logs and writes the record -- is always a worker, and
worker ranks equal their index among the workers. Every rank calls ``dist.new_group`` for
the workers' group, in the same order, when the strategy is applied; rank 0's parameters and
buffers are then broadcast once, so servers and workers start from the same state.

Sharding: each parameter lives on one server, chosen greedily by size (largest first, to the
server holding the fewest elements so far; ties to the lower server), which balances bytes.
A server runs the user's optimizer on its own parameters only (the others never get a
gradient, and torch's optimizers skip those), so momentum and weight decay behave as in one
process.

Messages: one per (worker, server) and direction, over torch.distributed point-to-point
(``ddtrain.comm.p2p``: deadlines and traffic counting, operation name = strategy name). A
message is a byte buffer: a **16-byte header** of two int64 (kind, version) followed by the
shard's values, so kind, version and data travel together and one receive posted per worker
is enough for a server to learn "who arrived first" by polling ``is_completed()`` -- which
works on Gloo and NCCL alike (a receive from any source exists on Gloo only). Kinds: a
worker sends GRAD (version = the parameter version its gradient was computed on), HELLO (an
async worker asking for its first parameters) or STOP (training is over); a server answers
PARAMS (version = its update count), FINAL (after every worker stopped: the final
parameters, so every worker ends with the servers' model) or ABORT (version = the global rank
of a worker that failed; the receiver stops with an error naming it). STOP and HELLO carry a
full-size, unused payload: sizes never change, so no receive can mismatch.

Failure: every wait has the deadline of ``options.timeout_s`` (default: ``ddtrain.init``'s).
A server that hears nothing from a worker in time (or loses its connection) tells every
worker it can reach with ABORT, then fails naming the worker; a worker whose server fails
names the server. The synchronous server is here; the asynchronous one is ``ps_async``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import runtime
from ..comm import traffic
from ..comm.p2p import CommError, exchange, open_comm, wait
from ..errors import DDTrainError
from ..faults import maybe_inject
from .accounting import Ledger
from .base import Synced, SyncOptions, SyncStats
from .divergence import DivergenceMonitor
from .state import broadcast_, state_tensors

GRAD, PARAMS, STOP, HELLO, ABORT, FINAL = range(6)
KIND_NAMES = {GRAD: "GRAD", PARAMS: "PARAMS", STOP: "STOP", HELLO: "HELLO", ABORT: "ABORT", FINAL: "FINAL"}
HEADER_BYTES = 16            # int64 kind, int64 version
STOP_SUFFIX, HELLO_SUFFIX = " stop", " hello"   # traffic of STOP/FINAL and HELLO, apart from the steps
ABORT_GRACE_S = 2.0          # how long a failing server tries to reach the other workers


def assign_shards(sizes: list[int], servers: int) -> list[int]:
    """Server index (0..servers-1) of each parameter: largest first, to the least-loaded server."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i], load[s] = s, load[s] + sizes[i]
    return owner


class Message:
    """One preallocated message: a header (kind, version) and a shard's values, in one byte buffer."""

    def __init__(self, numel: int, dtype: torch.dtype, device):
        size = torch.empty((), dtype=dtype).element_size()
        self.buffer = torch.zeros(HEADER_BYTES + numel * size, dtype=torch.uint8, device=device)
        self.header = self.buffer[:HEADER_BYTES].view(torch.int64)
        self.payload = self.buffer[HEADER_BYTES:].view(dtype)

    def read_header(self) -> tuple[int, int]:
        kind, version = self.header.tolist()
        return int(kind), int(version)

    def set_header(self, kind: int, version: int) -> None:
        self.header.copy_(torch.tensor([kind, version], dtype=torch.int64))

    @torch.no_grad()
    def pack_(self, tensors, grads: bool = False) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            source = t.grad if grads else t
            if source is None:
                self.payload[offset:offset + n].zero_()
            else:
                self.payload[offset:offset + n].copy_(source.detach().reshape(-1))
            offset += n

    @torch.no_grad()
    def unpack_(self, tensors) -> None:
        offset = 0
        for t in tensors:
            t.copy_(self.payload[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class Plan:
    """Who is who, and which parameters each server holds (the same on every rank)."""

    name: str                    # "ps-sync" or "ps-async": the traffic operation and error prefix
    workers: list[int]           # global ranks
    servers: list[int]           # global ranks
    shards: list[list[torch.nn.Parameter]]   # per server, in model order
    dtype: torch.dtype
    device: torch.device
    timeout_s: float

    def message(self, server_index: int) -> Message:
        return Message(sum(p.numel() for p in self.shards[server_index]), self.dtype, self.device)

    def comm(self, timeout_s: float | None = None, suffix: str = ""):
        """A deadline for one exchange; traffic goes to ``name + suffix`` (" stop", " hello": not steps)."""
        return open_comm(self.name + suffix, None, timeout_s or self.timeout_s, device=self.device)

    def operations(self) -> tuple[str, ...]:
        return (self.name, self.name + STOP_SUFFIX, self.name + HELLO_SUFFIX)


def reattribute(operation: str, suffix: str, nbytes: int, messages: int) -> None:
    """Move received traffic from ``operation`` to ``operation + suffix`` once we know what it was.

    A server posts its receives before it knows whether a worker will send a gradient, HELLO
    or STOP; the per-step counters should only hold the steps.
    """
    traffic.record(operation, bytes_received=-nbytes, messages_received=-messages)
    traffic.record(operation + suffix, bytes_received=nbytes, messages_received=messages)


def make_plan(name: str, module, options: SyncOptions, world: int) -> Plan:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise DDTrainError(f"{name}: the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise DDTrainError(f"{name}: every trainable parameter must have one dtype, got {sorted(map(str, dtypes))}")
    workers = world - options.servers
    owner = assign_shards([p.numel() for p in params], options.servers)
    shards = [[p for p, o in zip(params, owner) if o == s] for s in range(options.servers)]
    return Plan(name, list(range(workers)), list(range(workers, world)), shards, params[0].dtype,
                params[0].device, options.timeout_s or runtime.timeout_s())


class WorkerLink:
    """A worker's side: push gradients, pull parameters, one message each way per server."""

    def __init__(self, plan: Plan, ledger: Ledger):
        self.plan, self.ledger = plan, ledger
        self.push = [plan.message(s) for s in range(len(plan.servers))]
        self.pull = [plan.message(s) for s in range(len(plan.servers))]
        self.versions = [0] * len(plan.servers)
        self.steps = 0

    def exchange(self, kind: int, what: str) -> None:
        """Send ``kind`` to every server, wait for each answer, and install the parameters it brings."""
        plan = self.plan
        with self.ledger.timed():
            comm = plan.comm(suffix={GRAD: "", STOP: STOP_SUFFIX, HELLO: HELLO_SUFFIX}[kind])
            pending = []
            for s, server in enumerate(plan.servers):
                if kind == GRAD:
                    self.push[s].pack_(plan.shards[s], grads=True)
                self.push[s].set_header(kind, self.versions[s])
                pending.append(exchange(comm, sends=[(server, self.push[s].buffer)],
                                        recvs=[(server, self.pull[s].buffer)], label=f"{what} {self.steps}"))
            for s, server in enumerate(plan.servers):
                try:
                    wait(comm, pending[s])
                except CommError as exc:
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} did not answer {what} "
                                       f"{self.steps} of worker rank {runtime.rank()}: {exc}") from exc
                answer, version = self.pull[s].read_header()
                if answer == ABORT:
                    raise DDTrainError(f"{plan.name}: worker rank {version} failed or stopped answering "
                                       f"(reported by parameter server rank {server}); stopping")
                if answer not in (PARAMS, FINAL):
                    raise DDTrainError(f"{plan.name}: parameter server rank {server} answered "
                                       f"{KIND_NAMES.get(answer, answer)} to {what}; expected PARAMS")
                self.versions[s] = version
                self.pull[s].unpack_(plan.shards[s])

    def step(self) -> None:
        self.exchange(GRAD, "step")
        self.steps += 1


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
    """A server's state: its parameters, the optimizer over them, one inbox/outbox per worker."""

    def __init__(self, plan: Plan, optimizer, index: int, ledger: Ledger, stats: SyncStats):
        self.plan, self.optimizer, self.index, self.ledger, self.stats = plan, optimizer, index, ledger, stats
        self.params = plan.shards[index]
        self.inbox = {w: plan.message(index) for w in plan.workers}
        self.outbox = {w: plan.message(index) for w in plan.workers}
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
        return exchange(comm, recvs=[(worker, self.inbox[worker].buffer)], label=f"{what} from worker")

    def send(self, comm, workers, kind: int, label: str) -> None:
        """Send ``kind`` (with the current parameters) to ``workers`` and wait until it has left."""
        posted = []
        for w in workers:
            box = self.outbox[w]
            box.pack_(self.params)
            box.set_header(kind, self.version)
            posted.append((w, exchange(comm, sends=[(w, box.buffer)], label=label)))
        for w, p in posted:
            try:
                wait(comm, p)
            except CommError as exc:
                self.fail(w, f"could not send {KIND_NAMES[kind]} to worker rank {w}: {exc}", workers)

    def fail(self, worker: int, why: str, reachable) -> None:
        """Tell the ``reachable`` workers (other than ``worker``) to stop, then raise naming ``worker``."""
        grace = self.plan.comm(min(ABORT_GRACE_S, self.plan.timeout_s))
        posted = []
        for w in reachable:
            if w == worker:
                continue
            box = self.outbox[w]
            box.set_header(ABORT, worker)
            try:
                posted.append(exchange(grace, sends=[(w, box.buffer)], label="abort"))
            except Exception:   # the worker may be gone too; we are failing anyway
                pass
        for p in posted:
            try:
                wait(grace, p)
            except Exception:
                pass
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
                    wait(comm, pending[w])
                except CommError as exc:
                    core.fail(w, str(exc), _arrived(comm, pending, w))
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


def _arrived(comm, pending, failed) -> list[int]:
    """Workers whose message of this round arrived (within a short grace): they wait for an answer."""
    out = []
    for w, p in pending.items():
        if w == failed:
            continue
        try:
            grace = open_comm(comm.name, None, min(ABORT_GRACE_S, comm.timeout_s), device=None)
            wait(grace, p)
            out.append(w)
        except Exception:
            pass
    return out


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
    plan = make_plan(name, model, options, world)
    worker_group = dist.new_group(plan.workers)          # every rank, same order
    broadcast_(state_tensors(model), counted=False)      # servers and workers start alike
    ledger, stats = Ledger(plan.operations()), SyncStats()
    common = dict(workers=len(plan.workers), update_stats=lambda: ledger.fill(stats))
    if rank in plan.servers:
        core = ServerCore(plan, optimizer, plan.servers.index(rank), ledger, stats)
        if asynchronous:
            from .ps_async import serve_async
            serve = lambda: serve_async(core, options.staleness)  # noqa: E731
        else:
            serve = lambda: serve_sync(core)  # noqa: E731
        stats.extra["server_parameters"] = sum(p.numel() for p in core.params)
        return Synced(model, optimizer, model, stats, role="server", worker_rank=0, serve=serve, **common)
    link = WorkerLink(plan, ledger)
    monitor = DivergenceMonitor(model, stats, worker_group, options.check_every)
    synced = Synced(model, WorkerOptimizer(optimizer, link), model, stats, worker_rank=rank,
                    group=worker_group, **common)
    if asynchronous:   # ask for the first parameters before the first forward pass (staleness gate)
        from .ps_async import hello_before_first_forward
        hello_before_first_forward(model, link)
    synced.after_step = lambda step: monitor.after_step()
    synced.end_epoch = lambda epoch: monitor.end_epoch(epoch)
    synced.finish = lambda: link.exchange(STOP, "stop")
    return synced
