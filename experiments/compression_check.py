"""--compression checked two ways (issue 19, acceptance 1): accuracy against uncompressed, and speed on a slow link.

    python3 experiments/compression_check.py accuracy     # writes results/compression/accuracy.json
    python3 experiments/compression_check.py speed        # writes results/compression/speed_100mbit.json (root: netns)
    python3 experiments/compression_check.py accuracy --seeds 0 --methods none fp16 --out /tmp/acc.json

accuracy: simple-cnn on the bundled 8x8 digits, 2 workers (``ddtrain train --nproc 2``,
strategy ddp), batch 32 per rank, lr 0.05, momentum 0.9, 6 epochs, seeds 0 1 2; every
method's final validation accuracy, the mean over the seeds and its gap to ``none``'s mean
(the check: within 1 point).

speed: ResNet-18 on synthetic CIFAR-10 on 4 emulated nodes joined by 100 Mbit/s links
(``ddtrain cluster run --nodes 4 --link 100mbit``), one rank per node, batch 4 per rank,
``--profile``; ``ddp`` uncompressed and ``ddp --compression powersgd:4`` (default warm-up of 10
uncompressed steps) in the same run of this script. The step time is the slowest rank's median
over the steps after the profile warm-up (``profile.ranks[*].step_time_median_s``; how many
steps: ``timed_steps``); the check: PowerSGD's at least 3x shorter.
Each run's record (the ``ddtrain train --out`` file) is kept whole in the output JSON.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from train_record import train, write_result   # experiments/train_record.py, beside this script

REPO = Path(__file__).resolve().parent.parent
ACCURACY = ["--nproc", "2", "--strategy", "ddp", "--model", "simple-cnn", "--data", "digits", "--batch-size", "32",
            "--lr", "0.05", "--momentum", "0.9", "--epochs", "6", "--quiet"]
METHODS = ["none", "fp16", "bf16", "powersgd:4", "topk:0.1"]
SPEED = ["--strategy", "ddp", "--model", "resnet18", "--data", "synthetic:cifar10", "--batch-size", "4", "--quiet",
         "--profile"]
SPEED_RUNS = {"none": (8, 3), "powersgd:4": (18, 12)}     # method -> (--steps, --profile-warmup-steps)


def accuracy(args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for method in args.methods:
                out = f"{tmp}/{method.replace(':', '_')}_{seed}.json"
                command = ["ddtrain", "train", *ACCURACY, "--compression", method, "--seed", str(seed), "--out", out]
                record, wall = train(command, 1800)
                row = {"method": method, "seed": seed, "val_accuracy": record["final"]["val_accuracy"],
                       "bytes_sent_rank0": record["comm"][0]["bytes_sent"], "wall_s": round(wall, 1),
                       "command": shlex.join(command[:-2])}
                runs.append(row)
                print(f"{method:>12} seed {seed}: val_accuracy {row['val_accuracy']:.4f}  "
                      f"bytes_sent(rank 0) {row['bytes_sent_rank0']:>12}  {wall:.0f}s", flush=True)
    means = {m: statistics.mean(r["val_accuracy"] for r in runs if r["method"] == m) for m in args.methods}
    base = means.get("none")
    summary = {m: {"mean_val_accuracy": means[m], "seeds": len(args.seeds),
                   "gap_points": None if base is None else round(100 * (means[m] - base), 3),
                   "within_1_point": None if base is None else 100 * (base - means[m]) <= 1.0} for m in args.methods}
    print("# method        mean val acc (%)   gap to none (points)   within 1 point")
    for m, s in summary.items():
        print(f"{m:>14} {100 * s['mean_val_accuracy']:>18.2f} {s['gap_points'] if s['gap_points'] is not None else '-':>22} "
              f"{s['within_1_point']!s:>16}")
    return {"what": "final validation accuracy per --compression method, mean over seeds (issue 19 acceptance 1)",
            "settings": ACCURACY, "seeds": args.seeds, "runs": runs, "summary": summary}


def speed(args) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method, (steps, warmup) in SPEED_RUNS.items():
            out = f"{tmp}/{method.replace(':', '_')}.json"
            command = ["ddtrain", "cluster", "run", "--nodes", "4", "--link", args.link, "--timeout-s", "900", "--",
                       "ddtrain", "train", *SPEED, "--compression", method, "--steps", str(steps),
                       "--profile-warmup-steps", str(warmup), "--out", out]
            record, wall = train(command, 1000)
            ranks = [r for r in record["profile"]["ranks"] if r["role"] == "worker"]
            median = max(r["step_time_median_s"] for r in ranks)
            runs[method] = {"command": shlex.join(command[:-2]), "wall_s": round(wall, 1),
                            "step_time_median_s": median, "timed_steps": min(r["timed_steps"] for r in ranks),
                            "per_rank_step_time_median_s": [r["step_time_median_s"] for r in ranks],
                            "bytes_sent_rank0": record["comm"][0]["bytes_sent"], "record": record}
            print(f"{method:>12}: median step {median:.3f} s over {runs[method]['timed_steps']} steps after "
                  f"{warmup} warm-up steps (slowest rank); rank 0 sent {runs[method]['bytes_sent_rank0']} bytes; "
                  f"{wall:.0f}s", flush=True)
    ratio = runs["none"]["step_time_median_s"] / runs["powersgd:4"]["step_time_median_s"]
    print(f"# ddp / ddp+powersgd:4 median step time: {ratio:.2f}x (check: >= 3)")
    return {"what": "ddp vs ddp --compression powersgd:4, ResNet-18 on synthetic CIFAR-10, 4 emulated nodes "
                    f"at {args.link} (issue 19 acceptance 1)", "link": args.link, "runs": runs,
            "speedup": ratio, "at_least_3x": ratio >= 3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    acc.add_argument("--methods", nargs="+", default=METHODS)
    acc.add_argument("--out", default=str(REPO / "results/compression/accuracy.json"))
    spd = sub.add_parser("speed")
    spd.add_argument("--link", default="100mbit")
    spd.add_argument("--out", default=str(REPO / "results/compression/speed_100mbit.json"))
    args = parser.parse_args()
    result = accuracy(args) if args.what == "accuracy" else speed(args)
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
