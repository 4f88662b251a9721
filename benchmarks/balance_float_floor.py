"""How far float32 rounding alone moves the parameters, next to what unequal shares move them (docs/BALANCE.md).

    PYTHONPATH=src python benchmarks/balance_float_floor.py --out results/balance/float_floor.json
    PYTHONPATH=src python benchmarks/balance_float_floor.py --device cuda --out results/balance/float_floor_gpu.json

Three runs of the same training (simple-cnn without dropout on MNIST, global batch 128, the same
seed and steps): one process; two workers with equal shares; two workers with ``--balance speed
--balance-every 2`` (shares move with the measured noise). All three are the same mathematics;
only the summation order differs. Prints and writes the max |difference| of every pair, so the
balanced run's distance from the uniform one can be read against the uniform run's own distance
from one process (the equivalence ddtrain already claims). On a GPU machine (``--device cuda`` labels the
record) ddtrain puts the workers on two GPUs and ``--balance speed`` times with CUDA events.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def train(args, folder: str, name: str, nproc: int, extra: list[str]) -> dict:
    model, record = os.path.join(folder, f"{name}.pt"), os.path.join(folder, f"{name}.json")
    command = [sys.executable, "-m", "ddtrain", "train", "--nproc", str(nproc), "--model", "simple-cnn",
               "--model-arg", "dropout=0", "--data", args.data, "--global-batch-size", "128",
               "--steps", str(args.steps), "--val-fraction", "0", "--seed", "1", "--quiet", "--save", model,
               "--out", record, *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    with open(record) as f:
        rec = json.load(f)
    return {"params": torch.load(model, map_location="cpu"), "balance": rec.get("balance"),
            "train_s": sum(e["time_s"] for e in rec["epochs"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="mnist:/work/shared/data/mnist")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="a label for the record: ddtrain trains on CUDA (NCCL) wherever every rank has a GPU")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddtrain-floor-") as folder:
        runs = {"one_process": train(args, folder, "one", 1, []),
                "uniform_2": train(args, folder, "uniform", 2, []),
                "balanced_2": train(args, folder, "balanced", 2, ["--balance", "speed", "--balance-every", "2"])}
    pairs = {}
    for a, b in (("uniform_2", "one_process"), ("balanced_2", "one_process"), ("balanced_2", "uniform_2")):
        x, y = runs[a]["params"], runs[b]["params"]
        pairs[f"{a} vs {b}"] = max((x[k] - y[k]).abs().max().item() for k in x)
    history = runs["balanced_2"]["balance"]["history"]
    out = {"command": sys.argv, "steps": args.steps, "device": args.device, "max_abs_diff": pairs,
           "balanced_shares": [(h["step"], h["shares"], h.get("new_shares")) for h in history],
           "train_s": {name: run["train_s"] for name, run in runs.items()}}
    print(f"# {'pair':<28} {'max_abs_diff':>12}   ({args.steps} steps, {args.device})")
    for pair, value in pairs.items():
        print(f"  {pair:<28} {value:>12.3g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
