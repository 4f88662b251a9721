"""A parameter server's state and messages (``ServerCore``), and the NCCL connection set-up of every pair (``connect_peers``).

Each server holds a shard of the parameters and runs the user's optimizer on them only, with
the hyper-parameters the workers send with every gradient; the serving loops are
``serve_sync`` (ps-sync) and ``serve_async`` (ps-async). A server that hears nothing from a
worker in time leaves a note in the job's store naming it and fails naming it.
"""
from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist

from ddtrain.comm.p2p import CommError, exchange, wait
from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import SyncStats
from ddtrain.sync.ps.protocol import (GRAD, KIND_NAMES, LOAD, PARAMS, PAUSE, PAUSE_REASONS, SET, STATE, FailureNote, Plan,
                                     unpack_bytes_, write_hyper)


def to_bytes(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_bytes(data: torch.Tensor):
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)


def chunks(nbytes: int, message) -> int:
    """Full-size messages needed to carry ``nbytes`` in payloads of ``message``'s size."""
    room = message.payload_bytes.numel()
    if nbytes and not room:
        raise DDTrainError("ps: a server holds no parameters, so its messages cannot carry optimizer state")
    return -(-nbytes // room) if nbytes else 0


# --async-rule -> (how lr is divided, how explicit momentum is lowered); docs/ALGORITHMS.md has each one's measurement
ASYNC_RULE_PARTS = {"dana": ("workers", None),    # plus a momentum buffer per worker and look-ahead parameters (ServerCore)
                    "staleness": ("staleness", "subtract"),
                    "lr-staleness": ("staleness", None),
                    "momentum": (None, "keep-total"),
                    "momentum-subtract": (None, "subtract"),
                    "lr-workers": ("workers", None),
                    "lr-staleness-momentum": ("staleness", "keep-total"),
                    "lr-workers-momentum": ("workers", "keep-total"),
                    "lr-staleness-no-momentum": ("staleness", "zero"),
                    "dc-staleness": ("staleness", "subtract"),
                    "dc-lr-workers": ("workers", None)}
DC_LAMBDA, DC_DECAY = 2.0, 0.95    # DC-ASGD-a's lambda_0 and mean-square decay (Zheng et al. 2017, their CIFAR-10 values)


def dana_applies(optimizer) -> bool:
    """Can ``--async-rule dana`` run on ``optimizer``? Its look-ahead is heavy-ball SGD's (no Nesterov, no dampening)."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        not g.get("nesterov") and not g.get("dampening") for g in optimizer.param_groups)


def delay_compensate_(grads, now, stale, mean_square) -> None:
    """DC-ASGD-a, in place: ``g + lambda_0 / sqrt(ms) * g * g * (w_now - w_stale)`` (``g * g`` approximates the
    Hessian's diagonal)."""
    mean_square.mul_(DC_DECAY).addcmul_(grads, grads, value=1 - DC_DECAY)
    grads.add_(grads * grads * (now - stale) * DC_LAMBDA / (mean_square.sqrt() + 1e-8))


def staleness_rule(hyper_groups, staleness: int, mean_staleness: float, rule: str = "staleness", workers: int = 1) -> None:
    """ps-async's correction of one update's hyper-parameters for asynchrony, in place (docs/ALGORITHMS.md).

    ``rule`` (``--async-rule``, ``ASYNC_RULE_PARTS``): lr divided by ``1 + staleness`` (Zhang et
    al. 2016) or by the number of workers, and/or explicit momentum lowered for the implicit
    momentum asynchrony adds, ``mu_i = m / (1 + m)`` for a mean staleness ``m`` (Mitliagkas et
    al. 2016; ``1 - 1/M`` for M workers in turn): "keep-total" so that ``(1 - mu) = (1 - mu_e)(1 -
    mu_i)``, "subtract" ``mu_e = mu - mu_i``, "zero" none; ``mu_e`` at least 0.
    """
    lr_part, mu_part = ASYNC_RULE_PARTS[rule]
    implicit = mean_staleness / (1.0 + mean_staleness)
    for group in hyper_groups:
        if "lr" in group and lr_part == "staleness":
            group["lr"] = group["lr"] / (1.0 + staleness)
        elif "lr" in group and lr_part == "workers":
            group["lr"] = group["lr"] / workers
        mu = group.get("momentum")
        if isinstance(mu, float) and mu > 0 and mu_part == "subtract":
            group["momentum"] = max(0.0, mu - implicit)
        elif isinstance(mu, float) and mu > 0 and mu_part == "keep-total":
            group["momentum"] = max(0.0, 1.0 - (1.0 - mu) / (1.0 - implicit))
        elif isinstance(mu, float) and mu > 0 and mu_part == "zero":
            group["momentum"] = 0.0


class ServerCore:
    """A server's state: its parameters, the optimizer over them, an inbox per worker, one outbox.

    The optimizer is the user's, over every parameter; only this server's shard ever gets a
    gradient and torch's optimizers skip the others, so momentum and weight decay behave as in
    one process. A worker's own ``optimizer.step()`` never runs: the servers hold that state.
    """

    def __init__(self, plan: Plan, optimizer, index: int, ledger: Ledger, stats: SyncStats, note: FailureNote):
        self.plan, self.optimizer, self.index, self.ledger, self.stats = plan, optimizer, index, ledger, stats
        self.note = note
        self.params = plan.shards[index]
        self.inbox = {w: plan.message(index, to_server=True) for w in plan.workers}   # 16-bit with fp16/bf16
        self.outbox = plan.message(index)       # one answer, sent to every worker that gets it
        self.version = 0
        self.rank = plan.servers[index]
        self.momenta: dict[int, list] = {}      # --async-rule dana: worker -> its momentum buffer per parameter
        self.last: dict[int, tuple] = {}        # worker -> (kind, aux, update, monotonic time) of its last message

    def heard(self, worker: int) -> int:
        """Record ``worker``'s message now in its inbox (for ``last_heard``); its kind."""
        kind, _ = self.inbox[worker].read_header()
        self.last[worker] = (kind, self.inbox[worker].aux(), self.version, time.monotonic())
        return kind

    def last_heard(self, worker: int) -> str:
        """What ``worker`` said last and how long ago: what a failure names it as doing."""
        if worker not in self.last:
            return "it has sent nothing to this server since the start"
        kind, aux, update, at = self.last[worker]
        what = {GRAD: "its gradient", PAUSE: f"a pause {PAUSE_REASONS.get(aux, '')}".rstrip()}.get(
            kind, KIND_NAMES.get(kind, str(kind)))
        return f"its last message, {time.monotonic() - at:.1f}s ago at update {update}, was {what}"

    @torch.no_grad()
    def apply_(self, grads: torch.Tensor, message=None, staleness: int | None = None, mean_staleness: float = 0.0,
               has_grad=None, rule: str = "staleness", worker: int | None = None) -> None:
        """One optimizer step of this server's parameters with the flat gradient ``grads``.

        ``message`` (the worker's GRAD, or the first of a ps-sync round) brings the worker's
        current hyper-parameters; ``has_grad`` says which parameters have a gradient (the others
        get ``grad = None`` and torch's optimizers skip them, as in one process). ``staleness``
        (ps-async with a correction on): apply ``staleness_rule`` with ``rule`` to this update.
        """
        hyper = self.plan.hyper
        groups = self.optimizer.param_groups
        if message is not None and hyper:
            write_hyper(groups, hyper, message.read_values(0, sum(n for _, _, n in hyper)))
        if has_grad is None and message is not None:
            has_grad = self.has_grad(message)
        saved = None
        if staleness is not None:
            saved = [{k: g[k] for k in ("lr", "momentum") if k in g} for g in groups]
            staleness_rule(groups, staleness, mean_staleness, rule, len(self.plan.workers))
        offset = 0
        for i, p in enumerate(self.params):
            if has_grad is None or has_grad[i]:
                p.grad = grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        momenta = self.momenta.setdefault(worker, [None] * len(self.params)) if rule == "dana" else None
        state = self.optimizer.state
        if momenta is not None:      # this worker's own momentum (DANA: Hakimi et al. 2019)
            for p, buffer in zip(self.params, momenta):
                if buffer is None:
                    state[p].pop("momentum_buffer", None)
                else:
                    state[p]["momentum_buffer"] = buffer
        with torch.enable_grad():
            self.optimizer.step()
        for i, p in enumerate(self.params):
            p.grad = None
            if momenta is not None:
                momenta[i] = state[p].get("momentum_buffer")
        if saved is not None:       # the next update starts again from the worker's values
            for g, values in zip(groups, saved):
                g.update(values)
        self.version += 1

    @torch.no_grad()
    def lookahead(self) -> list[torch.Tensor]:
        """DANA-Zero's estimate of the parameters a gradient computed now will be applied to.

        ``theta - (lr / M) * mu * sum_j v_j`` (``v_j`` worker j's momentum buffer, ``M`` workers):
        where the momentum of every worker's pending updates will have carried the parameters by
        the time this worker's gradient arrives. The worker computes its gradient there, which
        cancels the lag that makes stale heavy-ball updates diverge (docs/ALGORITHMS.md).
        """
        group_of = {p: g for g in self.optimizer.param_groups for p in g["params"]}
        ahead = []
        for i, p in enumerate(self.params):
            buffers = [m[i] for m in self.momenta.values() if m[i] is not None]
            group = group_of[p]
            mu = group.get("momentum") or 0.0
            if not buffers or not mu:
                ahead.append(p)
                continue
            ahead.append(p - (group["lr"] / len(self.plan.workers)) * mu * torch.stack(buffers).sum(0))
        return ahead

    def has_grad(self, message) -> list[bool]:
        start = sum(n for _, _, n in self.plan.hyper)
        return [flag > 0.5 for flag in message.read_values(start, len(self.params))]

    def aside(self, comm, worker: int, kind: int) -> None:
        """Answer SET, STATE or LOAD from ``worker`` (its message is in ``inbox[worker]``) at once."""
        message = self.inbox[worker]
        if kind == SET and self.plan.compressed:   # full-precision parameters follow as bytes (worker.send_bytes)
            unpack_bytes_(self.params, self.receive_bytes(comm, worker, message.aux()))
            self.send(comm, [worker], PARAMS, "parameters (set)")
        elif kind == SET:
            message.unpack_(self.params)
            self.send(comm, [worker], PARAMS, "parameters (set)")
        elif kind == STATE:
            data = to_bytes(self.shard_state())
            self.send(comm, [worker], STATE, "optimizer state", aux=data.numel())
            self.send_bytes(comm, worker, data)
        elif kind == LOAD:
            data = self.receive_bytes(comm, worker, message.aux())
            self.load_shard_state(from_bytes(data))
            self.send(comm, [worker], PARAMS, "parameters (state loaded)")

    def shard_state(self) -> dict:
        """This server's part of the optimizer state, keyed as ``optimizer.state_dict()`` keys it."""
        mine = {id(p) for p in self.params}
        index = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        state = self.optimizer.state_dict()["state"]
        return {i: s for i, s in state.items() if index[i] in mine}

    def load_shard_state(self, state: dict) -> None:
        mine = {id(p) for p in self.params}
        index = [id(p) for g in self.optimizer.param_groups for p in g["params"]]
        ours = {int(i): s for i, s in state.items() if int(i) < len(index) and index[int(i)] in mine}
        self.optimizer.load_state_dict({"state": ours, "param_groups": self.optimizer.state_dict()["param_groups"]})

    def send_bytes(self, comm, worker: int, data: torch.Tensor) -> None:
        room = self.outbox.payload_bytes.numel()
        for c in range(chunks(data.numel(), self.outbox)):
            part = data[c * room:(c + 1) * room]
            self.outbox.payload_bytes[:part.numel()].copy_(part)
            link, peer = self.plan.route(comm, worker, self.rank)
            try:
                wait(link, exchange(link, sends=[(peer, self.outbox.buffer)], label="optimizer state"))
            except CommError as exc:
                self.fail(worker, f"could not send the optimizer state: {exc}")

    def receive_bytes(self, comm, worker: int, nbytes: int) -> torch.Tensor:
        message = self.inbox[worker]
        room = message.payload_bytes.numel()
        data = torch.empty(nbytes, dtype=torch.uint8)
        for c in range(chunks(nbytes, message)):
            pending = self.post_receive(comm, worker, "optimizer state")
            try:
                wait(pending.comm, pending)
            except CommError as exc:
                self.fail(worker, f"could not receive the optimizer state: {exc}")
            part = data[c * room:(c + 1) * room]
            part.copy_(message.payload_bytes[:part.numel()])
        return data

    def post_receive(self, comm, worker: int, what: str):
        """Post the receive of ``worker``'s next message; wait for it with ``wait(pending.comm, pending)``."""
        link, peer = self.plan.route(comm, worker, self.rank)
        return exchange(link, recvs=[(peer, self.inbox[worker].buffer)], label=f"{what} from worker")

    def send(self, comm, workers, kind: int, label: str, aux: int = 0, params=None) -> None:
        """Send ``kind`` (with the current parameters, or ``params``) to ``workers`` and wait until it has left."""
        self.outbox.pack_(self.params if params is None else params)
        self.outbox.set_header(kind, self.version, aux)
        posted = []
        for w in workers:
            link, peer = self.plan.route(comm, w, self.rank)
            posted.append((w, link, exchange(link, sends=[(peer, self.outbox.buffer)], label=label)))
        for w, link, p in posted:
            try:
                wait(link, p)
            except CommError as exc:
                self.fail(w, f"could not send {KIND_NAMES[kind]} to worker rank {w}: {exc}")

    def fail(self, worker: int, why: str, detail: str = "") -> None:
        """Leave a note naming ``worker`` and what it did last for the other workers, then raise naming it.

        ``detail``: what else the server knows (other workers' gradients held for this one's).
        """
        known = self.last_heard(worker) + (f"; {detail}" if detail else "")
        self.note.post(f"worker rank {worker} failed or stopped answering (reported by parameter server "
                       f"rank {self.rank}): {known}")
        raise DDTrainError(f"{self.plan.name}: parameter server rank {self.rank}: worker rank {worker} "
                           f"failed or stopped answering (timeout {self.plan.timeout_s:g}s): {why}; {known}")


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
