"""DiLoCo-style local SGD against ddp on MNIST (issue 19, acceptance 4): accuracy within 1 point, >= 10x fewer bytes.

    python3 experiments/diloco_check.py accuracy    # 4 local ranks, 3 seeds: results/diloco/accuracy.json
    python3 experiments/diloco_check.py cluster     # 4 emulated nodes at 100 Mbit/s (root): results/diloco/cluster_100mbit.json
    python3 experiments/diloco_check.py cluster --methods ddp diloco adaptive --epochs 2 --out /tmp/c.json

Both: ``ddtrain train`` of the mlp (784-128-128-10) on MNIST's t10k file (the one in
/work/shared/data/mnist: 8,000 images train, the other 2,000 validate, ``--val-fraction 0.2``),
4 workers, batch 32 per rank (global 128), SGD lr 0.05 momentum 0.9, the same epochs for every
method. Methods: ``ddp`` (gradients all-reduced every step), ``diloco`` (``local-sgd
--outer-optimizer nesterov --sync-every 20``: outer lr 0.7, momentum 0.9), ``average``
(``local-sgd --sync-every 20``, plain averaging) and ``adaptive`` (``diloco`` with
``--adaptive-interval`` from K=4). Bytes are each record's traffic counters (``comm[*].bytes_sent``,
mean over the ranks): counted for local-sgd, by formula for ddp (the native all-reduce cannot be
observed; 2(R-1)/R of the gradient bytes a step, what the ring sends). The checks: the mean
final validation accuracy of ``diloco`` at most 1 point below ``ddp``'s, and ddp's bytes at
least 10x diloco's. ``accuracy`` runs on ``--nproc 4`` on this machine (the bytes do not depend
on the link); ``cluster`` runs the same commands under ``ddtrain cluster run --nodes 4 --link
100mbit`` (one rank per node) and adds the wall time per epoch.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from train_record import train, write_result   # experiments/train_record.py, beside this script

REPO = Path(__file__).resolve().parent.parent
MNIST = "/work/shared/data/mnist"
COMMON = ["--model", "mlp", "--batch-size", "32", "--lr", "0.05", "--momentum", "0.9", "--val-fraction", "0.2",
          "--quiet"]
METHODS = {
    "ddp": ["--strategy", "ddp"],
    "diloco": ["--strategy", "local-sgd", "--outer-optimizer", "nesterov", "--sync-every", "20"],
    "average": ["--strategy", "local-sgd", "--sync-every", "20"],
    "adaptive": ["--strategy", "local-sgd", "--outer-optimizer", "nesterov", "--sync-every", "4",
                 "--adaptive-interval"],
}


def row(method: str, seed: int, record: dict, wall: float, command: list[str]) -> dict:
    workers = [c for c in record["comm"] if c["role"] == "worker"]
    first = workers[0]
    out = {"method": method, "seed": seed, "val_accuracy": record["final"]["val_accuracy"],
           "epochs": len(record["epochs"]), "steps": sum(e["steps"] for e in record["epochs"]),
           "bytes_sent_mean": statistics.mean(c["bytes_sent"] for c in workers), "bytes_method": first["method"],
           "epoch_time_s": [round(e["time_s"], 2) for e in record["epochs"]], "wall_s": round(wall, 1),
           "command": shlex.join(command)}
    if "averagings" in first:       # local-sgd's choices (docs/PERFORMANCE.md, "local-sgd's record")
        out.update({k: first[k] for k in ("averagings", "bytes_per_averaging", "outer_optimizer", "outer_lr",
                                          "outer_momentum", "local_sgd_warmup_steps", "interval_mean")})
        out["intervals"] = [e["interval"] for e in first["averaging_log"]]
        out["relative_divergence"] = [round(e["relative_divergence"], 4) for e in first["averaging_log"]]
        out["averaging_s"] = [round(e["averaging_s"], 4) for e in first["averaging_log"]]
        out["step_s"] = [round(e["step_s"], 4) for e in first["averaging_log"]]
    return out


def run(args, cluster: bool) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="diloco_") as tmp:
        os.chmod(tmp, 0o777)         # the cluster's workers may write the record as another user
        for seed in args.seeds:
            for method in args.methods:
                out = f"{tmp}/{method}_{seed}.json"
                train_args = ["ddtrain", "train", *COMMON, "--data", f"mnist:{args.mnist}", *METHODS[method],
                              "--epochs", str(args.epochs), "--seed", str(seed)]
                if cluster:
                    command = ["ddtrain", "cluster", "run", "--nodes", "4", "--link", args.link,
                               "--timeout-s", "1500", "--", *train_args, "--out", out]
                else:
                    command = [*train_args[:2], "--nproc", "4", *train_args[2:], "--out", out]
                record, wall = train(command, 1800)
                runs.append(row(method, seed, record, wall, command[:-2]))
                r = runs[-1]
                print(f"{method:>9} seed {seed}: val_accuracy {r['val_accuracy']:.4f}  bytes_sent/rank "
                      f"{r['bytes_sent_mean']:>12.0f}  epochs {r['epochs']}  {wall:.0f}s", flush=True)
    means = {m: statistics.mean(r["val_accuracy"] for r in runs if r["method"] == m) for m in args.methods}
    sent = {m: statistics.mean(r["bytes_sent_mean"] for r in runs if r["method"] == m) for m in args.methods}
    epoch_s = {m: statistics.median(t for r in runs if r["method"] == m for t in r["epoch_time_s"])
               for m in args.methods}
    base = "ddp" if "ddp" in means else None
    summary = {m: {"mean_val_accuracy": means[m], "seeds": len(args.seeds), "bytes_sent_per_rank": sent[m],
                   "median_epoch_time_s": epoch_s[m],
                   "gap_points": None if base is None else round(100 * (means[m] - means[base]), 3),
                   "bytes_ratio_ddp_over_this": None if base is None else round(sent[base] / sent[m], 2)}
               for m in args.methods}
    print("# method    mean val acc (%)  gap to ddp (points)  bytes sent/rank  ddp bytes / these  median epoch (s)")
    for m, s in summary.items():
        print(f"{m:>9} {100 * s['mean_val_accuracy']:>17.2f} {s['gap_points']!s:>20} {s['bytes_sent_per_rank']:>16.0f} "
              f"{s['bytes_ratio_ddp_over_this']!s:>18} {s['median_epoch_time_s']:>17.2f}")
    result = {"what": "ddp vs DiLoCo-style local SGD (K=20) on MNIST, issue 19 acceptance 4",
              "where": f"4 emulated nodes at {args.link} (ddtrain cluster run)" if cluster else "4 local ranks",
              "settings": COMMON + ["--data", f"mnist:{args.mnist}", "--epochs", str(args.epochs)],
              "methods": {m: METHODS[m] for m in args.methods}, "seeds": args.seeds, "runs": runs, "summary": summary}
    if base and "diloco" in summary:
        d = summary["diloco"]
        result["check"] = {"within_1_point": d["gap_points"] >= -1.0, "at_least_10x_fewer_bytes":
                           d["bytes_ratio_ddp_over_this"] >= 10}
        print(f"# diloco: {d['gap_points']:+.2f} points against ddp (check: >= -1), "
              f"{d['bytes_ratio_ddp_over_this']}x fewer bytes (check: >= 10): {result['check']}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="where", required=True)
    for name, seeds, methods in (("accuracy", [0, 1, 2], ["ddp", "diloco", "average"]),
                                 ("cluster", [0, 1, 2], ["ddp", "diloco", "average", "adaptive"])):
        p = sub.add_parser(name)
        p.add_argument("--seeds", type=int, nargs="+", default=seeds)
        p.add_argument("--methods", nargs="+", choices=list(METHODS), default=methods)
        p.add_argument("--epochs", type=int, default=5)
        p.add_argument("--mnist", default=MNIST)
        p.add_argument("--link", default="100mbit")
        p.add_argument("--out", default=str(REPO / ("results/diloco/accuracy.json" if name == "accuracy"
                                                    else "results/diloco/cluster_100mbit.json")))
    args = parser.parse_args()
    result = run(args, cluster=args.where == "cluster")
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
