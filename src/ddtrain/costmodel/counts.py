"""Communication counts per epoch of document 000 (section 5.2, Table 5.1).

A "communication" is one parameter value sent from one worker to another; a model has
``N`` parameters, there are ``R`` workers and ``E`` steps (mini-batches) per epoch:

- centralized (parameter server / master all-reduce, 000 Fig 4.1-4.2): ``2·E·N·(R−1)``;
- decentralized (ring all-reduce, 000 Fig 4.3-4.5): ``2·E·(N/R)·(R−1)``;
- proposed (ring all-reduce every step plus one broadcast of the parameters from rank 0
  per epoch, 000 Fig 5.1): ``2·E·(N/R)·(R−1) + N·(R−1)``.

``N/R`` need not be whole (the document prints 17.5 for N=1, R=8), so the counts are exact
``Fraction``s; ``format_count`` prints them as the document does (no trailing zeros).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ddtrain.errors import DDTrainError

METHODS = ("centralized", "decentralized", "proposed")


def centralized_count(params: int, workers: int, steps_per_epoch: int) -> Fraction:
    """Every worker sends N values to the master and gets N back, every step."""
    _check(params, workers, steps_per_epoch)
    return Fraction(2 * steps_per_epoch * params * (workers - 1))


def decentralized_count(params: int, workers: int, steps_per_epoch: int) -> Fraction:
    """Ring all-reduce: R−1 share-reduce plus R−1 share-only messages of N/R values, every step."""
    _check(params, workers, steps_per_epoch)
    return Fraction(2 * steps_per_epoch * params * (workers - 1), workers)


def proposed_count(params: int, workers: int, steps_per_epoch: int,
                   broadcasts_per_epoch: int = 1) -> Fraction:
    """The decentralized count plus ``broadcasts_per_epoch`` broadcasts of N values to R−1 workers.

    000 broadcasts once per epoch (Table 5.1); a broadcast every K steps gives ``E/K`` of them.
    """
    if broadcasts_per_epoch < 0:
        raise DDTrainError(f"broadcasts per epoch must be >= 0, got {broadcasts_per_epoch}")
    return (decentralized_count(params, workers, steps_per_epoch)
            + broadcasts_per_epoch * params * (workers - 1))


@dataclass(frozen=True)
class CountRow:
    """One row of Table 5.1: communications per epoch for the three methods."""

    params: int
    workers: int
    steps_per_epoch: int
    centralized: Fraction
    decentralized: Fraction
    proposed: Fraction

    def as_dict(self) -> dict:
        """JSON-ready: counts as numbers (floats where N/R is not whole) and exact fractions."""
        out = {"params": self.params, "workers": self.workers, "steps_per_epoch": self.steps_per_epoch}
        for name in METHODS:
            value = getattr(self, name)
            out[name] = int(value) if value.denominator == 1 else float(value)
            out[name + "_exact"] = str(value)
        return out


def count_table(params: list[int], workers: list[int], steps_per_epoch: int,
                broadcasts_per_epoch: int = 1) -> list[CountRow]:
    """Table 5.1 for any grid, in the document's order (N outer, R inner)."""
    return [CountRow(n, r, steps_per_epoch,
                     centralized_count(n, r, steps_per_epoch),
                     decentralized_count(n, r, steps_per_epoch),
                     proposed_count(n, r, steps_per_epoch, broadcasts_per_epoch))
            for n in params for r in workers]


def format_count(value: Fraction, max_decimals: int = 6) -> str:
    """Exact decimal when it terminates within ``max_decimals`` digits (17.5, 19.96), else rounded."""
    if value.denominator == 1:
        return str(value.numerator)
    for decimals in range(1, max_decimals + 1):
        scaled = value * 10 ** decimals
        if scaled.denominator == 1:
            return _decimal(scaled.numerator, decimals)
    return _decimal(round(value * 10 ** max_decimals), max_decimals)


def _decimal(scaled: int, decimals: int) -> str:
    """``scaled / 10**decimals`` written out exactly (no float rounding for large counts)."""
    sign, digits = ("-" if scaled < 0 else ""), str(abs(scaled)).rjust(decimals + 1, "0")
    return f"{sign}{digits[:-decimals]}.{digits[-decimals:]}"


def _check(params: int, workers: int, steps_per_epoch: int) -> None:
    if params < 0:
        raise DDTrainError(f"the number of parameters N must be >= 0, got {params}")
    if workers < 1:
        raise DDTrainError(f"the number of workers R must be >= 1, got {workers}")
    if steps_per_epoch < 0:
        raise DDTrainError(f"steps per epoch E must be >= 0, got {steps_per_epoch}")
