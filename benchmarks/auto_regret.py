"""``--strategy auto`` against the grid of fixed choices on one emulated cluster: its regret (issue 35).

    sudo PYTHONPATH=src python3 benchmarks/auto_regret.py --link 100mbit --out results/auto/regret_100mbit.json
    sudo PYTHONPATH=src python3 benchmarks/auto_regret.py --link 1gbit --out results/auto/regret_1gbit.json
    sudo PYTHONPATH=src python3 benchmarks/auto_regret.py --link 100mbit --change-to 1gbit --change-at-s 40 \\
        --out results/auto/regret_change.json

One emulated cluster (``ddtrain.cluster``: 3 nodes, one rank each, every byte between them through a
tbf-limited veth) runs, interleaved and ``--repeats`` times, every arm on the same command: ``ddtrain
train`` of ``--model`` on MNIST's t10k file (8,000 train, 2,000 validate), batch 32 a rank, SGD lr 0.05
momentum 0.9, ``--steps`` steps. The arms: ``ddp``; ``powersgd`` (ddp --compression powersgd:4);
``diloco`` (local-sgd --outer-optimizer nesterov --sync-every 20); ``auto`` (--strategy auto
--auto-allow ``--auto-allow``); ``auto-exact`` (--strategy auto, the default eligibility) when listed
in ``--arms``. Before every run the links are set back to ``--link``; with ``--change-to`` a timer
sets them to that rate ``--change-at-s`` seconds after the job starts (``tc qdisc replace``, both
directions of every node's link), the same for every arm.

Per run: the job's wall time, the training time (the record's epoch time, which includes auto's
calibration and trials, excludes start-up and validation), the final validation accuracy, and auto's
record (predictions, trials, switches, choice, selection seconds). The summary: per arm, the median
over repeats; the best fixed arm; auto's regret = its median training time / the best fixed arm's - 1;
its selection overhead = selection seconds / training time; accuracy against ddp's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from ddtrain.cluster import netns  # noqa: E402
from ddtrain.cluster.run import emulated_cluster, run_in_cluster  # noqa: E402

MNIST = "/work/shared/data/mnist"
ARMS = {
    "ddp": ["--strategy", "ddp"],
    "powersgd": ["--strategy", "ddp", "--compression", "powersgd:4"],
    "diloco": ["--strategy", "local-sgd", "--outer-optimizer", "nesterov", "--sync-every", "20"],
    "auto": ["--strategy", "auto"],          # + --auto-allow
    "auto-exact": ["--strategy", "auto"],
}
FIXED = ("ddp", "powersgd", "diloco")


def set_rate(cluster, bps: int) -> None:
    """Every node's link, both directions, to ``bps`` (what ``netns.create`` set up, replaced)."""
    for node in cluster.nodes:
        there = f"ddt{cluster.run_id.rsplit('-', 1)[1]}b{node.index}"   # its bridge-side peer (netns.create's name)
        for namespace, interface in ((node.namespace, node.interface), (cluster.bridge_namespace, there)):
            subprocess.run(netns._tbf(namespace, interface, bps), check=True, capture_output=True, timeout=30)


def one_run(cluster, arm: str, a, seed: int, tmp: str, base_bps: int, change_bps: int | None) -> dict:
    out = f"{tmp}/{arm}_{seed}_{time.monotonic_ns()}.json"
    command = ["ddtrain", "train", "--model", a.model, "--data", f"mnist:{a.mnist}", "--batch-size", "32",
               "--lr", "0.05", "--momentum", "0.9", "--val-fraction", "0.2", "--steps", str(a.steps),
               "--seed", str(seed), *ARMS[arm], "--out", out]
    if arm == "auto":
        command[-2:-2] = ["--auto-allow", a.auto_allow]
    if arm.startswith("auto"):
        command[-2:-2] = ["--auto-trial-steps", str(a.trial_steps)]
    set_rate(cluster, base_bps)
    timer = None
    if change_bps:
        timer = threading.Timer(a.change_at_s, set_rate, (cluster, change_bps))
        timer.start()
    log = Path(f"{out}.log")
    with log.open("w") as handle:
        result = run_in_cluster(cluster, command, timeout_s=a.timeout_s, stdout=handle, stderr=subprocess.STDOUT)
    if timer is not None:
        timer.cancel()
    if result.returncode != 0:
        raise SystemExit(f"{arm} failed ({result.returncode}):\n{log.read_text()[-3000:]}")
    record = json.loads(Path(out).read_text())
    row = {"arm": arm, "seed": seed, "wall_s": round(result.wall_s, 2),
           "train_s": round(sum(e["time_s"] for e in record["epochs"]), 3),
           "steps": sum(e["steps"] for e in record["epochs"]),
           "val_accuracy": record["final"].get("val_accuracy"), "command": " ".join(command[:-2]),
           "log_tail": [line for line in log.read_text().splitlines() if line.startswith("auto:")]}
    if "auto" in record:
        auto = record["auto"]
        row["auto"] = {k: auto[k] for k in ("choice", "choices", "trials", "switches", "rechecks", "selection_s",
                                            "calibrations", "allow") if k in auto}
        row["auto"]["predicted_top"] = [p["ranked"][:8] for p in auto["predicted"]]
        row["auto"]["step_times"] = auto["step_times"]
        row["selection_overhead"] = auto["selection_s"] / row["train_s"]
    return row


