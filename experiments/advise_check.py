"""Check ``ddtrain advise`` against measurement in the emulated cluster: its top 3 and the baseline, as real runs.

    sudo python experiments/advise_check.py --out results/advise                 # 100mbit and 1gbit, ResNet-18
    sudo python experiments/advise_check.py --out /tmp/a --rates 1gbit --model mlp --data mnist --steps 8

For each link rate, on 4 emulated nodes (one rank each; every node shares this host's cores):

1. **compute**: ``ddtrain train --strategy local-sgd --sync-every 100000`` (no communication inside the
   run) gives the compute step in the cluster, under the same CPU sharing as the real runs (the same
   step timed alone here is recorded beside it); the compressors' own work is timed on the 4 nodes at
   once (``--codec-worker`` under ``ddtrain cluster run``: ``codec_<rate>.json``);
2. **α under load**: ``ddtrain train --strategy ring`` and ``--strategy ddp`` of the ``mlp`` at two
   sizes (gradients of ~50 KB and ~7.6 MB); the communication wait of each step (docs/PERFORMANCE.md,
   "step split") is its all-reduces inside training; ``costmodel.loaded.fit_loaded`` fits α to them
   with the link's token bucket (``costmodel.burst``), one α for our algorithms (Python steps) and
   one for Gloo's own (``native``), written to ``loaded_<rate>.json``;
3. **advice**: ``ddtrain advise --calibration loaded_<rate>.json --step-time <compute> --codec-times codec_<rate>.json``
   (``advice_<rate>.json``/``.txt``), and the old model (calibrated α of the bench, no bucket, no
   CPU sharing) over the same methods;
4. **measurement**: the top 3 distinct eligible methods and the baseline (``ddp``, no compression) as
   ``ddtrain train`` runs; measured step = the slowest rank's median over the steps after the
   warm-up (mean for averaging strategies, whose sync falls on one step in K). Each is predicted twice:
   with the compute step of step 1 (what the adviser ranked with) and with the compute step measured
   in that same run (``same-run``: the load of the shared host drifts between runs).

Writes ``check_<rate>.json`` (every run's record path, predictions, measurements) and ``check.txt``, and
``check_overlap.txt``: the same inputs with the overlap of DDP's buckets and the backward pass
(``costmodel.overlap``; backward = 2/3 of the calibration run's measured forward+backward), ranked again
(its first choice and top 3 against the measured runs), and with each run's own compute step.
``--reanalyse`` recomputes all of it from the saved records (no cluster).
Needs root (the cluster); the records of every run stay under ``<out>/runs/``.

    python experiments/advise_check.py --crossover --out results/advise      # no cluster: committed files only

``--crossover`` re-reads the committed collectives of document 001's reproduction
(results/cluster/doc001/collectives-{4,8}.json: every algorithm, 256 B to 8 MiB, 200 Mbit/s) and
compares the ring-vs-tree and ring-vs-butterfly crossovers measured there with those of the old
model (the bench's calibration) and the new one (α under load fitted on the ring's times alone,
with the token bucket), writing ``crossover.json`` and ``crossover.txt``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ddtrain.bench import advise as advice_lib
from ddtrain.bench import measure
from ddtrain.cli import advise as advise_cli
from ddtrain.cluster.netns import parse_rate
from ddtrain.costmodel import advise
from ddtrain.costmodel import overlap as costmodel_overlap
from ddtrain.costmodel.burst import TokenBucket, emulated_burst_bytes, link_beta
from ddtrain.costmodel.contention import cpu_slowdown
from ddtrain.costmodel.loaded import CommSample, fit_loaded
from ddtrain.models.zoo import build_model

NODES = 4
# the calibration α of ddtrain bench collectives in the same cluster (4 nodes, 200 Mbit/s: pairwise
# exchange, all ranks at once): results/cluster/collectives_4nodes_200mbit.txt, "calibration" line
OLD_ALPHA_S = 146.6e-6
OLD_ALPHA_SOURCE = "results/cluster/collectives_4nodes_200mbit.txt (bench calibration, 4 nodes)"
MLP_HIDDEN = ("16", "1024,1024")   # ~13 K and ~1.9 M parameters: ~50 KB and ~7.6 MB of gradients


def run_logged(cmd: list[str], what: str, log) -> None:
    """Run ``cmd``, logging (``log``) the command, its exit status, time and the load average; a failure ends the check."""
    log(f"$ {' '.join(cmd)}")
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True)
    log(f"#   exit {done.returncode} after {time.time() - start:.1f} s; load average {os.getloadavg()[0]:.2f}")
    if done.returncode != 0:
        log(done.stdout[-2000:] + done.stderr[-2000:])
        raise SystemExit(f"{what} failed")


def train(out: Path, rate: str, name: str, args: list[str], *, steps: int, warmup: int, model: str, data: str,
          batch: int, log) -> dict:
    """One ``ddtrain train`` in the cluster; its record (the --out JSON)."""
    record = out / "runs" / f"{rate}_{name}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    samples = NODES * batch * (steps + 2)
    cmd = ["ddtrain", "cluster", "run", "--nodes", str(NODES), "--link", rate, "--timeout-s", "900", "--",
           "ddtrain", "train", "--model", model, "--data", f"synthetic:{data}", "--data-arg", f"samples={samples}",
           "--batch-size", str(batch), "--steps", str(steps), "--val-fraction", "0", "--profile",
           "--profile-warmup-steps", str(warmup), "--quiet", "--out", str(record), *args]
    run_logged(cmd, f"run {name} at {rate}", log)
    return json.loads(record.read_text())


def codec_worker(a) -> int:
    """Inside ``ddtrain cluster run``: every rank times each compressor at the same time (a barrier before each),
    on the threads a training rank has; rank 0 writes the slowest rank's median per compression."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    shapes = advice_lib.model_shapes(model=a.model, data=a.data)
    specs = [c for c in a.compressions.split(",") if c and c != "none"]
    # a group of each rank alone: the compressors' collectives then send nothing (their own work only)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    mine = {}
    for spec in specs:
        dist.barrier()
        mine.update(measure.time_codecs([spec], shapes, group=alone))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(a.codec_out).write_text(json.dumps({
            "codec_s": {spec: max(r[spec] for r in everyone) for spec in specs},
            "per_rank_s": everyone, "world_size": dist.get_world_size(),
            "method": "every rank times ddtrain.comm.compression's compressor on the model's shapes (median of 3 "
                      "calls past any warm-up, no messages) at the same time; the slowest rank's"}, indent=2) + "\n")
    dist.destroy_process_group()
    return 0


