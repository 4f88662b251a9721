"""Splitting each training step's wall time into data, compute, communication wait, optimizer and other.

``Profiler`` (``ddtrain.observe.profiler``) feeds ``split_steps`` the loop's clock readings of each step and the
blocking communication intervals of the training thread; docs/PERFORMANCE.md, "The step split",
defines the parts.
"""
from __future__ import annotations

import bisect


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def covered(disjoint: list[tuple[float, float]], starts: list[float], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by ``disjoint`` intervals (``starts``: their start times)."""
    total, i = 0.0, max(bisect.bisect_right(starts, lo) - 1, 0)
    while i < len(disjoint) and disjoint[i][0] < hi:
        total += max(0.0, min(hi, disjoint[i][1]) - max(lo, disjoint[i][0]))
        i += 1
    return total


def split_steps(steps: list[dict], blocking: list[tuple[float, float]]) -> list[dict]:
    """Each step's data / compute / communication wait / optimizer / other seconds; they add up to ``step_s``.

    A step runs from the start of its data span to the start of the next step's, or, for the
    last step of an epoch, to the loop's end-of-step callback (``wall_end_s``): ``other_s`` is
    that tail (the loop's in-step work after the optimizer: end-of-epoch replica checks,
    checkpoints). Inside an epoch the next data span starts where this step's optimizer ended,
    so the per-step bookkeeping is part of the next step's ``data_s``. The run's last step ends
    with its optimizer call.
    """
    disjoint = union(blocking)
    starts = [a for a, _ in disjoint]
    out = []
    for s in steps:
        grad = s.get("grad_done_s")
        if grad is None or not s["data_end_s"] <= grad <= s["compute_end_s"]:
            grad = s["compute_end_s"]
        exposed = s["compute_end_s"] - grad
        in_backward = covered(disjoint, starts, s["data_end_s"], grad)
        in_optimizer = covered(disjoint, starts, s["compute_end_s"], s["end_s"])
        wall_end = s.get("wall_end_s") or s["end_s"]
        out.append({"step": s["step"], "data_s": s["data_end_s"] - s["begin_s"],
                    "compute_s": grad - s["data_end_s"] - in_backward,
                    "comm_wait_s": exposed + in_backward + in_optimizer,
                    "optimizer_s": s["end_s"] - s["compute_end_s"] - in_optimizer,
                    "other_s": wall_end - s["end_s"], "step_s": wall_end - s["begin_s"]})
    return out
