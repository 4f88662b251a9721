"""Collective communication written once over point-to-point, so the algorithms can be compared.

``all_reduce(tensor, algorithm="native", op="sum", group=None)`` reduces in place and returns
the tensor; ``ALGORITHMS`` names the algorithms (one module each, each a function
``(tensor, op="sum", group=None, *, timeout_s=None) -> tensor``). Every algorithm leaves
bitwise-identical results on every rank, works for any length, dtype (see ``ops``), world
size and process group, on Gloo (CPU) and NCCL (CUDA), and counts its traffic in
``traffic``. The MPI-style primitives of document 000 ch. 2 are in ``primitives``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ddtrain.errors import choice_error
from ddtrain.comm import traffic
from ddtrain.comm.ops import ALL_REDUCE_OPS, REDUCE_OPS, SUPPORTED_DTYPES
from ddtrain.comm.p2p import CommError

from ddtrain.comm import butterfly, central, native, ring, ring_async, tree  # noqa: E402  (after the helpers)
from ddtrain.comm.primitives import allgather, alltoall, bcast, gather, recv, reduce, scatter, send  # noqa: E402

ALGORITHMS: dict[str, Callable[..., torch.Tensor]] = {
    "native": native.all_reduce,
    "ring": ring.all_reduce,
    "ring-async": ring_async.all_reduce,
    "tree": tree.all_reduce,
    "butterfly": butterfly.all_reduce,
    "central": central.all_reduce,
}

OPS = ALL_REDUCE_OPS


def all_reduce(tensor: torch.Tensor, algorithm: str = "native", op: str = "sum", group=None, *,
               timeout_s: float | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place with ``algorithm`` and ``op``; return it.

    op: sum, avg, max, min or prod. Every rank must pass a tensor of the same shape and
    dtype. ``timeout_s`` bounds the whole call (default: ddtrain.init()'s timeout).
    """
    fn = ALGORITHMS.get(algorithm)
    if fn is None:
        raise choice_error("all-reduce algorithm", algorithm, ALGORITHMS)
    return fn(tensor, op, group, timeout_s=timeout_s)


__all__ = ["ALGORITHMS", "OPS", "REDUCE_OPS", "SUPPORTED_DTYPES", "CommError", "all_reduce", "traffic",
           "send", "recv", "bcast", "scatter", "gather", "allgather", "reduce", "alltoall"]