def summarise(runs: list[dict], arms: list[str]) -> dict:
    per_arm = {}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        per_arm[arm] = {"train_s_median": statistics.median(r["train_s"] for r in mine),
                        "train_s": [r["train_s"] for r in mine],
                        "val_accuracy_median": statistics.median(r["val_accuracy"] for r in mine),
                        "val_accuracy": [r["val_accuracy"] for r in mine]}
        if arm.startswith("auto"):
            per_arm[arm]["selection_overhead_median"] = statistics.median(r["selection_overhead"] for r in mine)
            per_arm[arm]["choices"] = [r["auto"]["choice"]["label"] for r in mine]
            per_arm[arm]["switches"] = [[(s["step"], s["to"], s["why"]) for s in r["auto"]["switches"]] for r in mine]
    fixed = [a for a in arms if a in FIXED]
    best = min(fixed, key=lambda a: per_arm[a]["train_s_median"]) if fixed else None
    out = {"per_arm": per_arm, "best_fixed": best}
    for arm in arms:
        if arm.startswith("auto") and best:
            s = per_arm[arm]
            s["regret"] = s["train_s_median"] / per_arm[best]["train_s_median"] - 1
            s["beats_every_fixed"] = all(s["train_s_median"] < per_arm[f]["train_s_median"] for f in fixed)
            if "ddp" in per_arm:
                s["accuracy_points_vs_ddp"] = 100 * (per_arm["ddp"]["val_accuracy_median"] - s["val_accuracy_median"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--change-to", default=None, help="a rate the links change to mid-run")
    p.add_argument("--change-at-s", type=float, default=40.0, help="seconds after each job's start")
    p.add_argument("--model", default="simple-cnn")
    p.add_argument("--mnist", default=MNIST)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--arms", default="ddp,powersgd,diloco,auto")
    p.add_argument("--auto-allow", default="powersgd,local-sgd")
    p.add_argument("--trial-steps", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=1200)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    for arm in arms:
        if arm not in ARMS:
            raise SystemExit(f"--arms: unknown arm {arm!r}; known: {', '.join(ARMS)}")
    base, change = netns.parse_rate(a.link), netns.parse_rate(a.change_to) if a.change_to else None
    runs = []
    with tempfile.TemporaryDirectory(prefix="auto_regret_") as tmp, emulated_cluster(3, base) as cluster:
        os.chmod(tmp, 0o777)
        for rep in range(a.repeats):          # interleaved: every arm once per repeat, the load shared alike
            for arm in arms:
                row = one_run(cluster, arm, a, rep, tmp, base, change)
                runs.append(row)
                print(f"# {rep} {arm:>10}: train {row['train_s']:7.2f} s, wall {row['wall_s']:7.2f} s, "
                      f"val_accuracy {row['val_accuracy']:.4f}"
                      + (f", chose {row['auto']['choice']['label']}, selection {100 * row['selection_overhead']:.1f} %"
                         if "auto" in row else ""), flush=True)
    result = {"link": a.link, "change_to": a.change_to, "change_at_s": a.change_at_s if change else None,
              "nodes": 3, "procs_per_node": 1, "model": a.model, "steps": a.steps, "repeats": a.repeats,
              "auto_allow": a.auto_allow, "trial_steps": a.trial_steps, "runs": runs,
              "summary": summarise(runs, arms),
              "machine": subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip(),
              "cpus": len(os.sched_getaffinity(0)),
              "note": "2-core machine shared with other jobs: timings are noisy; medians of interleaved repeats"}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
