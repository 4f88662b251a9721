"""Timelines: clock offsets from the ping exchange, the merged Chrome trace, the straggler summary,
and a real 2-rank ring run traced end to end (its step split must add up to the measured step)."""
import json
import time

import torch

from ddtrain import TrainConfig, fit
from ddtrain.observe import timeline
from ddtrain.observe.profiler import Profiler, split_steps
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from multirank import run_ranks


def offsets_with_skew(skews):
    """Estimate offsets on every rank while rank r's clock reads ``skews[r]`` seconds ahead."""
    import torch.distributed as dist
    real = time.perf_counter
    skew = skews[dist.get_rank()]

    class SkewedTime:
        @staticmethod
        def perf_counter():
            return real() + skew
    timeline.time = SkewedTime
    try:
        return timeline.estimate_offsets(rounds=6)
    finally:
        timeline.time = time


def test_offsets_are_zero_on_one_host_within_half_the_round_trip():
    results = run_ranks(offsets_with_skew, 2, [0.0, 0.0])
    assert all(r == results[0] for r in results)  # every rank gets the same table
    est = results[0]
    assert est["offsets_s"][0] == 0.0
    for r in (1,):
        # every rank reads the same CLOCK_MONOTONIC, so the truth is 0; the error is at most rtt/2
        assert abs(est["offsets_s"][r]) <= est["rtt_s"][r] / 2 + 1e-4, est


def test_offsets_recover_a_known_clock_skew():
    for skews in ([0.0, 5.0], [0.0, -2.5]):
        est = run_ranks(offsets_with_skew, 2, skews)[0]
        r, skew = 1, skews[1]
        assert abs(est["offsets_s"][r] - skew) <= est["rtt_s"][r] / 2 + 1e-4, est


def _step(step, begin, data, grad, compute, end):
    return {"step": step, "begin_s": begin, "data_end_s": data, "grad_done_s": grad, "compute_end_s": compute,
            "end_s": end}


def test_chrome_trace_puts_every_rank_on_rank_0s_clock():
    # rank 1's clock runs 100 s ahead: its spans must land at the same trace times as rank 0's
    ranks = [{"rank": 0, "role": "worker", "steps": [_step(0, 10.0, 10.1, 10.5, 10.6, 10.7)],
              "comm": [("ring reduce-scatter step 0", 10.55, 10.58, 1, 400, "send"),
                       ("ring reduce-scatter step 0", 10.55, 10.58, 1, 400, "recv")], "buckets": []},
             {"rank": 1, "role": "worker", "steps": [_step(0, 110.0, 110.1, 110.5, 110.6, 110.7)],
              "comm": [], "buckets": [{"index": 0, "start_s": 110.5, "end_s": 110.6, "nbytes": 800, "step": 0}]}]
    trace = json.loads(json.dumps(timeline.chrome_trace(ranks, [0.0, 100.0])))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by = {(e["pid"], e["name"]): e for e in spans}
    assert by[(0, "step 0")]["ts"] == by[(1, "step 0")]["ts"] == 0.0
    assert abs(by[(0, "forward+backward")]["dur"] - 0.5e6) < 1
    assert abs(by[(0, "wait: gradient sync")]["ts"] - 0.5e6) < 1     # from the last gradient to the end of backward
    ring = by[(0, "ring reduce-scatter step 0")]                       # send and receive halves merged
    assert ring["args"]["sent_bytes"] == ring["args"]["received_bytes"] == 400 and ring["tid"] == timeline.COMM_TID
    assert by[(1, "bucket 0 all-reduce")]["args"]["bytes"] == 800
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (worker)"), (1, "rank 1 (worker)")}
    for e in spans:  # children sit inside their step
        if e["tid"] == timeline.STEPS_TID and not e["name"].startswith("step"):
            parent = by[(e["pid"], "step 0")]
            assert parent["ts"] <= e["ts"] and e["ts"] + e["dur"] <= parent["ts"] + parent["dur"] + 1


def test_calls_are_grouped_where_the_first_step_recurs():
    names = ["ring reduce-scatter step 0", "ring reduce-scatter step 1", "ring all-gather step 0",
             "ring all-gather step 1"] * 2
    spans = [(n, float(i), i + 0.5, 1, 10, "send") for i, n in enumerate(names)]
    calls = timeline.group_calls(timeline.merge_exchanges(spans))
    assert [(c["start_s"], c["end_s"], c["steps"], c["sent_bytes"]) for c in calls] == [(0.0, 3.5, 4, 40),
                                                                                      (4.0, 7.5, 4, 40)]


