"""Timelines of every rank on one clock: a Chrome-trace JSON (chrome://tracing, ui.perfetto.dev).

Each rank records its spans with its own ``time.perf_counter()``. Ranks on other hosts have
other clocks, so at the start ``estimate_offsets`` runs a ping exchange (NTP's method): rank 0
sends a ping to rank r, r answers with its clock reading ``t_r``, rank 0 notes the send and
receive times ``t0``, ``t1``; then ``offset_r = t_r - (t0 + t1) / 2``, taken from the round
with the shortest round trip, whose half bounds the error. On one host every rank reads the
same monotonic clock, so the estimates there should be within that bound of zero (the test
checks it). ``chrome_trace`` subtracts the offsets and lays the ranks out as processes:

* thread "steps": ``step N`` containing ``data``, ``forward+backward`` (ending with
  ``wait: gradient sync``, the part of it spent waiting for communication after the last
  gradient was computed) and ``optimizer+sync``;
* thread "communication": one span per exchange of our algorithms (``ring reduce-scatter
  step 2``: posted to done, bytes and peers in its arguments);
* thread "all-reduce calls": DDP's buckets (one span per bucket, from the timing hook) or,
  for our algorithms, each call's sequence of steps.

``straggler_summary`` names the slowest rank (the one with most busy time per step, which
the others wait for) and where its time went.
"""
from __future__ import annotations

import statistics
import time

STEPS_TID, COMM_TID, CALLS_TID = 1, 2, 3


def estimate_offsets(rounds: int = 8, group=None) -> dict:
    """Clock offset of every rank against rank 0 (a collective: every rank of ``group`` calls it).

    Returns ``{"offsets_s": [...], "rtt_s": [...]}`` (rank 0: 0 and 0), the same on every rank.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return {"offsets_s": [0.0], "rtt_s": [0.0]}
    world, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    # NCCL moves only CUDA tensors; Gloo takes CPU ones.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    table = torch.zeros(2, world, dtype=torch.float64, device=on)
    buf = torch.zeros(1, dtype=torch.float64, device=on)
    if me == 0:
        for r in range(1, world):
            best = None
            for _ in range(rounds):
                t0 = time.perf_counter()
                dist.send(buf, ranks[r], group=group)
                dist.recv(buf, ranks[r], group=group)
                t1 = time.perf_counter()
                if best is None or t1 - t0 < best[1]:
                    best = (float(buf.item()) - (t0 + t1) / 2, t1 - t0)
            table[0, r], table[1, r] = best
    else:
        for _ in range(rounds):
            dist.recv(buf, ranks[0], group=group)
            buf.fill_(time.perf_counter())
            dist.send(buf, ranks[0], group=group)
    dist.broadcast(table, ranks[0], group=group)
    return {"offsets_s": table[0].tolist(), "rtt_s": table[1].tolist()}


def merge_exchanges(spans: list) -> list[dict]:
    """One entry per exchange: the send and receive halves of a step share name, start and end."""
    merged: dict[tuple, dict] = {}
    for name, start, end, peer, nbytes, direction in spans:
        entry = merged.setdefault((name, start, end), {"name": name, "start_s": start, "end_s": end,
                                                       "sent_bytes": 0, "received_bytes": 0, "peers": []})
        entry["sent_bytes" if direction == "send" else "received_bytes"] += nbytes
        if peer not in entry["peers"]:
            entry["peers"].append(peer)
    return sorted(merged.values(), key=lambda e: e["start_s"])


def group_calls(exchanges: list[dict]) -> list[dict]:
    """Consecutive exchanges of one collective call: a call starts where its first step's name recurs."""
    calls: list[dict] = []
    first = None
    for e in exchanges:
        algorithm = e["name"].split(" ")[0]
        if calls and e["name"] != first and calls[-1]["algorithm"] == algorithm:
            call = calls[-1]
            call["end_s"] = max(call["end_s"], e["end_s"])
            call["steps"] += 1
            call["sent_bytes"] += e["sent_bytes"]
            continue
        first = e["name"]
        calls.append({"algorithm": algorithm, "start_s": e["start_s"], "end_s": e["end_s"], "steps": 1,
                      "sent_bytes": e["sent_bytes"]})
    return calls


