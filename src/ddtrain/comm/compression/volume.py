"""How many bytes a collective sends per rank, for the compression methods' ``wire_bytes`` formulas.

Every all-reduce algorithm of ``ddtrain.comm`` sends ``2(R-1)·N`` bytes in all for a buffer of
``N`` bytes over ``R`` ranks -- ring and ring-async (each of the 2(R-1) steps moves every chunk
once), tree (each non-root rank sends its partial once and receives the result once), central
(R-1 buffers in, R-1 out), butterfly (2(p-1)/p·N on each of p ranks plus 2N per folded pair)
and native (recorded by the ring's formula) -- so the mean per rank is ``2(R-1)/R·N`` whatever
the algorithm (central's rank 0 sends (R-1)·N of it). The ring all-gather of ``N`` bytes per
rank sends ``(R-1)·N`` from every rank.
"""
from __future__ import annotations

from math import prod
from collections.abc import Sequence


def allreduce_bytes(nbytes: float, world: int) -> float:
    """Mean bytes one rank sends in an all-reduce of ``nbytes`` over ``world`` ranks (every ddtrain.comm algorithm)."""
    return 2 * (world - 1) / world * nbytes


def allgather_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank sends in the ring all-gather of its own ``nbytes`` (``comm.allgather``)."""
    return (world - 1) * nbytes


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar)."""
    return prod(shape)
