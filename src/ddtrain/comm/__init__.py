"""Collective communication written once over point-to-point, so the algorithms can be compared.

``all_reduce(tensor, algorithm="native", op="sum", group=None)`` reduces in place and returns
the tensor; ``ALGORITHMS`` holds one ``Algorithm`` record per algorithm (its module's function
``(tensor, op="sum", group=None, *, timeout_s=None) -> tensor`` and cost formula), and
``register_algorithm`` adds one. Every algorithm leaves bitwise-identical results on every
rank, works for any length, dtype (see ``ops``), world size and process group, on Gloo (CPU)
and NCCL (CUDA), and counts its traffic in ``traffic``. The MPI-style primitives of document
000 ch. 2 are in ``primitives``.
"""
from __future__ import annotations

import torch

from ddtrain.errors import choice_error
from ddtrain.comm import traffic
from ddtrain.comm.algorithm import Algorithm
from ddtrain.comm.ops import ALL_REDUCE_OPS, REDUCE_OPS, SUPPORTED_DTYPES
from ddtrain.comm.p2p import CommError

from ddtrain.comm import butterfly, central, native, ring, ring_async, tree
from ddtrain.comm.primitives import allgather, alltoall, bcast, gather, recv, reduce, scatter, send

ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to ``ALGORITHMS`` (a new algorithm from outside the package needs only this call)."""
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


for _module in (native, ring, ring_async, tree, butterfly, central):
    register_algorithm(_module.ALGORITHM)

OPS = ALL_REDUCE_OPS


def all_reduce(tensor: torch.Tensor, algorithm: str = "native", op: str = "sum", group=None, *,
               timeout_s: float | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place with ``algorithm`` and ``op``; return it.

    op: sum, avg, max, min or prod. Every rank must pass a tensor of the same shape and
    dtype. ``timeout_s`` bounds the whole call (default: ddtrain.init()'s timeout).
    """
    record = ALGORITHMS.get(algorithm)
    if record is None:
        raise choice_error("all-reduce algorithm", algorithm, ALGORITHMS)
    return record.all_reduce(tensor, op, group, timeout_s=timeout_s)


__all__ = ["ALGORITHMS", "Algorithm", "OPS", "REDUCE_OPS", "SUPPORTED_DTYPES", "CommError", "all_reduce",
           "register_algorithm", "traffic", "send", "recv", "bcast", "scatter", "gather", "allgather", "reduce",
           "alltoall"]
