"""Unequal shares of one global batch: the share arithmetic of ``--balance speed``. Pure, no communication.

With a global batch of G samples per step, ``--balance speed`` gives rank r a share n_r of it
(integers, n_r >= grad_accum so every micro-batch has a sample, sum n_r = G) proportional to its
measured speed. Which samples a step trains does not change: step s of an epoch trains
``order[s*G:(s+1)*G]`` of the epoch's permutation as before, rank r taking the contiguous run
starting at n_0 + ... + n_{r-1} (``rank_span``) instead of every R-th sample, split into
``grad_accum`` micro-batches as equal as possible (``micro_sizes``). The loop weights each
micro-batch's mean loss by its samples times R / G, so the workers' averaged gradient is the
mean over the global batch, as with equal shares (``ddtrain.training.balance``).

The shares of a step must be the same on every rank and known before the loader draws that
step's batches: a ``ShareSchedule`` holds the agreed changes, each in force from a given step on,
and refuses a change for a step the loader has already drawn.
"""
from __future__ import annotations

import math
import threading

from ddtrain.errors import DDTrainError


def uniform_shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers differing by at most one (the first ones larger)."""
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def micro_sizes(share: int, grad_accum: int) -> list[int]:
    """A rank's share of a step cut into ``grad_accum`` micro-batches as equal as possible."""
    return uniform_shares(share, grad_accum)


def rank_span(shares: list[int], rank: int) -> tuple[int, int]:
    """(first position, count) of rank ``rank``'s contiguous run of the global batch."""
    return sum(shares[:rank]), shares[rank]


def predicted_step_s(shares: list[int], per_sample_s: list[float]) -> float:
    """The slowest rank's compute time for a step: what a synchronous step waits for."""
    return max(n * p for n, p in zip(shares, per_sample_s))


def proportional_shares(speeds: list[float], total: int, *, minimum: int = 1, previous: list[int] | None = None,
                        max_change: int | None = None) -> list[int]:
    """Integer shares of ``total``, proportional to ``speeds`` (samples/s) as far as the bounds allow.

    Every share is at least ``minimum``; with ``previous`` and ``max_change`` no share moves by more
    than ``max_change`` from its previous value. The real-valued target total * speed / sum(speed)
    is shifted by one common amount and clamped to the bounds so that it sums to ``total`` (water
    filling), then rounded by largest remainder (ties to the lower rank). A pure function of its
    arguments: ranks that give it the same all-gathered speeds get the same shares.
    """
    parts = len(speeds)
    if parts < 1 or minimum < 0 or total < minimum * parts:
        raise DDTrainError(f"{total} samples cannot give {parts} ranks at least {minimum} each")
    if previous is not None and (len(previous) != parts or sum(previous) != total):
        raise DDTrainError(f"previous shares {previous} are not {parts} shares of {total}")
    if not all(math.isfinite(s) and s > 0 for s in speeds):   # a rank with no measurement: keep what there is
        return list(previous) if previous is not None else uniform_shares(total, parts)
    ceiling = total - minimum * (parts - 1)
    low, high = [minimum] * parts, [ceiling] * parts
    if previous is not None and max_change is not None:
        low = [max(minimum, n - max_change) for n in previous]
        high = [min(ceiling, n + max_change) for n in previous]
    whole = sum(speeds)
    target = [total * s / whole for s in speeds]

    def filled(shift: float) -> list[float]:
        return [min(max(t + shift, lo), hi) for t, lo, hi in zip(target, low, high)]

    below, above = -float(total), float(total)   # sum(filled(below)) <= total <= sum(filled(above))
    for _ in range(200):
        middle = (below + above) / 2
        if sum(filled(middle)) < total:
            below = middle
        else:
            above = middle
    values = filled(above)
    shares = [min(max(math.floor(v), lo), hi) for v, lo, hi in zip(values, low, high)]
    by_remainder = sorted(range(parts), key=lambda r: (-(values[r] - math.floor(values[r])), r))
    while sum(shares) < total:   # the largest remainders get the samples left
        r = next(r for r in by_remainder if shares[r] < high[r])
        shares[r] += 1
        by_remainder.remove(r)
        by_remainder.append(r)
    while sum(shares) > total:   # float rounding only: take back from the smallest remainders
        r = next(r for r in reversed(by_remainder) if shares[r] > low[r])
        shares[r] -= 1
        by_remainder.remove(r)
        by_remainder.insert(0, r)
    return shares


class ShareSchedule:
    """The shares in force at each step: the initial ones, then each agreed change from its first step on.

    The loader asks ``shares_for(step)`` (possibly from a prefetch thread, ahead of the loop); a
    change for a step already drawn would give ranks different samples, so ``change`` refuses it.
    """

    def __init__(self, initial: list[int]):
        self._changes: list[tuple[int, tuple[int, ...]]] = [(0, tuple(initial))]
        self._lock = threading.Lock()
        self.drawn = -1   # the highest step the loader has asked for

    def shares_for(self, step: int) -> list[int]:
        with self._lock:
            self.drawn = max(self.drawn, step)
            return list(next(shares for first, shares in reversed(self._changes) if first <= step))

    def current(self) -> list[int]:
        with self._lock:
            return list(self._changes[-1][1])

    def change(self, first_step: int, shares: list[int]) -> None:
        with self._lock:
            if first_step <= self.drawn:
                raise DDTrainError(f"balance: the loader already drew step {self.drawn}, so shares agreed for step "
                                   f"{first_step} on would give ranks different samples (a bug: please report it)")
            if first_step < self._changes[-1][0]:
                raise DDTrainError(f"balance: shares for step {first_step} come after those for step "
                                   f"{self._changes[-1][0]}")
            self._changes.append((first_step, tuple(shares)))