def chrome_trace(ranks: list[dict], offsets_s: list[float], metadata: dict | None = None) -> dict:
    """The merged trace. ``ranks[i]``: ``rank``, ``role``, ``steps`` (see profiler), ``comm`` spans, ``buckets``."""
    def shift(rank):
        return offsets_s[rank] if rank < len(offsets_s) else 0.0

    starts = [s["begin_s"] - shift(r["rank"]) for r in ranks for s in r.get("steps", [])]
    starts += [c[1] - shift(r["rank"]) for r in ranks for c in r.get("comm", [])]
    starts += [b["start_s"] - shift(r["rank"]) for r in ranks for b in r.get("buckets", [])]
    origin = min(starts) if starts else 0.0
    events: list[dict] = []

    for r in sorted(ranks, key=lambda x: x["rank"]):
        pid, off = r["rank"], shift(r["rank"])

        def us(t):
            return round((t - off - origin) * 1e6, 3)

        def span(name, tid, start, end, cat, args=None):
            if end >= start:
                events.append({"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": us(start),
                               "dur": round((end - start) * 1e6, 3), "args": args or {}})

        events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid} ({r.get('role', 'worker')})"}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
        for tid, label in ((STEPS_TID, "steps"), (COMM_TID, "communication"), (CALLS_TID, "all-reduce calls")):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": label}})
        for s in r.get("steps", []):
            span(f"step {s['step']}", STEPS_TID, s["begin_s"], s["end_s"], "step", {"step": s["step"]})
            span("data", STEPS_TID, s["begin_s"], s["data_end_s"], "data")
            span("forward+backward", STEPS_TID, s["data_end_s"], s["compute_end_s"], "compute")
            grad = s.get("grad_done_s")
            if grad is not None and s["data_end_s"] <= grad < s["compute_end_s"]:
                span("wait: gradient sync", STEPS_TID, grad, s["compute_end_s"], "comm-wait")
            span("optimizer+sync", STEPS_TID, s["compute_end_s"], s["end_s"], "optimizer")
        exchanges = merge_exchanges(r.get("comm", []))
        for e in exchanges:
            span(e["name"], COMM_TID, e["start_s"], e["end_s"], "comm",
                 {k: e[k] for k in ("sent_bytes", "received_bytes", "peers")})
        if r.get("buckets"):
            for b in r["buckets"]:
                span(f"bucket {b['index']} all-reduce", CALLS_TID, b["start_s"], b["end_s"], "bucket",
                     {"bytes": b["nbytes"], "step": b.get("step")})
        else:
            for c in group_calls(exchanges):
                span(f"{c['algorithm']} call", CALLS_TID, c["start_s"], c["end_s"], "bucket",
                     {"exchanges": c["steps"], "sent_bytes": c["sent_bytes"]})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "time.perf_counter of each rank minus its offset to rank 0",
                          "offsets_s": list(offsets_s), **(metadata or {})}}


def straggler_summary(splits: dict[int, dict], per_step_busy: dict[int, list[float]] | None = None) -> dict:
    """The slowest worker and where its time went.

    ``splits``: rank -> mean seconds per step of ``data_s``, ``compute_s``, ``comm_wait_s``,
    ``optimizer_s``. Busy time = data + compute + optimizer (everything but waiting for
    others); in synchronous training the rank with the most of it sets the pace.
    ``per_step_busy``: rank -> busy seconds of each timed step, to count how often each rank
    was the slowest.
    """
    if not splits:
        return {"text": "no worker steps were timed"}
    busy = {r: s["data_s"] + s["compute_s"] + s["optimizer_s"] for r, s in splits.items()}
    slowest = max(busy, key=busy.get)
    others = [busy[r] for r in busy if r != slowest]
    waits = [splits[r]["comm_wait_s"] for r in splits if r != slowest]
    s = splits[slowest]
    out = {"slowest_rank": slowest, "busy_s": busy[slowest],
           "others_median_busy_s": statistics.median(others) if others else None,
           "split_s": {k: s[k] for k in ("data_s", "compute_s", "comm_wait_s", "optimizer_s")},
           "others_mean_comm_wait_s": statistics.fmean(waits) if waits else None}
    if per_step_busy and len(per_step_busy) > 1:
        n = min(len(v) for v in per_step_busy.values())
        counts = dict.fromkeys(per_step_busy, 0)
        for i in range(n):
            counts[max(per_step_busy, key=lambda r: per_step_busy[r][i])] += 1
        out["slowest_in_steps"] = {"counts": counts, "steps": n}
    parts = ", ".join(f"{k[:-2].replace('_', ' ')} {1e3 * v:.1f} ms" for k, v in out["split_s"].items())
    text = f"slowest rank: {slowest}, busy {1e3 * busy[slowest]:.1f} ms/step ({parts})"
    if others:
        text += (f"; other ranks: median busy {1e3 * out['others_median_busy_s']:.1f} ms/step, "
                 f"waiting {1e3 * out['others_mean_comm_wait_s']:.1f} ms/step on communication")
    if "slowest_in_steps" in out:
        c = out["slowest_in_steps"]
        text += f"; slowest in {c['counts'][slowest]} of {c['steps']} timed steps"
    out["text"] = text
    return out