def measure_codecs_in_cluster(out: Path, rate: str, a, log) -> Path:
    """The compressors' own work timed on all 4 emulated nodes at once (the sharing the real runs have)."""
    target = out / f"codec_{rate}.json"
    cmd = ["ddtrain", "cluster", "run", "--nodes", str(NODES), "--link", rate, "--timeout-s", "600", "--",
           "python", str(Path(__file__).resolve()), "--codec-worker", "--codec-out", str(target),
           "--model", a.model, "--data", a.data, "--compressions", a.compressions]
    run_logged(cmd, f"codec timing at {rate}", log)
    return target


def measured_step(record: dict, periodic: bool) -> dict:
    """The slowest worker's median step after the warm-up (mean for a periodic strategy), and the spread."""
    ranks = [r for r in record["profile"]["ranks"] if r["role"] == "worker" and r["timed_steps"]]
    key = "step_time_s" if periodic else "step_time_median_s"
    return {"step_s": max(r[key] for r in ranks), "statistic": "mean" if periodic else "median",
            "timed_steps": min(r["timed_steps"] for r in ranks),
            "per_rank_s": [r[key] for r in ranks],
            "comm_wait_s": [r["split_s"]["comm_wait_s"] for r in ranks],
            "bytes_sent": [c["bytes_sent"] for c in record.get("comm", [])]}


