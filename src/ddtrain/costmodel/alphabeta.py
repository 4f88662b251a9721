"""α-β-γ time of one all-reduce: ``LinkParams`` (α latency, β seconds per byte on a link, γ seconds per byte to
combine) and ``predict_time``.

Each algorithm's formula lives in its own module of ``ddtrain.comm`` (``Algorithm.time``;
``ddtrain.comm.algorithm`` defines the model), and ``PREDICTORS`` reads them from
``ddtrain.comm.ALGORITHMS``; every formula returns 0 for one rank or zero bytes, as the
algorithms return at once.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from collections.abc import Callable

from ddtrain import comm
from ddtrain.comm.butterfly import butterfly_time
from ddtrain.comm.central import central_time
from ddtrain.comm.native import native_time
from ddtrain.comm.ring import ring_time
from ddtrain.comm.ring_async import ring_async_time
from ddtrain.comm.tree import tree_time
from ddtrain.errors import choice_error

# the formulas, importable from here as before (tests and docs name them ddtrain.costmodel.ring_time, ...)
__all__ = ["PREDICTORS", "LinkParams", "Predictors", "bus_bandwidth_factor", "butterfly_time", "central_time",
           "native_time", "predict_time", "ring_async_time", "ring_time", "tree_time"]


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


class Predictors(Mapping):
    """``{algorithm name: its cost formula}``, read live from ``ddtrain.comm.ALGORITHMS`` (so registered algorithms appear)."""

    def __getitem__(self, name: str) -> Callable[..., float]:
        record = comm.ALGORITHMS.get(name)
        if record is None or record.time is None:
            raise KeyError(name)
        return record.time

    def __iter__(self):
        return (name for name, record in comm.ALGORITHMS.items() if record.time is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


PREDICTORS: Mapping[str, Callable[..., float]] = Predictors()


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
