"""``--balance speed`` against equal shares in the emulated cluster, arms interleaved, repeated (docs/BALANCE.md).

    sudo PYTHONPATH=src python benchmarks/balance_cluster.py --nodes 2 --node-cpu 1=0.25 \\
        --arms measure,speed --repeats 3 --out results/balance/two_nodes_quarter_cpu.json
    sudo PYTHONPATH=src python benchmarks/balance_cluster.py --nodes 3 --node-cpu 0=0.8 --node-cpu 1=0.4 \\
        --node-cpu 2=0.2 --arms measure,speed --repeats 3 --out results/balance/three_speeds.json
    sudo PYTHONPATH=src python benchmarks/balance_cluster.py --nodes 2 --arms none,speed --repeats 5 \\
        --out results/balance/equal_nodes_cost.json

Each run is ``ddtrain cluster run ... -- ddtrain train --balance ARM`` (simple-cnn without dropout
on MNIST, a fixed global batch, a fixed number of steps); the arms alternate within a repeat (the
order flips every repeat), so a load that comes and goes on the machine falls on both. Reported per
arm: the median training time (the record's epoch time, start-up excluded) and the median wall
time of the whole job; every run's final parameters are compared with the first run's (max
absolute difference: the step is the same whatever the shares). Writes every run's record
section ``balance`` and the summary to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def one_run(args, arm: str, folder: str, index, steps: int) -> dict:
    record, model = os.path.join(folder, f"{arm}{index}.json"), os.path.join(folder, f"{arm}{index}.pt")
    command = [sys.executable, "-m", "ddtrain", "cluster", "run", "--nodes", str(args.nodes), "--link", args.link,
               *[f"--node-cpu={c}" for c in args.node_cpu], "--",
               "ddtrain", "train", "--model", "simple-cnn", "--model-arg", "dropout=0", "--data", args.data,
               "--val-fraction", "0", "--global-batch-size", str(args.global_batch), "--steps", str(steps),
               "--balance", arm, "--balance-every", str(args.every), "--seed", "1", "--quiet",
               "--out", record, "--save", model]
    start = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
    wall = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"run failed ({arm}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(record) as f:
        rec = json.load(f)
    return {"arm": arm, "repeat": index, "train_s": sum(e["time_s"] for e in rec["epochs"]), "wall_s": round(wall, 3),
            "balance": rec.get("balance"), "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--node-cpu", action="append", default=[])
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--data", default="mnist:/work/shared/data/mnist")
    parser.add_argument("--global-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--arms", default="measure,speed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="OMP_NUM_THREADS of every rank (0: the cluster's)")
    parser.add_argument("--check-steps", type=int, default=10,
                        help="also one short run per arm, parameters compared there (before float32 rounding, "
                             "amplified by training, reaches 1e-5); 0: none")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    arms = args.arms.split(",")
    folder = tempfile.mkdtemp(prefix="ddtrain-balance-")
    runs = []
    try:
        for repeat in range(args.repeats):
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                runs.append(one_run(args, arm, folder, repeat, args.steps))
                print(f"# repeat {repeat} {arm:>8}: train {runs[-1]['train_s']:.2f} s, wall {runs[-1]['wall_s']:.2f} s",
                      flush=True)
        checks = [one_run(args, arm, folder, "check", args.check_steps) for arm in arms] if args.check_steps else []
        for group in (runs, checks):
            reference = torch.load(group[0]["model"]) if group else None
            for run in group:
                params = torch.load(run.pop("model"))
                run["max_abs_diff"] = max((params[k] - reference[k]).abs().max().item() for k in reference)
                run["max_relative_diff"] = max(((params[k] - reference[k]).abs().max() /
                                                reference[k].abs().max().clamp_min(1e-12)).item() for k in reference)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = {arm: {"median_train_s": statistics.median(r["train_s"] for r in runs if r["arm"] == arm),
                     "median_wall_s": statistics.median(r["wall_s"] for r in runs if r["arm"] == arm)} for arm in arms}
    base, other = arms[0], arms[-1]
    summary["train_speedup"] = summary[base]["median_train_s"] / summary[other]["median_train_s"]
    summary["wall_speedup"] = summary[base]["median_wall_s"] / summary[other]["median_wall_s"]
    summary["max_abs_diff"] = max(r["max_abs_diff"] for r in runs)
    summary["check_steps"] = args.check_steps
    summary["check_max_abs_diff"] = max((r["max_abs_diff"] for r in checks), default=None)
    summary["check_max_relative_diff"] = max((r["max_relative_diff"] for r in checks), default=None)
    print(f"# {'arm':>8} {'median_train_s':>14} {'median_wall_s':>13}")
    for arm in arms:
        print(f"  {arm:>8} {summary[arm]['median_train_s']:>14.2f} {summary[arm]['median_wall_s']:>13.2f}")
    print(f"# {base}/{other}: training {summary['train_speedup']:.3f}x, wall {summary['wall_speedup']:.3f}x; "
          f"parameters: max |difference| from the first run {summary['max_abs_diff']:.3g}")
    if checks:
        print(f"# {args.check_steps}-step runs: parameters' max |difference| {summary['check_max_abs_diff']:.3g}, "
              f"relative to each tensor's largest value {summary['check_max_relative_diff']:.3g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"command": sys.argv, "settings": vars(args), "machine": {"cpus": os.cpu_count(),
                   "load_avg_at_end": os.getloadavg(), "note": "2 cores shared with other jobs"},
                   "summary": summary, "runs": runs, "checks": checks}, f, indent=1)


if __name__ == "__main__":
    main()