def check_rate(rate: str, a, out: Path, log) -> dict:
    bps = parse_rate(rate)
    common = dict(steps=a.steps, warmup=a.warmup, batch=a.batch_size, log=log)
    # 1. compute step in the cluster, and alone
    nosync = train(out, rate, "compute", ["--strategy", "local-sgd", "--sync-every", "100000"], model=a.model,
                   data=a.data, **common)
    compute = measured_step(nosync, periodic=False)
    alone = measure.measure_step(a.model, a.data, a.batch_size)
    compute_ratio = compute["step_s"] / alone
    log(f"# compute step: {1e3 * compute['step_s']:.1f} ms in the cluster, {1e3 * alone:.1f} ms alone here "
        f"(ratio {compute_ratio:.2f})")
    # the compressors' own work, timed on the 4 nodes at once (the sharing the real runs have): neither the
    # time alone scaled by R/C = 2 nor by the compute's ratio matched both earlier runs (docs/ADVISE.md)
    codec_file = measure_codecs_in_cluster(out, rate, a, log)
    log("# codec in the cluster: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in
                                               json.loads(codec_file.read_text())["codec_s"].items()))
    # 2. alpha under load: the communication wait of our ring (Python steps) and of Gloo's own (DDP) at two sizes
    bucket = TokenBucket(burst_bytes=emulated_burst_bytes(bps), beta_s_per_byte=link_beta(bps))
    fits, loaded_runs = {}, []
    for strategy, algorithm in (("ring", "ring"), ("ddp", "native")):
        samples = []
        for hidden in MLP_HIDDEN:
            name = f"loaded_{strategy}_mlp{hidden.replace(',', 'x')}"
            rec = train(out, rate, name, ["--strategy", strategy, "--model-arg", f"hidden={hidden}"], model="mlp",
                        data="mnist", **common)
            m = measured_step(rec, periodic=False)
            model = build_model("mlp", num_classes=10, in_channels=1, input_size=(28, 28),
                                hidden=tuple(int(h) for h in hidden.split(",")))
            sizes = tuple(4.0 * sum(math.prod(s) for s in b) for b in advise.buckets(
                [tuple(p.shape) for p in model.parameters()], advise.DEFAULT_BUCKET_CAP_BYTES))
            # the slowest rank arrives last and waits least: its wait is the collective's own time
            wait = min(m["comm_wait_s"])
            idle = max(r["split_s"]["compute_s"] for r in rec["profile"]["ranks"])
            samples.append(CommSample(algorithm=algorithm, sizes=sizes, ranks=NODES, seconds=wait, idle_s=idle))
            loaded_runs.append({"strategy": strategy, "algorithm": algorithm, "hidden": hidden, "bucket_bytes": sizes,
                                "comm_wait_s": m["comm_wait_s"], "sample_s": wait, "compute_s": idle,
                                "step_s": m["step_s"], "record": str(out / "runs" / f"{rate}_{name}.json")})
        fits[algorithm] = fit_loaded(samples, bucket)
    fit = fits["ring"]
    loaded = {"rate": rate, "loaded": {"alpha_s": fit.alpha_s, "beta_s_per_byte": fit.beta_s_per_byte,
                                       "burst_bytes": bucket.burst_bytes,
                                       "alpha_by_algorithm": {"native": fits["native"].alpha_s}},
              "fits": {a: f.as_dict() for a, f in fits.items()}, "runs": loaded_runs,
              "method": "communication wait of ring and ddp steps (the least over ranks) at two mlp sizes; "
                        "alpha fitted with the link's token bucket (costmodel.loaded.fit_loaded)"}
    loaded_file = out / f"loaded_{rate}.json"
    loaded_file.write_text(json.dumps(loaded, indent=2) + "\n")
    log(f"# alpha under load: ours {1e3 * fit.alpha_s:.2f} ms per step, Gloo's {1e3 * fits['native'].alpha_s:.2f} ms "
        f"(fit residuals up to {100 * fit.max_rel_residual:.0f}% and {100 * fits['native'].max_rel_residual:.0f}%)")
    # 3. the advice (through the CLI, as a user would get it) and the old model
    argv = ["--model", a.model, "--data", a.data, "--workers", str(NODES), "--batch-size", str(a.batch_size),
            "--step-time", f"{compute['step_s']:.6f}", "--calibration", str(loaded_file),
            "--codec-times", str(codec_file), "--compressions", a.compressions, "--sync-every", a.sync_every,
            "--backward-share", f"{backward_share(nosync):.4f}",
            "--json", str(out / f"advice_{rate}.json")]
    parser = argparse.ArgumentParser()
    advise_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    advice = advice_lib.build_advice(advise_cli.request_of(args))
    predictions = advice.pop("predictions")
    (out / f"advice_{rate}.json").write_text(json.dumps(advice, indent=2) + "\n")
    (out / f"advice_{rate}.txt").write_text(f"$ ddtrain advise {' '.join(argv)}\n" + advice_lib.render(advice) + "\n")
    log(advice_lib.render(advice, top=10))
    shapes = advice_lib.model_shapes(args.model, args.params, args.data)
    workload = advise.Workload(shapes=shapes, workers=NODES, batch_size=a.batch_size,
                               compute_s=compute["step_s"], backward_share=backward_share(nosync))
    network = advise.Network(alpha_s=fit.alpha_s, bucket=bucket, codec_s=codec_times(advice),
                             cpu_factor=advice["network"]["cpu_factor"],
                             alpha_by_algorithm={"native": fits["native"].alpha_s})
    old = network.plain(OLD_ALPHA_S)
    chosen = advise.top_distinct(predictions, 3)
    baseline = next(p for p in predictions if p.method.strategy == "ddp" and p.method.compression == "none")
    rows = []
    for role, p in [*((f"top{i + 1}", p) for i, p in enumerate(chosen)), ("baseline", baseline)]:
        if role == "baseline" and any(r["label"] == p.method.label for r in rows):
            rows.append(dict(next(r for r in rows if r["label"] == p.method.label), role="baseline"))
            continue
        m = p.method
        args_ = m.train_args()
        if m.compression.startswith("powersgd") and m.compression.count(":") == 1:
            # PowerSGD's default warm-up (10 uncompressed steps) would outlast the run: 2 steps (its minimum)
            args_ = [x if x != m.compression else m.compression + ":2" for x in args_]
        periodic = m.kind == "average"
        steps = max(a.steps, a.warmup + 3 * m.sync_every) if periodic else a.steps
        rec = train(out, rate, run_name(m.label), args_, model=a.model, data=a.data, **dict(common, steps=steps))
        meas = measured_step(rec, periodic)
        old_s = advise.predict(m, workload, old).step_s
        rows.append({"role": role, "label": m.label, "train_args": args_, "predicted_s": p.step_s,
                     "record": str(out / "runs" / f"{rate}_{run_name(m.label)}.json"),
                     "predicted_old_s": old_s, "measured": meas, "eligible": p.eligible, "risk": p.risk.as_dict(),
                     "error_pct": 100 * (p.step_s - meas["step_s"]) / meas["step_s"],
                     "error_old_pct": 100 * (old_s - meas["step_s"]) / meas["step_s"],
                     "predicted_bytes_per_step": p.bytes_per_step})
        log(f"# {role} {m.label}: predicted {1e3 * p.step_s:.1f} ms (old {1e3 * old_s:.1f}), measured "
            f"{1e3 * meas['step_s']:.1f} ms ({meas['statistic']} of {meas['timed_steps']} steps)")
    eligible_measured = [r for r in rows if r["eligible"]]
    fastest = min(eligible_measured, key=lambda r: r["measured"]["step_s"]) if eligible_measured else None
    return {"rate": rate, "model": a.model, "data": a.data, "batch_size": a.batch_size, "compute": compute,
            "compute_alone_s": alone, "compute_ratio": compute_ratio, "cpu_factor": advice["network"]["cpu_factor"],
            "codec_source": advice["inputs"].get("codec_s_source"),
            "loaded": loaded, "old_alpha_s": OLD_ALPHA_S, "old_alpha_source": OLD_ALPHA_SOURCE,
            "first_choice": advice["first_choice"]["label"] if advice["first_choice"] else None,
            "measured_fastest_eligible": fastest["label"] if fastest else None,
            "first_choice_is_fastest": bool(fastest and advice["first_choice"]
                                            and fastest["label"] == advice["first_choice"]["label"]),
            "top3_within_20pct": all(abs(r["error_pct"]) <= 20 for r in rows if r["role"] != "baseline"),
            "rows": rows, "load_average_end": os.getloadavg()[0]}


