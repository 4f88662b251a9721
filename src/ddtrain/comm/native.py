"""``native``: the backend's own all-reduce (NCCL's on GPUs, Gloo's on CPUs) -- the default for speed.

Its traffic cannot be observed from Python, so it is recorded by formula (method "formula"):
what a bandwidth-optimal ring moves, ``2(n-1)/n`` of the buffer sent and as much received per
rank in ``2(n-1)`` messages. Gloo's default all-reduce is such a ring; NCCL's ring and tree
move the same volume per rank. Gloo and NCCL have no 16-bit integer reduction, so int16 is
reduced in int32 and narrowed back (sum and product modulo 2**16 agree either way).
"""
from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from ddtrain.comm import traffic
from ddtrain.comm.algorithm import Algorithm
from ddtrain.comm.ops import run_all_reduce
from ddtrain.comm.p2p import Comm, CommError
from ddtrain.comm.ring import ring_link_share, ring_steps
from ddtrain.comm.ring_async import ring_async_time

REDUCE_OP = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT,
             "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def formula_bytes(numel: int, element_size: int, size: int) -> int:
    """Bytes a ring all-reduce sends (and receives) per rank: 2(n-1)/n of the buffer, in whole elements."""
    return 2 * ((size - 1) * numel // size) * element_size


def _native_(flat: torch.Tensor, op: str, comm: Comm) -> None:
    buf = flat.to(torch.int32) if flat.dtype == torch.int16 else flat
    work = dist.all_reduce(buf, op=REDUCE_OP[op], group=comm.group, async_op=True)
    try:
        if comm.blocking_waits:
            remaining = max(comm.deadline - time.monotonic(), 0.001)
            ok = work.wait(timeout=datetime.timedelta(seconds=remaining))
            if ok is False:
                raise RuntimeError("timed out")
        else:
            work.wait()
    except Exception as exc:
        raise CommError(f"native all-reduce over {comm.size} ranks failed or passed its "
                        f"{comm.timeout_s:g}s deadline: {exc}") from exc
    if buf is not flat:
        flat.copy_(buf)
    nbytes = formula_bytes(flat.numel(), flat.element_size(), comm.size)
    traffic.record("native", bytes_sent=nbytes, bytes_received=nbytes, messages_sent=2 * (comm.size - 1),
                   messages_received=2 * (comm.size - 1), method=traffic.FORMULA)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None, *, timeout_s: float | None = None):
    """``torch.distributed.all_reduce`` with ddtrain's ops, checks, deadline and traffic record."""
    return run_all_reduce(tensor, op, group, timeout_s, "native", _native_)


def native_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """``torch.distributed.all_reduce``, assumed to be a pipelined ring (the ring-async formula).

    Gloo's CPU all-reduce is a ring over segments that reduces one segment while the next
    is in flight (gloo/allreduce.cc, ``ring``); NCCL picks ring or tree by size and topology,
    and its large-message ring has the same bandwidth term. The assumption is checked by the
    bench's error column, not trusted.
    """
    return ring_async_time(nbytes, ranks, alpha, beta, gamma)


# modelled as a ring (above): its messages and its use of a shared link are the ring's
ALGORITHM = Algorithm(name="native", all_reduce=all_reduce, time=native_time, steps=ring_steps,
                      link_share=ring_link_share,
                      summary="the backend's own all-reduce (NCCL's on GPUs, Gloo's on CPUs)")
