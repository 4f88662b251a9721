"""Pure arithmetic of the cluster reproductions: expected bytes, crossovers, α-β fits, count comparisons.

No processes, no files: the scripts measure, these functions turn measurements into the
figures docs/REPRODUCING.md quotes (tests/integration/test_cluster_repro.py checks them against
independent derivations).
"""
from __future__ import annotations

import math
import statistics

# ---------------------------------------------------------------- document 002: bytes per node

TCP_PAYLOAD_PER_WIRE = 1448 / 1514   # TCP payload per link-layer byte at MTU 1500 (docs/EMULATED_CLUSTER.md)


def expected_step_bytes(strategy: str, workers: int, gradient_bytes: int) -> dict:
    """Payload bytes one training step puts on each node's link, each way, by the algorithm's design.

    ring (any all-reduce built as reduce-scatter + all-gather): every node sends and receives
    2(n-1)/n of the gradients, whatever n. ps-sync: each worker sends its gradients to the
    server and receives the parameters back (M each way); the server receives n*M and sends
    n*M. Returns {"worker": (sent, received), "server": (sent, received) or None}.
    """
    if workers < 1 or gradient_bytes < 0:
        raise ValueError(f"need workers >= 1 and gradient_bytes >= 0, got {workers}, {gradient_bytes}")
    m = gradient_bytes
    if strategy in ("ring", "ring-async", "ddp", "butterfly", "hybrid"):
        share = 2 * (workers - 1) / workers * m if workers > 1 else 0.0
        return {"worker": (share, share), "server": None}
    if strategy in ("ps-sync", "ps-async"):
        return {"worker": (m, m), "server": (workers * m, workers * m)}
    if strategy == "central":   # rank 0 is the master and also a worker
        return {"worker": (m, m), "server": ((workers - 1) * m, (workers - 1) * m)}
    raise ValueError(f"no traffic formula for strategy {strategy!r}")


def per_step(total_bytes: float, steps: int) -> float:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return total_bytes / steps


def rates_over_time(samples: list[dict], node: int) -> list[tuple[float, float, float]]:
    """(time at the middle of an interval, Mbit/s sent, Mbit/s received) of ``node`` between samples.

    ``samples`` are the cluster's cumulative counters (RunResult.to_dict()["samples"]); the
    first interval starts at (0 s, 0 bytes).
    """
    out, prev_t, prev_s, prev_r = [], 0.0, 0, 0
    for sample in samples:
        t, sent, recv = sample["t_s"], sample["bytes_sent"][node], sample["bytes_received"][node]
        dt = t - prev_t
        if dt > 0:
            out.append(((t + prev_t) / 2, (sent - prev_s) * 8 / dt / 1e6, (recv - prev_r) * 8 / dt / 1e6))
        prev_t, prev_s, prev_r = t, sent, recv
    return out


def flattening(throughputs: dict[int, float]) -> float:
    """Throughput gained from the second-largest to the largest worker count, over the worker ratio.

    1.0: throughput grows in proportion to workers (linear scaling over that step); 0: flat.
    """
    counts = sorted(throughputs)
    if len(counts) < 2:
        raise ValueError("need at least two worker counts")
    a, b = counts[-2], counts[-1]
    return (throughputs[b] / throughputs[a] - 1) / (b / a - 1)


# ---------------------------------------------------------------- document 001: α-β and crossovers

def fit_alpha_beta(sizes: list[int], times_s: list[float], *, beta_min_bytes: int,
                   alpha_max_bytes: int) -> tuple[float, float]:
    """α from small messages, β from large ones, each where it is not polluted by the other regime.

    β: least-squares slope of t(m) over the sizes >= ``beta_min_bytes`` (at least two; messages
    far above a token bucket's burst, so the bucket's free start is a small part of them). α:
    the median of ``t(m) - β·m`` over the sizes <= ``alpha_max_bytes``: latency-bound ones, small
    enough that β·m is a sliver of t (below the burst they did not pay β, so subtracting it for
    a large "small" message would bias α low).
    """
    big = [(m, t) for m, t in zip(sizes, times_s) if m >= beta_min_bytes]
    small = [(m, t) for m, t in zip(sizes, times_s) if m <= alpha_max_bytes]
    if len(big) < 2 or len({m for m, _ in big}) < 2:
        raise ValueError(f"need two distinct sizes >= {beta_min_bytes} B to fit beta, got {[m for m, _ in big]}")
    if not small:
        raise ValueError(f"need a size <= {alpha_max_bytes} B to fit alpha")
    mean_m = statistics.fmean(m for m, _ in big)
    mean_t = statistics.fmean(t for _, t in big)
    beta = (sum((m - mean_m) * (t - mean_t) for m, t in big) / sum((m - mean_m) ** 2 for m, _ in big))
    beta = max(beta, 0.0)
    alpha = max(statistics.median(t - beta * m for m, t in small), 0.0)
    return alpha, beta