def codec_times(advice: dict) -> dict:
    """The codec seconds an advice used (the key was codec_s_alone in the first runs)."""
    network = advice["network"]
    return network.get("codec_s", network.get("codec_s_alone", {}))


def run_name(label: str) -> str:
    return label.replace(" ", "_").replace("(", "").replace(")", "").replace(":", "-")


def _slowest_split(record: dict) -> dict:
    """The split of the worker with the longest data + forward/backward + optimizer (waits excluded)."""
    return max((r["split_s"] for r in record["profile"]["ranks"] if r["role"] == "worker" and r["timed_steps"]),
               key=lambda s: s["data_s"] + s["compute_s"] + s["optimizer_s"])


def same_run_compute(record: dict) -> float:
    """The run's own compute step: the slowest worker's mean data + forward/backward + optimizer seconds, waits excluded."""
    s = _slowest_split(record)
    return s["data_s"] + s["compute_s"] + s["optimizer_s"]


def backward_share(record: dict) -> float:
    """The backward pass's part of a run's compute step: the FLOP rule (backward = 2/3 of forward+backward) applied
    to the measured forward+backward; data and optimizer are measured apart and never overlap communication."""
    s = _slowest_split(record)
    return costmodel_overlap.BACKWARD_SHARE_OF_FORWARD_BACKWARD * s["compute_s"] / (
        s["data_s"] + s["compute_s"] + s["optimizer_s"])


def advice_network(advice: dict, overlap: bool) -> advise.Network:
    """The Network an advice JSON ranked with (its recorded α, bucket, codec times, cpu factor)."""
    n = advice["network"]
    return advise.Network(alpha_s=n["alpha_s"], bucket=TokenBucket(burst_bytes=n["burst_bytes"],
                                                                  beta_s_per_byte=n["beta_s_per_byte"]),
                          gamma_s_per_byte=n.get("gamma_s_per_byte", 0.0), codec_s=codec_times(advice),
                          cpu_factor=n["cpu_factor"], alpha_by_algorithm=n.get("alpha_by_algorithm", {}),
                          overlap=overlap)


def method_of(fields: dict) -> advise.Method:
    return advise.Method(strategy=fields["strategy"], algorithm=fields["algorithm"], kind=fields["kind"],
                         compression=fields["compression"], sync_every=fields["sync_every"],
                         outer=fields.get("outer", "average"))


