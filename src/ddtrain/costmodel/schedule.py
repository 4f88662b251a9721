"""The messages each all-reduce algorithm sends, step by step, on its critical path (what the burst and load terms need).

``Algorithm.time`` (``ddtrain.comm``) sums ``α + mβ`` over these steps; this module lists the
``m`` of each step instead, so that a term that depends on the order of the messages (the token
bucket of an emulated link, ``burst``) or on their number (α under load, ``loaded``) can be
applied to any algorithm. For every algorithm, ``sum(α + mβ for m in steps)`` equals its cost
formula with γ = 0 (tests/costmodel/test_advise_terms.py checks it against ``ddtrain.comm``).
"""
from __future__ import annotations

import math

from ddtrain.errors import DDTrainError

# how each algorithm moves the buffer: "ring" = reduce-scatter + all-gather in 2(p-1) steps of
# n/p (our ring, the pipelined ring, and Gloo's own all-reduce, which ddtrain models as a ring);
# the others as their modules in ddtrain.comm describe them
RING_LIKE = ("ring", "ring-async", "native")
SCHEDULES = RING_LIKE + ("tree", "butterfly", "central")


def steps(algorithm: str, nbytes: float, ranks: int) -> list[float]:
    """Bytes of each step on the critical path of one all-reduce of ``nbytes`` over ``ranks`` ranks."""
    _check(algorithm, nbytes, ranks)
    if ranks == 1 or nbytes == 0:
        return []
    p = ranks
    if algorithm in RING_LIKE:
        return [nbytes / p] * (2 * (p - 1))
    if algorithm == "tree":
        return [float(nbytes)] * (2 * math.ceil(math.log2(p)))
    if algorithm == "central":
        return [float(nbytes)] * (2 * (p - 1))
    # butterfly: recursive halving then doubling over the largest power of two p' <= p; the
    # p - p' extra ranks first hand their whole buffer to a partner and get the result back
    core = 1 << (p.bit_length() - 1)
    halving = [nbytes / (1 << (i + 1)) for i in range(int(math.log2(core)))]
    extra = [float(nbytes)] if core != p else []
    return extra + halving + halving[::-1] + extra


def _check(algorithm: str, nbytes: float, ranks: int) -> None:
    if algorithm not in SCHEDULES:
        raise DDTrainError(f"no message schedule for algorithm {algorithm!r}; known: {', '.join(SCHEDULES)}")
    if ranks < 1:
        raise DDTrainError(f"the number of ranks must be >= 1, got {ranks}")
    if nbytes < 0:
        raise DDTrainError(f"the message size must be >= 0 bytes, got {nbytes}")
