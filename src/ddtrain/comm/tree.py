"""``tree``: binomial-tree reduce to rank 0, then binomial-tree broadcast (001's tree all-reduce).

Ranks are numbered relative to the root (v = rank - root mod n). Reduce: at level k
(mask = 2^k) a rank whose bit k is set sends its partial result to v - mask and stops; a
rank with bit k clear receives from v + mask (if it exists) and reduces it into its own.
After ceil(log2 n) levels the root holds the result; the broadcast runs the same tree
downwards, largest subtree first. Every step moves the whole buffer: 2·ceil(log2 n) steps of
N bytes on the critical path (001: 2·log2(P)·(L + γmG)), latency-friendly, bandwidth-poor.

Determinism: the root's result is x_0 (op) x_1, then (op) (x_2 (op) x_3), then the 4..7
subtree, ... -- fixed by rank, never by timing -- and the broadcast copies it, so every rank
holds the same bits.

Traffic per rank: each non-root rank sends its partial once and receives the result once;
each rank receives one partial from and sends the result to each of its children (root: all
ceil(log2 n) of them). So a rank with c children sends and receives (c + [rank != root])·N.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ddtrain.comm.algorithm import Algorithm, link_shared, trivial_cost
from ddtrain.comm.ops import combine_, run_all_reduce
from ddtrain.comm.p2p import Comm, sendrecv


def reduce_to_root_(comm: Comm, tensors: Sequence[torch.Tensor],
                    combine: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None],
                    root: int = 0, phase: str = "reduce") -> None:
    """Binomial reduce of ``tensors`` to ``root`` in place; elsewhere they end as scratch.

    ``combine(acc, incoming)`` folds a child's tensors into this rank's (a list, so MAXLOC can
    carry values and ranks together).
    """
    n = comm.size
    v = (comm.rank - root) % n
    incoming = None
    mask, level = 1, 0
    while mask < n:
        if v & mask:
            sendrecv(comm, sends=[((v - mask + root) % n, t) for t in tensors], label=f"{phase} step {level}")
            return
        if v + mask < n:
            if incoming is None:
                incoming = [torch.empty_like(t) for t in tensors]
            sendrecv(comm, recvs=[((v + mask + root) % n, t) for t in incoming], label=f"{phase} step {level}")
            combine(tensors, incoming)
        mask, level = mask << 1, level + 1


def broadcast_from_root_(comm: Comm, tensors: Sequence[torch.Tensor], root: int = 0,
                         phase: str = "broadcast") -> None:
    """Binomial broadcast of ``tensors`` from ``root`` in place."""
    n = comm.size
    v = (comm.rank - root) % n
    levels = max(1, (n - 1).bit_length())
    mask = 1
    while mask < n and not v & mask:
        mask <<= 1
    if v:                                   # receive from the parent: v with its lowest set bit cleared
        level = mask.bit_length() - 1
        sendrecv(comm, recvs=[((v - mask + root) % n, t) for t in tensors],
                 label=f"{phase} step {levels - 1 - level}")
    mask >>= 1
    while mask:
        if v + mask < n:
            level = mask.bit_length() - 1
            sendrecv(comm, sends=[((v + mask + root) % n, t) for t in tensors],
                     label=f"{phase} step {levels - 1 - level}")
        mask >>= 1


def _tree_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    combine = combine_(op)

    def fold(acc, incoming):
        combine(acc[0], incoming[0])

    reduce_to_root_(comm, [flat], fold)
    broadcast_from_root_(comm, [flat])


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """Binomial-tree reduce to rank 0 then broadcast, in place; returns ``tensor``."""
    return run_all_reduce(tensor, op, group, timeout_s, "tree", _tree_)


def tree_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast of the whole buffer.

    ``2·⌈log2 p⌉(α + nβ) + ⌈log2 p⌉nγ``: the root receives and adds one full buffer per level.
    """
    if trivial_cost(nbytes, ranks):
        return 0.0
    levels = math.ceil(math.log2(ranks))
    return 2 * levels * (alpha + nbytes * beta) + levels * nbytes * gamma


def tree_steps(nbytes: float, ranks: int) -> list[float]:
    """2·⌈log2 p⌉ steps of the whole buffer: one per level down (reduce), one per level up (broadcast)."""
    if trivial_cost(nbytes, ranks):
        return []
    return [float(nbytes)] * (2 * math.ceil(math.log2(ranks)))


def tree_link_share(ranks: int, procs_per_node: int) -> float:
    """``procs_per_node``: in the levels whose partner is on another node, every rank of a node sends across its link
    at the same time, so up to that many flows share it."""
    return float(procs_per_node) if link_shared(ranks, procs_per_node) else 1.0


ALGORITHM = Algorithm(name="tree", all_reduce=all_reduce, time=tree_time, steps=tree_steps, link_share=tree_link_share,
                      summary="binomial-tree reduce to rank 0, then binomial-tree broadcast")