def annotate_same_run(res: dict, out: Path) -> dict:
    """Predict each measured run again with the compute step measured in that same run (the load drifts between runs).

    The communication and codec terms are the adviser's (α under load, bucket, codec measured alone times
    ``contention.cpu_slowdown(ranks, cores)``); only the compute step comes from the run.
    """
    rate = res["rate"]
    advice = json.loads((out / f"advice_{rate}.json").read_text())
    loaded = json.loads((out / f"loaded_{rate}.json").read_text())["loaded"]
    shapes = advice_lib.model_shapes(model=res.get("model", "resnet18"), data=res.get("data", "cifar10"))
    bucket = TokenBucket(burst_bytes=loaded["burst_bytes"], beta_s_per_byte=loaded["beta_s_per_byte"])
    fields = {r["label"]: r for r in advice["ranked"]}
    # codec times measured in the cluster are used as they are; timed here alone, scaled by R/C
    measured_there = str(advice["inputs"].get("codec_s_source", "")).startswith("--codec-times")
    same_run_factor = 1.0 if measured_there else cpu_slowdown(NODES, os.cpu_count() or 1)
    res["same_run_cpu_factor"] = same_run_factor
    for row in res["rows"]:
        f = fields[row["label"]]
        method = advise.Method(strategy=f["strategy"], algorithm=f["algorithm"], kind=f["kind"],
                               compression=f["compression"], sync_every=f["sync_every"], outer=f.get("outer", "average"))
        record = json.loads(Path(row.get("record") or out / "runs" / f"{rate}_{run_name(row['label'])}.json").read_text())
        compute = same_run_compute(record)
        network = advise.Network(alpha_s=loaded["alpha_s"], bucket=bucket, codec_s=codec_times(advice),
                                 cpu_factor=same_run_factor, alpha_by_algorithm=loaded.get("alpha_by_algorithm", {}),
                                 overlap=False)
        workload = advise.Workload(shapes=shapes, workers=NODES, batch_size=res.get("batch_size", 32), compute_s=compute,
                                   backward_share=backward_share(record))
        # same-run, as in runs 1-3: no overlap (kept so that their figures stay reproducible); with the overlap below
        predicted = advise.predict(method, workload, network).step_s
        overlap = advise.predict(method, workload, dataclasses.replace(network, overlap=True))
        row["predicted_overlap_same_run_s"] = overlap.step_s
        row["exposed_overlap_same_run_s"] = overlap.exposed_s
        row["backward_share_same_run"] = workload.backward_share
        row["error_overlap_same_run_pct"] = 100 * (overlap.step_s - row["measured"]["step_s"]) / row["measured"]["step_s"]
        old = advise.predict(method, workload, network.plain(res.get("old_alpha_s", OLD_ALPHA_S))).step_s
        row["predicted_old_same_run_s"] = old
        row["error_old_same_run_pct"] = 100 * (old - row["measured"]["step_s"]) / row["measured"]["step_s"]
        row["compute_same_run_s"] = compute
        row["predicted_same_run_s"] = predicted
        row["error_same_run_pct"] = 100 * (predicted - row["measured"]["step_s"]) / row["measured"]["step_s"]
    res["top3_within_20pct_same_run"] = all(abs(r["error_same_run_pct"]) <= 20 for r in res["rows"]
                                            if r["role"] != "baseline")
    annotate_overlap_at_ranking(res, advice, shapes, out)
    return res


def annotate_overlap_at_ranking(res: dict, advice: dict, shapes, out: Path) -> None:
    """Rank again with the overlap model and the inputs the adviser ranked with (its compute step, α, codec times),
    the backward share from the calibration run's record; its first choice and top 3 against the measured runs."""
    rate = res["rate"]
    compute_record = json.loads((out / "runs" / f"{rate}_compute.json").read_text())
    share = backward_share(compute_record)
    workload = advise.Workload(shapes=shapes, workers=NODES, batch_size=res.get("batch_size", 32),
                               compute_s=advice["workload"]["compute_s"], backward_share=share)
    network = advice_network(advice, overlap=True)
    ranked = advise.rank([advise.predict(method_of(f), workload, network) for f in advice["ranked"]],
                         advice["risk_bound_points"])
    by_label = {p.method.label: p for p in ranked}
    plain = advice_network(advice, overlap=False)
    for row in res["rows"]:
        p = by_label[row["label"]]
        # the same inputs without the overlap (runs 1-3: what the adviser ranked with, reproduced)
        row["predicted_no_overlap_s"] = advise.predict(p.method, workload, plain).step_s
        row["predicted_overlap_s"] = p.step_s
        row["exposed_overlap_s"] = p.exposed_s
        row["error_overlap_pct"] = 100 * (p.step_s - row["measured"]["step_s"]) / row["measured"]["step_s"]
    first = advise.first_choice(ranked)
    top3 = [p.method.label for p in advise.top_distinct(ranked, 3)]
    measured = {r["label"]: r for r in res["rows"]}
    eligible = [r for r in res["rows"] if r["eligible"]]
    fastest = min(eligible, key=lambda r: r["measured"]["step_s"])["label"] if eligible else None
    res["overlap"] = {
        "backward_share": share, "compute_s": workload.compute_s,
        "first_choice": first.method.label if first else None, "top3": top3,
        "top3_all_measured": all(label in measured for label in top3),
        "measured_fastest_eligible": fastest,
        "first_choice_is_measured_fastest": bool(first and first.method.label == fastest),
        "top3_within_20pct": all(label in measured and abs(measured[label]["error_overlap_pct"]) <= 20
                                 for label in top3),
        "top3_within_20pct_same_run": all(label in measured and abs(measured[label]["error_overlap_same_run_pct"]) <= 20
                                          for label in top3),
        "rule": "costmodel.overlap: buckets ready in reverse parameter order at a uniform rate per parameter over the "
                "backward pass (2/3 of the measured forward+backward); one communication thread; the last bucket "
                "never overlaps"}


