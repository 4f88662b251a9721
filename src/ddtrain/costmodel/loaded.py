"""α under load: the per-message cost a collective really pays inside training steps, fitted from them.

The calibration (``calibration.py``) times chains of back-to-back exchanges between otherwise
idle ranks and finds α of 60-300 µs; a collective inside a training step waits until every rank
has been scheduled on shared cores, and pays milliseconds per step (docs/REPRODUCING.md). This
module fits that α from measurements of whole collectives: each ``CommSample`` is the seconds
the all-reduces of one step (DDP's buckets) took inside training (the recorded communication
wait, or the step time of a run that syncs minus that of the same run without syncing), and
``fit_loaded`` solves

    seconds = α_load · (steps on the critical path) + (link time of the messages)

by least squares over the samples, with the link time from the token bucket (``burst``) when the
bucket is known, and from a fitted β otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ddtrain.costmodel import schedule
from ddtrain.costmodel.burst import TokenBucket, transfer, transfer_time
from ddtrain.errors import DDTrainError


@dataclass(frozen=True, kw_only=True)
class CommSample:
    """One step's measured all-reduces inside training: ``seconds`` for all-reduces of ``sizes`` bytes, one after another."""

    algorithm: str
    sizes: tuple[float, ...]   # bytes of each all-reduce of the step (DDP's buckets), in order
    ranks: int
    seconds: float
    idle_s: float = 0.0        # the pause before the first (the compute step): refills the token bucket

    def messages(self) -> list[list[float]]:
        return [schedule.steps(self.algorithm, n, self.ranks) for n in self.sizes]


@dataclass(frozen=True, kw_only=True)
class LoadedFit:
    """α under load (and β when it was fitted), with how well the line fits the samples."""

    alpha_s: float
    beta_s_per_byte: float
    beta_fitted: bool             # False: β is the link's (from the rate), only α was fitted
    samples: int
    max_rel_residual: float

    def as_dict(self) -> dict:
        return asdict(self) | {"alpha_ms": self.alpha_s * 1e3}


def link_seconds(sample: CommSample, bucket: TokenBucket, alpha_s: float) -> float:
    """Link time of ``sample``'s messages through ``bucket`` (a gap of α between steps, the idle before the first)."""
    tokens, total = bucket.refill(0.0, sample.idle_s), 0.0
    for i, messages in enumerate(sample.messages()):
        if i:
            tokens = bucket.refill(tokens, alpha_s)
        seconds, tokens = transfer(messages, bucket, gap_s=alpha_s, start_tokens=tokens)
        total += seconds
    return total


def fit_loaded(samples: Sequence[CommSample], bucket: TokenBucket | None = None) -> LoadedFit:
    """Fit α under load (and β without a ``bucket``) to measured all-reduces; α, β >= 0.

    With a bucket, β is the link's and the bytes' time comes from ``transfer_time``; the gaps that
    refill the bucket are α itself, so the fit iterates (α → link time → α) a few times. Each
    sample is weighted by 1/seconds, so small (latency-bound) and large samples count alike.
    """
    if len(samples) < (1 if bucket is not None else 2):
        raise DDTrainError(f"fitting α under load needs at least {1 if bucket else 2} samples, got {len(samples)}")
    for s in samples:
        if not s.seconds > 0:
            raise DDTrainError(f"a measured all-reduce must take > 0 s, got {s.seconds} for {s.sizes} B")
    t = np.array([s.seconds for s in samples])
    k = np.array([sum(len(m) for m in s.messages()) for s in samples], dtype=float)
    w = 1.0 / t
    if bucket is None:
        m = np.array([sum(sum(msgs) for msgs in s.messages()) for s in samples])
        (alpha, beta), *_ = np.linalg.lstsq(np.stack([k * w, m * w], axis=1), t * w, rcond=None)
        if beta < 0:   # noise on the large samples: no per-byte term visible
            alpha, beta = float(np.sum(k * t * w * w) / np.sum((k * w) ** 2)), 0.0
        if alpha < 0:
            alpha, beta = 0.0, float(np.sum(m * t * w * w) / np.sum((m * w) ** 2))
        predicted = alpha * k + beta * m
        return LoadedFit(alpha_s=float(alpha), beta_s_per_byte=float(beta), beta_fitted=True,
                         samples=len(samples), max_rel_residual=float(np.max(np.abs(predicted - t) / t)))
    alpha = 0.0
    for _ in range(8):
        link = np.array([link_seconds(s, bucket, alpha) for s in samples])
        rest = t - link
        alpha = max(0.0, float(np.sum(k * rest * w * w) / np.sum((k * w) ** 2)))
    link = np.array([link_seconds(s, bucket, alpha) for s in samples])
    predicted = alpha * k + link
    return LoadedFit(alpha_s=alpha, beta_s_per_byte=bucket.beta_s_per_byte, beta_fitted=False,
                     samples=len(samples), max_rel_residual=float(np.max(np.abs(predicted - t) / t)))


def allreduce_seconds(algorithm: str, nbytes: float, ranks: int, *, alpha_s: float, bucket: TokenBucket,
                      gamma_s_per_byte: float = 0.0, idle_s: float = 0.0) -> float:
    """Predicted seconds of one all-reduce under load: α per step + the bucket's link time + the adds.

    The γ term is the algorithm's own formula's (``ddtrain.comm``; ``schedule.added_bytes``): (p−1)/p·n
    for the ring family, levels·n for tree, (p−1)·n for central, charged in full (no overlap with the
    transfers).
    """
    messages = schedule.steps(algorithm, nbytes, ranks)
    if not messages:
        return 0.0
    start = bucket.refill(0.0, idle_s)
    link = transfer_time(messages, bucket, gap_s=alpha_s, start_tokens=start)
    return alpha_s * len(messages) + link + gamma_s_per_byte * schedule.added_bytes(algorithm, nbytes, ranks)
