"""``butterfly``: Rabenseifner's all-reduce -- recursive-halving reduce-scatter, recursive-doubling all-gather.

With p = 2^k ranks: at step i (mask = p/2, p/4, ..., 1) each rank pairs with ``rank ^ mask``;
the pair splits its current range in two halves, each keeps one half (the lower half to the
rank whose bit is clear), sends the other and reduces what it receives into the half it kept.
After log2 p steps each rank owns 1/p of the buffer, fully reduced; the all-gather retraces
the steps in reverse, exchanging owned ranges, until every rank has everything. Each rank
sends N/2 + N/4 + ... = (p-1)/p·N per phase: the ring's volume in log2 p steps instead of
p-1 (001: near-optimal for small messages too).

World sizes that are not a power of two use the standard fold-in (Rabenseifner; MPICH):
with p' the largest power of two <= n and r = n - p', each of the first r even ranks sends
its whole buffer to the odd rank above it, which reduces it and joins the butterfly, while
the even rank waits; at the end the odd rank sends the result back. Those 2r ranks move one
extra N each way.

Determinism: every element's final value is computed by exactly one rank in a reduction tree
fixed by rank numbers; the all-gather and the unfold only copy, so all ranks get the same
bits, and the same inputs always give the same bits.
"""
from __future__ import annotations

import math

import torch

from ddtrain.comm.algorithm import Algorithm, link_shared, trivial_cost
from ddtrain.comm.ops import combine_, run_all_reduce
from ddtrain.comm.p2p import Comm, sendrecv


def _butterfly_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    n, r = comm.size, comm.rank
    combine = combine_(op)
    p2 = 1 << (n.bit_length() - 1)          # largest power of two <= n
    extra = n - p2
    # Fold-in: ranks 0..2*extra-1 pair up (even -> odd); the odd one carries both into the butterfly.
    if r < 2 * extra:
        if r % 2 == 0:
            sendrecv(comm, sends=[(r + 1, flat)], label="fold-in")
            sendrecv(comm, recvs=[(r + 1, flat)], label="unfold")
            return
        incoming = torch.empty_like(flat)
        sendrecv(comm, recvs=[(r - 1, incoming)], label="fold-in")
        combine(flat, incoming)
        del incoming
        vrank = r // 2
    else:
        vrank = r - extra

    def real(v: int) -> int:                # butterfly rank -> group rank
        return 2 * v + 1 if v < extra else v + extra

    # Recursive halving: reduce-scatter.
    lo, hi = 0, flat.numel()
    ranges = []                             # (lo, hi) before each halving, to retrace
    tmp = torch.empty((hi - lo + 1) // 2, dtype=flat.dtype, device=flat.device)
    mask, step = p2 >> 1, 0
    while mask:
        peer = real(vrank ^ mask)
        mid = lo + (hi - lo) // 2
        ranges.append((lo, hi))
        if vrank & mask:
            keep, give = (mid, hi), (lo, mid)
        else:
            keep, give = (lo, mid), (mid, hi)
        incoming = tmp[: keep[1] - keep[0]]
        sendrecv(comm, sends=[(peer, flat[give[0]:give[1]])], recvs=[(peer, incoming)],
                 label=f"reduce-scatter step {step}")
        combine(flat[keep[0]:keep[1]], incoming)
        lo, hi = keep
        mask, step = mask >> 1, step + 1
    # Recursive doubling: all-gather, retracing the halvings.
    mask, step = 1, 0
    while mask < p2:
        peer = real(vrank ^ mask)
        plo, phi = ranges.pop()
        other = (hi, phi) if lo == plo else (plo, lo)   # the half of the parent range we gave away
        sendrecv(comm, sends=[(peer, flat[lo:hi])], recvs=[(peer, flat[other[0]:other[1]])],
                 label=f"all-gather step {step}")
        lo, hi = plo, phi
        mask, step = mask << 1, step + 1
    if r < 2 * extra:                       # unfold: hand the result to the folded-in even rank
        sendrecv(comm, sends=[(r - 1, flat)], label="unfold")


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """Rabenseifner butterfly all-reduce in place (any world size); returns ``tensor``."""
    return run_all_reduce(tensor, op, group, timeout_s, "butterfly", _butterfly_)


def butterfly_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Recursive halving reduce-scatter + recursive doubling all-gather (Rabenseifner).

    For p a power of two: ``2·log2(p)·α + 2((p−1)/p)nβ + ((p−1)/p)nγ``. Otherwise the
    r = p − p' extra ranks (p' the largest power of two ≤ p) first send their whole buffer
    to a partner, which adds it in, and get the result back at the end:
    ``+ 2α + 2nβ + nγ`` on top of the formula for p'.
    """
    if trivial_cost(nbytes, ranks):
        return 0.0
    core = 1 << (ranks.bit_length() - 1)
    share = (core - 1) / core * nbytes
    time = 2 * math.log2(core) * alpha + 2 * share * beta + share * gamma
    if core != ranks:
        time += 2 * alpha + 2 * nbytes * beta + nbytes * gamma
    return time


def butterfly_steps(nbytes: float, ranks: int) -> list[float]:
    """Recursive halving then doubling over the largest power of two p' ≤ p: n/2, n/4, ..., n/p', then back up.

    The p − p' extra ranks first hand their whole buffer to a partner and get the result back at
    the end: one step of n before and one after.
    """
    if trivial_cost(nbytes, ranks):
        return []
    core = 1 << (ranks.bit_length() - 1)
    halving = [nbytes / (1 << (i + 1)) for i in range(int(math.log2(core)))]
    extra = [float(nbytes)] if core != ranks else []
    return extra + halving + halving[::-1] + extra


def butterfly_link_share(ranks: int, procs_per_node: int) -> float:
    """``procs_per_node``: in the steps whose partner is on another node, every rank of a node sends across its link
    at the same time, so up to that many flows share it."""
    return float(procs_per_node) if link_shared(ranks, procs_per_node) else 1.0


ALGORITHM = Algorithm(name="butterfly", all_reduce=all_reduce, time=butterfly_time, steps=butterfly_steps,
                      link_share=butterfly_link_share,
                      summary="recursive-halving reduce-scatter, recursive-doubling all-gather (Rabenseifner)")