def overlap_table(results: list[dict]) -> str:
    """Predicted (overlap model) against measured, at ranking time and with each run's own compute step."""
    out = ["# predicted vs measured step time with the overlap of DDP's buckets and the backward pass (costmodel/overlap.py)",
           "# no-overlap: the adviser's prediction without the overlap term (runs 1-3: what it ranked with)",
           "# overlap: the same inputs (compute step of the calibration run, alpha under load, codec times) with the "
           "overlap; same-run: with each run's own compute step and backward share",
           "# backward = 2/3 of the measured forward+backward (FLOP rule); buckets ready in reverse parameter order, "
           "uniform per parameter",
           "# exposed: the predicted communication + codec left after the backward pass (same-run); wait: the measured "
           "one, the least mean communication wait over the ranks (the last to arrive waits only for the collectives)",
           "#",
           f"# {'rate':>7} {'role':<8} {'method':<28} {'measured':>9} {'no-ovl':>9} {'overlap':>9} {'ovl same':>9} "
           f"{'exposed':>9} {'wait':>9} {'err no':>8} {'err ovl':>8} {'err same':>8}",
           f"# {'':>7} {'':<8} {'':<28} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} "
           f"{'(%)':>8} {'(%)':>8} {'(%)':>8}"]
    for res in results:
        ov = res["overlap"]
        for r in res["rows"]:
            no_overlap = r["predicted_no_overlap_s"]
            err_no = 100 * (no_overlap - r["measured"]["step_s"]) / r["measured"]["step_s"]
            out.append(f"  {res['rate']:>7} {r['role']:<8} {r['label']:<28} {1e3 * r['measured']['step_s']:9.1f} "
                       f"{1e3 * no_overlap:9.1f} {1e3 * r['predicted_overlap_s']:9.1f} "
                       f"{1e3 * r['predicted_overlap_same_run_s']:9.1f} {1e3 * r['exposed_overlap_same_run_s']:9.1f} "
                       f"{1e3 * min(r['measured']['comm_wait_s']):9.1f} "
                       f"{err_no:8.1f} {r['error_overlap_pct']:8.1f} {r['error_overlap_same_run_pct']:8.1f}")
        # the 20% criterion is on |error|: the magnitudes, row by row (no-overlap / overlap / overlap same-run)
        out.append(f"# {res['rate']} |error| (%) no-overlap/overlap/same-run: " + ", ".join(
            f"{r['role']} {abs(100 * (r['predicted_no_overlap_s'] - r['measured']['step_s']) / r['measured']['step_s']):.1f}"
            f"/{abs(r['error_overlap_pct']):.1f}/{abs(r['error_overlap_same_run_pct']):.1f}" for r in res["rows"]))
        out.append(f"# {res['rate']}: backward share {ov['backward_share']:.3f} of the compute step "
                   f"{1e3 * ov['compute_s']:.1f} ms; with the overlap the first choice is {ov['first_choice']}, top 3 "
                   f"{ov['top3']} (all measured: {'yes' if ov['top3_all_measured'] else 'NO'}); measured fastest "
                   f"eligible {ov['measured_fastest_eligible']} -> "
                   f"{'same' if ov['first_choice_is_measured_fastest'] else 'DIFFERENT'}; top 3 within 20%: "
                   f"{'yes' if ov['top3_within_20pct'] else 'NO'} (at ranking), "
                   f"{'yes' if ov['top3_within_20pct_same_run'] else 'NO'} (same-run)")
    return "\n".join(out)


