"""``ddtrain demo``: the main job on data that ships with ddtrain.

Trains document 000's Simple-CNN on the bundled 8x8 digits (resized to 28x28) with 1, 2 and
4 worker processes on the CPU, each a fresh ``ddtrain train`` launch, and prints one table.
The per-rank batch is fixed (weak scaling), so more workers take fewer, larger global steps.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ddtrain.config import TrainConfig, to_argv
from ddtrain.distributed import launch
from ddtrain.errors import DDTrainError


def add_arguments(p) -> None:
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker counts to compare")
    p.add_argument("--epochs", type=int, default=8, help="epochs per run")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step on each worker")
    p.add_argument("--strategy", default="ddp", help="synchronisation strategy")
    p.add_argument("--out", default="ddtrain-demo", help="folder for the JSON results records")


def main(args) -> int:
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise DDTrainError(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    if not counts or min(counts) < 1:
        raise DDTrainError(f"--workers must all be at least 1, got {args.workers!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"# ddtrain demo: simple-cnn on the bundled digits, {args.epochs} epochs, batch {args.batch_size} "
          f"per worker, strategy {args.strategy}, {os.cpu_count()} CPU cores", flush=True)
    rows, loads = [], [("before the first run", _loadavg(), 0)]
    for i, n in enumerate(counts, 1):
        path = out / f"workers{n}.json"
        print(f"# [{i}/{len(counts)}] training with {n} worker(s) ...", end=" ", flush=True)
        started = time.perf_counter()
        config = TrainConfig.from_flat(model="simple-cnn", data="digits", epochs=args.epochs, batch_size=args.batch_size,
                             lr=0.05, momentum=0.9, strategy=args.strategy, quiet=True, out=str(path))
        code = launch.run_local(n, ["train", *to_argv(config)])
        if code != 0:
            print(f"ddtrain demo: the {n}-worker run failed (exit code {code})", file=sys.stderr)
            return code
        record = json.loads(path.read_text())
        epochs = record["epochs"]
        later = epochs[1:] or epochs  # the first epoch includes start-up costs
        epoch_s = sorted(e["time_s"] for e in later)[len(later) // 2]
        rate = sorted(e["samples_per_s"] for e in later)[len(later) // 2]
        rows.append((n, epoch_s, rate, record["final"].get("val_accuracy", float("nan")),
                     time.perf_counter() - started))
        print(f"done in {rows[-1][-1]:.1f} s, validation accuracy {rows[-1][3]:.2%}", flush=True)
        loads.append((f"after the {n}-worker run", _loadavg(), n))
    base = rows[0][2]
    print()
    print("# workers  epoch time (s)  samples/s  speed-up  val accuracy  wall (s)")
    for n, epoch_s, rate, acc, wall in rows:
        print(f"  {n:>7}  {epoch_s:>14.2f}  {rate:>9.0f}  {rate / base:>8.2f}  {acc:>12.2%}  {wall:>8.1f}")
    print(f"# epoch time and samples/s: median over epochs 2..{args.epochs}; speed-up: samples/s over the "
          f"{counts[0]}-worker run")
    from ddtrain.bench.scaling import load_warnings
    for line in load_warnings([("demo", n, counts[0], rate / base) for n, _, rate, _, _ in rows[1:]], loads,
                              os.cpu_count()):
        print(line)
    print(f"# results records (JSON): {out.resolve()}/")
    return 0


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