def crossover(sizes: list[int], faster: dict[int, float], slower: dict[int, float]) -> int | None:
    """The smallest size from which ``faster`` takes no longer than ``slower`` at every larger size.

    ``faster``/``slower``: size -> seconds. None if ``faster`` is still slower at the largest
    size; the smallest size if it never loses.
    """
    common = sorted(s for s in sizes if s in faster and s in slower)
    if not common:
        raise ValueError("no common sizes")
    answer = None
    for size in reversed(common):
        if faster[size] <= slower[size]:
            answer = size
        else:
            break
    return answer


def predicted_crossover(predict, low: float = 1.0, high: float = float(1 << 34)) -> float | None:
    """The size (bytes) where ``predict(m)`` = t_ring(m) − t_other(m) changes sign from + to −.

    ``predict`` is increasing-to-negative for α-β formulas: ring pays more latency, less
    bandwidth. Bisection on a log scale; None if ring is never faster in [low, high], ``low``
    if it is always faster.
    """
    if predict(low) <= 0:
        return low
    if predict(high) > 0:
        return None
    for _ in range(200):
        mid = math.sqrt(low * high)
        if predict(mid) > 0:
            low = mid
        else:
            high = mid
        if high / low < 1 + 1e-9:
            break
    return high


def tree_ring_crossover_closed_form(ranks: int, alpha: float, beta: float) -> float:
    """Where 2·log2(p)(α + mβ) = 2(p−1)α + 2((p−1)/p)mβ, for p a power of two (no γ).

    m* = (p − 1 − log2 p)·α / ((log2 p − (p − 1)/p)·β).
    """
    lg = math.log2(ranks)
    return (ranks - 1 - lg) * alpha / ((lg - (ranks - 1) / ranks) * beta)


# ---------------------------------------------------------------- document 000: counts against bytes

def values_per_rank(bytes_by_rank: list[int], element_bytes: int = 4) -> list[float]:
    return [b / element_bytes for b in bytes_by_rank]


def count_check(method: str, params: int, ranks: int, steps: int, sent_bytes: list[int],
                broadcasts: int = 0, bcast_sent_bytes: list[int] | None = None, element_bytes: int = 4) -> dict:
    """Document 000's Table 5.1 count for ``steps`` steps against the values our counters saw sent.

    The document counts a value moved from one worker to another. Its formulas mix two views,
    so each is checked the way it is built: centralized ``2·E·N·(R−1)`` = every value sent by
    anyone (R−1 workers send N up, the master sends N back to each); decentralized
    ``2·E·(N/R)·(R−1)`` = the values ONE worker sends (each rank sends the same); proposed =
    the decentralized count + ``N·(R−1)`` per broadcast, the broadcast's values summed over
    all senders (a tree or a flat broadcast both move N to each of R−1 ranks).
    """
    from ddtrain.costmodel import centralized_count, decentralized_count, proposed_count

    values = values_per_rank(sent_bytes, element_bytes)
    if method == "centralized":
        formula = centralized_count(params, ranks, steps)
        measured = sum(values)
        view = "all ranks' values sent"
    elif method == "decentralized":
        formula = decentralized_count(params, ranks, steps)
        measured = statistics.fmean(values)
        view = "values sent per rank (mean)"
    elif method == "proposed":
        formula = proposed_count(params, ranks, steps, broadcasts)
        bcast = sum(values_per_rank(bcast_sent_bytes or [0] * ranks, element_bytes))
        measured = statistics.fmean(values) + bcast
        view = "ring values sent per rank (mean) + broadcast values sent by all ranks"
    else:
        raise ValueError(f"method must be centralized, decentralized or proposed, got {method!r}")
    return {"method": method, "formula": float(formula), "measured": measured, "view": view,
            "ratio": measured / float(formula) if formula else None}