def table(results: list[dict]) -> str:
    out = ["# predicted vs measured step time, 4 emulated nodes (one rank each, all on this 2-core host)",
           "# measured: slowest rank's median step after the warm-up (mean for local-sgd); error = (predicted - "
               "measured) / measured",
           "# new = costmodel.advise (alpha under load, token bucket, CPU factor); old = plain alpha-beta "
           f"(alpha {1e6 * OLD_ALPHA_S:.1f} us from {OLD_ALPHA_SOURCE}), no bucket, no CPU factor",
           "#",
           "# new: compute step from the calibration run (what the adviser ranked with); same-run: the compute step "
           "measured in that run itself (data + forward/backward + optimizer, waits excluded), the rest as new but "
           "without the overlap of buckets and backward (as runs 1-3 ranked; with it: check_overlap.txt)",
           "#",
           "# old same-run: the old model with the same-run compute step",
           "#",
           f"# {'rate':>7} {'role':<8} {'method':<28} {'new':>9} {'same-run':>9} {'old':>9} {'old same':>9} "
           f"{'measured':>9} {'err new':>8} {'err same':>8} {'err old':>8} {'err oldS':>8} {'steps':>5}",
           f"# {'':>7} {'':<8} {'':<28} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'(%)':>8} "
           f"{'(%)':>8} {'(%)':>8} {'(%)':>8} {'':>5}"]
    for res in results:
        for r in res["rows"]:
            out.append(f"  {res['rate']:>7} {r['role']:<8} {r['label']:<28} {1e3 * r['predicted_s']:9.1f} "
                       f"{1e3 * r['predicted_same_run_s']:9.1f} {1e3 * r['predicted_old_s']:9.1f} "
                       f"{1e3 * r['predicted_old_same_run_s']:9.1f} {1e3 * r['measured']['step_s']:9.1f} "
                       f"{r['error_pct']:8.1f} {r['error_same_run_pct']:8.1f} {r['error_old_pct']:8.1f} "
                       f"{r['error_old_same_run_pct']:8.1f} {r['measured']['timed_steps']:5d}")
        out.append(f"# {res['rate']}: compute step {1e3 * res['compute']['step_s']:.1f} ms in the cluster "
                   f"({1e3 * res['compute_alone_s']:.1f} ms alone); codec {res.get('codec_source') or 'timed here'}, "
                   f"cpu factor at ranking {res['cpu_factor']:.2f}, same-run {res['same_run_cpu_factor']:.2f}; "
                   f"alpha under load "
                   f"{1e3 * res['loaded']['loaded']['alpha_s']:.2f} ms; first choice {res['first_choice']}; measured "
                   f"fastest eligible {res['measured_fastest_eligible']} -> "
                   f"{'same' if res['first_choice_is_fastest'] else 'DIFFERENT'}; top 3 within 20%: "
                   f"{'yes' if res['top3_within_20pct'] else 'NO'} (new), "
                   f"{'yes' if res['top3_within_20pct_same_run'] else 'NO'} (same-run)")
    return "\n".join(out)