def test_straggler_is_the_rank_with_most_busy_time():
    splits = {0: {"data_s": 0.01, "compute_s": 0.10, "comm_wait_s": 0.09, "optimizer_s": 0.01},
              1: {"data_s": 0.01, "compute_s": 0.19, "comm_wait_s": 0.00, "optimizer_s": 0.01},
              2: {"data_s": 0.02, "compute_s": 0.11, "comm_wait_s": 0.07, "optimizer_s": 0.01}}
    out = timeline.straggler_summary(splits, {0: [1, 1, 3], 1: [2, 2, 2], 2: [0, 0, 0]})
    assert out["slowest_rank"] == 1
    assert out["slowest_in_steps"]["counts"] == {0: 1, 1: 2, 2: 0}
    assert "slowest rank: 1" in out["text"] and "compute 190.0 ms" in out["text"]


def test_split_parts_add_up_and_blocking_comm_is_taken_out():
    steps = [_step(0, 0.0, 1.0, 3.0, 4.0, 6.0), _step(1, 6.0, 6.5, 7.5, 7.5, 9.0)]
    # blocking exchanges: one inside backward (2.0-2.5), one in the optimizer step (4.5-5.0, and 8.0-8.2)
    split = split_steps(steps, [(2.0, 2.5), (4.5, 5.0), (4.8, 4.9), (8.0, 8.2)])
    assert split[0] == {"step": 0, "data_s": 1.0, "compute_s": 1.5, "comm_wait_s": 1.0 + 0.5 + 0.5,
                        "optimizer_s": 1.5, "other_s": 0.0, "step_s": 6.0}
    assert abs(split[1]["comm_wait_s"] - 0.2) < 1e-12 and abs(split[1]["optimizer_s"] - 1.3) < 1e-12
    for s in split:
        parts = ("data_s", "compute_s", "comm_wait_s", "optimizer_s", "other_s")
        assert abs(sum(s[k] for k in parts) - s["step_s"]) < 1e-12
    # the last step of an epoch runs on to the loop's end-of-step reading: the tail is "other"
    tail = split_steps([dict(_step(0, 0.0, 1.0, 2.0, 2.0, 3.0), wall_end_s=3.25)], [])[0]
    assert tail["other_s"] == 0.25 and tail["step_s"] == 3.25


def traced_ring_run(trace_path, out_path):
    torch.manual_seed(0)
    x, y = torch.randn(512, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(512) % 10
    data = Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 8, 8), "classification")
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(64, 32))
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="ring", epochs=0, steps=12, batch_size=16, lr=0.05,
                         val_fraction=0.0, quiet=True, out=out_path)
    record = fit(model, data, config, callbacks=[Profiler(trace_path=trace_path, warmup_steps=2)])
    return record.get("profile")


def test_a_traced_ring_run_has_ring_steps_and_a_split_that_adds_up(tmp_path):
    trace_path, out_path = tmp_path / "trace.json", tmp_path / "run.json"
    run_ranks(traced_ring_run, 2, str(trace_path), str(out_path))
    profile = json.loads(out_path.read_text())["profile"]
    for r in profile["ranks"]:
        assert r["timed_steps"] == 10
        assert abs(r["split_sum_pct"] - 100) <= 5, r        # acceptance 3: within 5 % of the measured step
        assert r["split_s"]["comm_wait_s"] > 0
    trace = json.loads(trace_path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    ring = [e for e in spans if e["name"].startswith("ring reduce-scatter step 0") and e["pid"] == 0]
    assert len(ring) == 12                                   # one all-reduce per step (one bucket)
    grads = sum(p.numel() for p in build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8),
                                               hidden=(64, 32)).parameters())
    assert ring[0]["args"]["sent_bytes"] in (4 * (grads // 2), 4 * (grads - grads // 2))   # half the gradient
    calls = [e for e in spans if e["tid"] == timeline.CALLS_TID and e["pid"] == 1]
    assert len(calls) == 12 and all(c["args"]["exchanges"] == 2 for c in calls)
    assert "slowest rank" in trace["otherData"]["straggler"]
