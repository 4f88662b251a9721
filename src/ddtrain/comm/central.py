"""``central``: every rank sends its buffer to rank 0 (000's master, Fig 4.1), which reduces and sends the result back.

Two steps, but rank 0's link carries (n-1)·N bytes each way -- the bottleneck that makes a
parameter server's speed-up level off (002). Rank 0 posts all n-1 receives at once, so it
needs (n-1)·N bytes of landing space.

Determinism: rank 0 reduces in rank order, x_0 (op) x_1 (op) ... (op) x_{n-1}, whatever order
the buffers arrive in, and every other rank receives a copy of that one result.

Traffic: rank 0 sends and receives (n-1)·N in n-1 messages each way; every other rank sends
N and receives N (one message each way).
"""
from __future__ import annotations

import torch

from ddtrain.comm.algorithm import Algorithm, link_shared, trivial_cost
from ddtrain.comm.ops import combine_, run_all_reduce
from ddtrain.comm.p2p import Comm, sendrecv

ROOT = 0


def _central_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    others = [p for p in range(comm.size) if p != ROOT]
    if comm.rank == ROOT:
        incoming = [torch.empty_like(flat) for _ in others]
        sendrecv(comm, recvs=list(zip(others, incoming)), label="gather to master")
        combine = combine_(op)
        for buf in incoming:               # rank order, not arrival order
            combine(flat, buf)
        del incoming
        sendrecv(comm, sends=[(p, flat) for p in others], label="send result")
    else:
        sendrecv(comm, sends=[(ROOT, flat)], label="gather to master")
        sendrecv(comm, recvs=[(ROOT, flat)], label="send result")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """Central (master) all-reduce through group rank 0, in place; returns ``tensor``."""
    return run_all_reduce(tensor, op, group, timeout_s, "central", _central_)


def central_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Everyone sends to rank 0, which adds and sends the result back to each (000 Fig 4.1).

    The root's link is the bottleneck: it receives p−1 whole buffers, one after another, adds
    each, then sends p−1 whole buffers: ``2(p−1)(α + nβ) + (p−1)nγ``.
    """
    if trivial_cost(nbytes, ranks):
        return 0.0
    p = ranks
    return 2 * (p - 1) * (alpha + nbytes * beta) + (p - 1) * nbytes * gamma


def central_steps(nbytes: float, ranks: int) -> list[float]:
    """2(p−1) steps of the whole buffer: the root receives the p−1 buffers one after another, then sends p−1."""
    if trivial_cost(nbytes, ranks):
        return []
    return [float(nbytes)] * (2 * (ranks - 1))


def central_link_share(ranks: int, procs_per_node: int) -> float:
    """(p − procs_per_node)/(p − 1): of the root's p−1 sequential transfers only those of the ranks off its node cross
    its link."""
    return (ranks - procs_per_node) / (ranks - 1) if link_shared(ranks, procs_per_node) else 1.0


ALGORITHM = Algorithm(name="central", all_reduce=all_reduce, time=central_time, steps=central_steps,
                      link_share=central_link_share,
                      summary="every rank sends to rank 0, which reduces and sends the result back")
