"""The token bucket of an emulated link: the first bytes after a pause pass at line rate.

``ddtrain cluster run`` limits every node's link with a tc tbf qdisc (``ddtrain.cluster.netns.tbf_params``):
a bucket of ``burst`` bytes of tokens that refills at the link rate. A message that finds
tokens in the bucket passes at veth speed (effectively free next to the rate) for as many bytes
as there are tokens; the rest goes at the rate. Between two messages the bucket refills for the
idle time (α, compute), up to ``burst``. A plain α-β line has no term for this, which is why
tree (whole-buffer messages below the burst) stayed ahead of the ring far longer than the
model allowed (docs/REPRODUCING.md, "Tree and butterfly against ring").

The rate seen by the payload is the link rate times TCP's payload share (0.956 at MTU 1500:
docs/EMULATED_CLUSTER.md); ``link_beta`` gives that β.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

TCP_PAYLOAD_SHARE = 0.956    # payload bytes / wire bytes of full TCP segments at MTU 1500 (docs/EMULATED_CLUSTER.md)
BURST_S = 0.004              # tbf burst: 4 ms of tokens ...
MIN_BURST_BYTES = 64 * 1024  # ... but at least one 64 KiB GSO super-packet (cluster.netns.tbf_params)


def emulated_burst_bytes(rate_bps: float) -> int:
    """The tbf burst ``ddtrain cluster run`` gives a link of ``rate_bps`` bits/s (the same rule as netns.tbf_params)."""
    if not rate_bps > 0:
        raise DDTrainError(f"the link rate must be > 0 bit/s, got {rate_bps!r}")
    return max(MIN_BURST_BYTES, int(rate_bps / 8 * BURST_S))


def link_beta(rate_bps: float, payload_share: float = TCP_PAYLOAD_SHARE) -> float:
    """Seconds per payload byte on a link of ``rate_bps`` bits/s."""
    if not rate_bps > 0:
        raise DDTrainError(f"the link rate must be > 0 bit/s, got {rate_bps!r}")
    return 8 / (rate_bps * payload_share)


@dataclass(frozen=True, kw_only=True)
class TokenBucket:
    """A link's bucket: ``burst_bytes`` of tokens, refilled at one payload byte per ``beta_s_per_byte``."""

    burst_bytes: float
    beta_s_per_byte: float

    def __post_init__(self):
        if self.burst_bytes < 0 or self.beta_s_per_byte < 0:
            raise DDTrainError(f"a token bucket needs burst >= 0 and beta >= 0, got {self.burst_bytes}, "
                               f"{self.beta_s_per_byte}")

    @classmethod
    def emulated(cls, rate_bps: float) -> TokenBucket:
        """The bucket of an emulated link of ``rate_bps`` bits/s."""
        return cls(burst_bytes=emulated_burst_bytes(rate_bps), beta_s_per_byte=link_beta(rate_bps))

    def refill(self, tokens: float, idle_s: float) -> float:
        """Tokens after ``idle_s`` seconds without traffic (at most the burst)."""
        if self.beta_s_per_byte == 0:
            return self.burst_bytes
        return min(self.burst_bytes, tokens + idle_s / self.beta_s_per_byte)


def transfer(messages: Sequence[float], bucket: TokenBucket, *, gap_s: float,
             start_tokens: float | None = None) -> tuple[float, float]:
    """(seconds the link spends moving ``messages`` sent one after another, tokens left after them).

    Each message first uses the tokens in the bucket (free), then pays β per remaining byte; the
    bucket refills during the ``gap_s`` before every message but the first (the α of the step).
    ``start_tokens`` (default: a full bucket) is what the pause before the first message left.
    """
    tokens = bucket.burst_bytes if start_tokens is None else min(start_tokens, bucket.burst_bytes)
    total = 0.0
    for i, m in enumerate(messages):
        if i:
            tokens = bucket.refill(tokens, gap_s)
        free = min(tokens, m)
        tokens -= free
        total += (m - free) * bucket.beta_s_per_byte  # the bucket stays empty while the rest trickles at the rate
    return total, tokens


def transfer_time(messages: Sequence[float], bucket: TokenBucket, *, gap_s: float,
                  start_tokens: float | None = None) -> float:
    """Seconds the link spends moving ``messages`` (``transfer``'s first value)."""
    return transfer(messages, bucket, gap_s=gap_s, start_tokens=start_tokens)[0]


def burst_saving_s(messages: Sequence[float], bucket: TokenBucket, *, gap_s: float,
                   start_tokens: float | None = None) -> float:
    """Seconds the bucket saves against a plain β line over the same messages (>= 0)."""
    plain = sum(messages) * bucket.beta_s_per_byte
    return plain - transfer_time(messages, bucket, gap_s=gap_s, start_tokens=start_tokens)
