"""α-β-γ time of one all-reduce, for every algorithm in ``ddtrain.comm``.

The model (Hockney's α-β, with Thakur, Rabenseifner & Gropp's γ for reductions):

- α (``alpha_s``): seconds to start one message (latency);
- β (``beta_s_per_byte``): seconds per byte on a link (1/bandwidth);
- γ (``gamma_s_per_byte``): seconds per byte to combine two buffers locally (``a += b``);
- ``n``: message size in bytes (the whole tensor); ``p``: number of ranks.

A step in which every rank sends and receives a message of ``m`` bytes at once costs
``α + mβ``; the predicted time is the sum over the algorithm's steps on its critical path.
Every function below is a pure function of ``(nbytes, ranks, alpha, beta, gamma)`` and returns
seconds; with one rank (or zero bytes) it returns 0, as the algorithms return at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ddtrain.errors import DDTrainError, choice_error


@dataclass(frozen=True, kw_only=True)
class LinkParams:
    """Fitted (or assumed) α, β, γ of one process group."""

    alpha_s: float               # latency of one message, seconds
    beta_s_per_byte: float       # transfer time per byte, seconds (1 / bandwidth)
    gamma_s_per_byte: float = 0.0  # local reduction time per byte, seconds

    def __post_init__(self):
        for name in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def as_dict(self) -> dict:
        return {"alpha_s": self.alpha_s, "beta_s_per_byte": self.beta_s_per_byte,
                "gamma_s_per_byte": self.gamma_s_per_byte,
                "alpha_us": self.alpha_s * 1e6,
                "bandwidth_GBps": (1e-9 / self.beta_s_per_byte) if self.beta_s_per_byte else math.inf,
                "reduce_GBps": (1e-9 / self.gamma_s_per_byte) if self.gamma_s_per_byte else math.inf}


def _trivial(nbytes: float, ranks: int) -> bool:
    if ranks < 1:
        raise DDTrainError(f"the number of ranks must be >= 1, got {ranks}")
    if nbytes < 0:
        raise DDTrainError(f"the message size must be >= 0 bytes, got {nbytes}")
    return ranks == 1 or nbytes == 0


def ring_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Reduce-scatter then all-gather around the ring: 2(p−1) steps of n/p bytes.

    ``2(p−1)α + 2((p−1)/p)nβ + ((p−1)/p)nγ``: each of the p−1 reduce-scatter steps also adds
    a received chunk of n/p bytes into the local one, after it arrives (blocking ring).
    """
    if _trivial(nbytes, ranks):
        return 0.0
    p, share = ranks, (ranks - 1) / ranks * nbytes
    return 2 * (p - 1) * alpha + 2 * share * beta + share * gamma


def ring_async_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """The ring with the reduction of one sub-chunk overlapped with the transfer of the next.

    ``2(p−1)α + ((p−1)/p)n·(β + max(β, γ))``: in the reduce-scatter phase each step costs the
    slower of moving and adding its chunk instead of their sum; the all-gather is unchanged.
    (Pipelining over sub-chunks adds messages, but they are in flight together, so we charge
    one α per step; the measured small-message times say how true that is.)
    """
    if _trivial(nbytes, ranks):
        return 0.0
    p, share = ranks, (ranks - 1) / ranks * nbytes
    return 2 * (p - 1) * alpha + share * beta + share * max(beta, gamma)


def native_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """``torch.distributed.all_reduce``, assumed to be a pipelined ring (the ring-async formula).

    Gloo's CPU all-reduce is a ring over segments that reduces one segment while the next
    is in flight (gloo/allreduce.cc, ``ring``); NCCL picks ring or tree by size and topology,
    and its large-message ring has the same bandwidth term. The assumption is checked by the
    bench's error column, not trusted.
    """
    return ring_async_time(nbytes, ranks, alpha, beta, gamma)


def butterfly_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Recursive halving reduce-scatter + recursive doubling all-gather (Rabenseifner).

    For p a power of two: ``2·log2(p)·α + 2((p−1)/p)nβ + ((p−1)/p)nγ``. Otherwise the
    r = p − p' extra ranks (p' the largest power of two ≤ p) first send their whole buffer
    to a partner, which adds it in, and get the result back at the end:
    ``+ 2α + 2nβ + nγ`` on top of the formula for p'.
    """
    if _trivial(nbytes, ranks):
        return 0.0
    core = 1 << (ranks.bit_length() - 1)
    share = (core - 1) / core * nbytes
    time = 2 * math.log2(core) * alpha + 2 * share * beta + share * gamma
    if core != ranks:
        time += 2 * alpha + 2 * nbytes * beta + nbytes * gamma
    return time


def tree_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast of the whole buffer.

    ``2·⌈log2 p⌉(α + nβ) + ⌈log2 p⌉nγ``: the root receives and adds one full buffer per level.
    """
    if _trivial(nbytes, ranks):
        return 0.0
    levels = math.ceil(math.log2(ranks))
    return 2 * levels * (alpha + nbytes * beta) + levels * nbytes * gamma


def central_time(nbytes: float, ranks: int, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Everyone sends to rank 0, which adds and sends the result back to each (000 Fig 4.1).

    The root's link is the bottleneck: it receives p−1 whole buffers, one after another, adds
    each, then sends p−1 whole buffers: ``2(p−1)(α + nβ) + (p−1)nγ``.
    """
    if _trivial(nbytes, ranks):
        return 0.0
    p = ranks
    return 2 * (p - 1) * (alpha + nbytes * beta) + (p - 1) * nbytes * gamma


PREDICTORS: dict[str, Callable[..., float]] = {
    "native": native_time,
    "ring": ring_time,
    "ring-async": ring_async_time,
    "tree": tree_time,
    "butterfly": butterfly_time,
    "central": central_time,
}


def predict_time(algorithm: str, nbytes: float, ranks: int, params: LinkParams) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over ``ranks`` ranks."""
    if algorithm not in PREDICTORS:
        raise choice_error("algorithm", algorithm, PREDICTORS)
    return PREDICTORS[algorithm](nbytes, ranks, params.alpha_s, params.beta_s_per_byte,
                                 params.gamma_s_per_byte)


def bus_bandwidth_factor(ranks: int) -> float:
    """busbw / algbw = 2(p−1)/p: the fraction of the buffer each rank must send in an optimal
    all-reduce, so busbw is comparable across rank counts (nccl-tests' definition)."""
    return 2 * (ranks - 1) / ranks if ranks > 1 else 0.0
