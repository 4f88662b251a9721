"""``ring``: reduce-scatter then all-gather around a ring (000's share-reduce / share-only phases).

The buffer is cut into n chunks (the first ``N mod n`` one element longer). In reduce-scatter
step s (s = 0..n-2) rank r sends chunk ``r-s`` to its right neighbour and receives chunk
``r-s-1`` from its left, which it reduces into its own copy. After n-1 steps rank r holds chunk
``r+1`` fully reduced -- and it is the only rank that computed it. The all-gather then copies
each finished chunk around the ring in n-1 more steps, so every rank ends with the *same bits*
(001's complaint that a ring "brackets the sum differently on each rank" applies only to rings
that reduce on every rank; this one reduces each element exactly once).

Determinism: chunk c is accumulated in the fixed order x_c, x_{c+1}, ..., x_{c-1} (ranks mod
n), whatever the timing, so the same inputs always give the same bits.

Traffic per rank: each rank sends every chunk except chunk ``r+1`` during reduce-scatter and
every chunk except chunk ``r+2`` during all-gather: ``2N - |chunk r+1| - |chunk r+2|``
elements, i.e. 2(n-1)/n·N when n divides N; 2(n-1) messages (empty chunks are not sent).
Each step is one blocking exchange; ``ring-async`` pipelines them.
"""
from __future__ import annotations

import torch

from ddtrain.comm.algorithm import Algorithm, link_shared, trivial_cost
from ddtrain.comm.ops import combine_, run_all_reduce
from ddtrain.comm.p2p import Comm, sendrecv


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` near-equal chunks of ``numel`` elements (first ``numel % parts`` longer)."""
    base, extra = divmod(numel, parts)
    return [i * base + min(i, extra) for i in range(parts + 1)]


def reduce_scatter_(flat: torch.Tensor, op: str, comm: Comm, bounds: list[int]) -> None:
    """Ring reduce-scatter in place: afterwards chunk ``(rank + 1) % n`` of ``flat`` is fully reduced."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    combine = combine_(op)
    tmp = torch.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), dtype=flat.dtype, device=flat.device)
    for s in range(n - 1):
        send_c, recv_c = (r - s) % n, (r - s - 1) % n
        lo, hi = bounds[recv_c], bounds[recv_c + 1]
        incoming = tmp[: hi - lo]
        sendrecv(comm, sends=[(right, flat[bounds[send_c]:bounds[send_c + 1]])],
                 recvs=[(left, incoming)], label=f"reduce-scatter step {s}")
        combine(flat[lo:hi], incoming)


def all_gather_(flat: torch.Tensor, comm: Comm, bounds: list[int], first: int = 1,
                phase: str = "all-gather") -> None:
    """Ring all-gather in place: rank r starts owning chunk ``(r + first) % n``; then every rank has all."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_c, recv_c = (r + first - s) % n, (r + first - s - 1) % n
        sendrecv(comm, sends=[(right, flat[bounds[send_c]:bounds[send_c + 1]])],
                 recvs=[(left, flat[bounds[recv_c]:bounds[recv_c + 1]])], label=f"{phase} step {s}")


def _ring_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    bounds = chunk_bounds(flat.numel(), comm.size)
    reduce_scatter_(flat, op, comm, bounds)
    all_gather_(flat, comm, bounds, first=1)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """Ring all-reduce of ``tensor`` in place (every rank ends bitwise identical); returns it."""
    return run_all_reduce(tensor, op, group, timeout_s, "ring", _ring_)


def ring_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce-scatter then all-gather around the ring: 2(p−1) steps of n/p bytes.

    ``2(p−1)α + 2((p−1)/p)nβ + ((p−1)/p)nγ``: each of the p−1 reduce-scatter steps also adds
    a received chunk of n/p bytes into the local one, after it arrives (blocking ring).
    """
    if trivial_cost(nbytes, ranks):
        return 0.0
    p, share = ranks, (ranks - 1) / ranks * nbytes
    return 2 * (p - 1) * alpha + 2 * share * beta + share * gamma


def ring_steps(nbytes: float, ranks: int) -> list[float]:
    """Reduce-scatter then all-gather: 2(p−1) steps of n/p bytes (also the pipelined ring's and Gloo's own)."""
    if trivial_cost(nbytes, ranks):
        return []
    return [nbytes / ranks] * (2 * (ranks - 1))


def ring_link_share(ranks: int, procs_per_node: int) -> float:
    """1: consecutive ranks sit on the same node, so in each step only one hop per node crosses its link.

    The link carries what it would with one rank per node, however many ranks share the node
    (ours, the pipelined ring and Gloo's ring alike).
    """
    link_shared(ranks, procs_per_node)
    return 1.0


ALGORITHM = Algorithm(name="ring", all_reduce=all_reduce, time=ring_time, steps=ring_steps,
                      link_share=ring_link_share, summary="reduce-scatter then all-gather around a ring")