def crossover_report(out: Path) -> str:
    """Old and new model against the measured crossovers of results/cluster/doc001 (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "repro"))
    from analysis import crossover

    from ddtrain.costmodel.alphabeta import LinkParams, predict_time
    from ddtrain.costmodel.loaded import allreduce_seconds
    report = {"source": "results/cluster/doc001/collectives-{4,8}.json", "cases": []}
    lines = ["# ring vs tree / butterfly crossover (smallest size from which ring is at least as fast at every larger "
             "size), 200 Mbit/s emulated links",
             "# old: alpha-beta-gamma with the bench's own calibration (pairwise exchange); new: alpha under load fitted "
             "to the ring's measured times only, bytes through the tbf token bucket (costmodel.loaded, costmodel.burst)",
             "# |err|: median over sizes of |predicted - measured| / measured for tree and butterfly times (not fitted)",
             "#",
             f"# {'nodes':>5} {'pair':<15} {'measured':>10} {'old':>10} {'new':>10} {'old |err|':>10} {'new |err|':>10}",
             f"# {'':>5} {'':<15} {'(KiB)':>10} {'(KiB)':>10} {'(KiB)':>10} {'(%)':>10} {'(%)':>10}"]
    for nodes in (4, 8):
        path = Path(f"results/cluster/doc001/collectives-{nodes}.json")
        data = json.loads(path.read_text())
        rate = data["link_bps"]
        measured: dict[str, dict[int, float]] = {}
        for row in data["rows"]:
            measured.setdefault(row["algorithm"], {})[row["size_bytes"]] = row["time_us"] * 1e-6
        sizes = sorted(measured["ring"])
        cal = data["calibration"]["params"]
        old = LinkParams(alpha_s=cal["alpha_s"], beta_s_per_byte=cal["beta_s_per_byte"],
                         gamma_s_per_byte=cal["gamma_s_per_byte"])
        bucket = TokenBucket(burst_bytes=emulated_burst_bytes(rate), beta_s_per_byte=link_beta(rate))
        # the bench puts a barrier before every call: the bucket has refilled (idle >= the 4 ms burst)
        samples = [CommSample(algorithm="ring", sizes=(m,), ranks=nodes, seconds=measured["ring"][m], idle_s=1.0)
                   for m in sizes]
        fit = fit_loaded(samples, bucket)
        case = {"nodes": nodes, "rate_bps": rate, "old": old.as_dict(), "new": fit.as_dict(),
                "burst_bytes": bucket.burst_bytes, "pairs": {}}
        for other in ("tree", "butterfly"):
            old_t = {a: {m: predict_time(a, m, nodes, old) for m in sizes} for a in ("ring", other)}
            new_t = {a: {m: allreduce_seconds(a, m, nodes, alpha_s=fit.alpha_s, bucket=bucket, idle_s=1.0)
                         for m in sizes} for a in ("ring", other)}
            cross = {name: crossover(sizes, t["ring"], t[other]) for name, t in
                     (("measured", measured), ("old", old_t), ("new", new_t))}
            errors = {name: statistics.median(abs(t[other][m] - measured[other][m]) / measured[other][m] for m in sizes)
                      for name, t in (("old", old_t), ("new", new_t))}
            case["pairs"][f"ring-{other}"] = {"crossover_bytes": cross, "median_abs_error": errors,
                                              "times_s": {"measured": measured[other], "old": old_t[other],
                                                          "new": new_t[other]}}

            def kib(v):
                return "never" if v is None else f"{v / 1024:g}"
            lines.append(f"  {nodes:>5} {'ring vs ' + other:<15} {kib(cross['measured']):>10} {kib(cross['old']):>10} "
                         f"{kib(cross['new']):>10} {100 * errors['old']:10.0f} {100 * errors['new']:10.0f}")
        lines.append(f"# {nodes} nodes: old alpha {1e6 * old.alpha_s:.0f} us, beta {1e9 * old.beta_s_per_byte:.1f} ns/B; "
                     f"new alpha under load {1e6 * fit.alpha_s:.0f} us, beta {1e9 * fit.beta_s_per_byte:.1f} ns/B "
                     f"(the link's), burst {bucket.burst_bytes} B; ring fit residual up to "
                     f"{100 * fit.max_rel_residual:.0f}%")
        report["cases"].append(case)
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "crossover.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "crossover.txt").write_text("$ python experiments/advise_check.py --crossover --out " + str(out) + "\n"
                                       + text + "\n")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/advise")
    parser.add_argument("--rates", default="100mbit,1gbit")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default="cifar10")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out (PowerSGD warms up for 2)")
    parser.add_argument("--compressions", default=advice_lib.DEFAULT_COMPRESSIONS)
    parser.add_argument("--sync-every", default=advice_lib.DEFAULT_INTERVALS)
    parser.add_argument("--crossover", action="store_true", help="only the crossover comparison over committed files")
    parser.add_argument("--codec-worker", action="store_true", help=argparse.SUPPRESS)   # inside cluster run
    parser.add_argument("--codec-out", help=argparse.SUPPRESS)
    parser.add_argument("--reanalyse", action="store_true", help="recompute the predictions and the table from "
                                                                 "<out>/check_<rate>.json and the runs' records")
    a = parser.parse_args()
    if a.codec_worker:
        return codec_worker(a)
    out = Path(a.out)
    if a.crossover:
        print(crossover_report(out))
        return 0
    if a.reanalyse:
        results = []
        for rate in a.rates.split(","):
            res = annotate_same_run(json.loads((out / f"check_{rate}.json").read_text()), out)
            (out / f"check_{rate}.json").write_text(json.dumps(res, indent=2) + "\n")
            results.append(res)
        text = table(results)
        (out / "check.txt").write_text(text + "\n")
        write_overlap(results, out, print)
        print(text)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "check.log").open("a")

    def log(text: str) -> None:
        print(text, flush=True)
        log_file.write(text + "\n")
        log_file.flush()
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')} $ {' '.join(sys.argv)}; load average {os.getloadavg()}")
    results = []
    for rate in a.rates.split(","):
        res = annotate_same_run(check_rate(rate, a, out, log), out)
        (out / f"check_{rate}.json").write_text(json.dumps(res, indent=2) + "\n")
        results.append(res)
    text = table(results)
    (out / "check.txt").write_text(text + "\n")
    log(text)
    write_overlap(results, out, log)
    return 0


def write_overlap(results: list[dict], out: Path, log) -> None:
    text = overlap_table(results)
    (out / "check_overlap.txt").write_text(f"$ python experiments/advise_check.py --reanalyse --out {out}\n" + text + "\n")
    log(text)


if __name__ == "__main__":
    sys.exit(main())
