"""``ring-async``: the ring with non-blocking sends pipelined over sub-chunks (001's asynchronous ring).

Same chunks, same steps, same reduction order as ``ring`` -- so the same bits -- but each
chunk is cut into up to ``MAX_SEGMENTS`` segments of about ``SEGMENT_BYTES``, and the 2(n-1)
steps x segments become one stream of transfers. Segment j of step s depends only on
segment j of step s-1 (the data it forwards was reduced or received there), so while this
rank waits for and reduces segment j, the transfers of the following segments -- of this step
and the next -- are already in flight. The receive of one segment, its reduction and the
send of the next thus overlap; on GPUs the reduction kernels run on the compute stream while
NCCL moves the next segments.

Every transfer is still a matched send/receive pair posted together (``batch_isend_irecv``),
so NCCL cannot deadlock even with two ranks, where left and right are the same peer; with at
most one segment in flight per segment slot, landing buffers are reused safely.

Traffic: exactly ``ring``'s bytes; messages are ``ring``'s times the number of non-empty
segments (a segment is one message).
"""
from __future__ import annotations

import torch

from ddtrain.comm.algorithm import Algorithm, trivial_cost
from ddtrain.comm.ops import combine_, run_all_reduce
from ddtrain.comm.p2p import Comm, exchange, wait
from ddtrain.comm.ring import chunk_bounds, ring_link_share, ring_steps

SEGMENT_BYTES = 256 * 1024     # aim for segments of this size ...
MAX_SEGMENTS = 8               # ... but no more than this many per chunk (per-message latency)


def segment_count(chunk_bytes: int) -> int:
    """How many segments a chunk of ``chunk_bytes`` is pipelined in."""
    return max(1, min(MAX_SEGMENTS, -(-chunk_bytes // SEGMENT_BYTES)))


def _ring_async_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    bounds = chunk_bounds(flat.numel(), n)
    biggest = max(bounds[i + 1] - bounds[i] for i in range(n))
    segments = segment_count(biggest * flat.element_size())
    seg_len = -(-biggest // segments)
    landing = torch.empty((segments, seg_len), dtype=flat.dtype, device=flat.device)  # one slot per segment
    combine = combine_(op)
    reduce_steps, total_steps = n - 1, 2 * (n - 1)

    def segment(chunk: int, j: int) -> tuple[int, int]:
        lo, hi = bounds[chunk % n], bounds[chunk % n + 1]
        return lo + (hi - lo) * j // segments, lo + (hi - lo) * (j + 1) // segments

    def plan(k: int):
        """(step, segment, (send lo, hi), (recv lo, hi)) of transfer number k."""
        s, j = divmod(k, segments)
        if s < reduce_steps:   # reduce-scatter: forward chunk r-s, receive chunk r-s-1 (to reduce)
            return s, j, segment(r - s, j), segment(r - s - 1, j)
        t = s - reduce_steps   # all-gather: forward chunk r+1-t, receive chunk r-t (final)
        return s, j, segment(r + 1 - t, j), segment(r - t, j)

    def post(k: int):
        s, j, (slo, shi), (rlo, rhi) = plan(k)
        into = landing[j, : rhi - rlo] if s < reduce_steps else flat[rlo:rhi]
        phase = "reduce-scatter" if s < reduce_steps else "all-gather"
        step = s if s < reduce_steps else s - reduce_steps
        return exchange(comm, sends=[(right, flat[slo:shi])], recvs=[(left, into)],
                        label=f"{phase} step {step} segment {j}")

    count = total_steps * segments
    in_flight, posted = {}, 0
    for k in range(count):
        # Transfer m forwards what transfer m - segments produced; all of those up to k-1 are
        # done, so everything before k + segments may go now.
        while posted < min(count, k + segments):
            in_flight[posted] = post(posted)
            posted += 1
        wait(comm, in_flight.pop(k))
        s, j, _, (rlo, rhi) = plan(k)
        if s < reduce_steps:
            combine(flat[rlo:rhi], landing[j, : rhi - rlo])


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """Pipelined non-blocking ring all-reduce in place (same bits as ``ring``); returns ``tensor``."""
    return run_all_reduce(tensor, op, group, timeout_s, "ring-async", _ring_async_)


def ring_async_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """The ring with the reduction of one sub-chunk overlapped with the transfer of the next.

    ``2(p−1)α + ((p−1)/p)n·(β + max(β, γ))``: in the reduce-scatter phase each step costs the
    slower of moving and adding its chunk instead of their sum; the all-gather is unchanged.
    (Pipelining over sub-chunks adds messages, but they are in flight together, so we charge
    one α per step; the measured small-message times say how true that is.)
    """
    if trivial_cost(nbytes, ranks):
        return 0.0
    p, share = ranks, (ranks - 1) / ranks * nbytes
    return 2 * (p - 1) * alpha + share * beta + share * max(beta, gamma)


# the messages and the link are the ring's: the same 2(p−1) steps of n/p, pipelined (one α per step, as above)
ALGORITHM = Algorithm(name="ring-async", all_reduce=all_reduce, time=ring_async_time, steps=ring_steps,
                      link_share=ring_link_share,
                      summary="the ring with non-blocking sends pipelined over sub-chunks")
