"""A parameter server's state and messages (``ServerCore``), and the NCCL connection set-up of every pair (``connect_peers``).

Each server holds a shard of the parameters and runs the user's optimizer on them only; the
serving loops are ``serve_sync`` (ps-sync) and ``serve_async`` (ps-async). A server that hears
nothing from a worker in time leaves a note in the job's store naming it and fails naming it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.comm.p2p import CommError, exchange, wait
from ddtrain.errors import DDTrainError
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.base import SyncStats
from ddtrain.sync.ps.protocol import KIND_NAMES, FailureNote, Plan


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
