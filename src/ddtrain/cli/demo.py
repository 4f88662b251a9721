"""``ddtrain demo``: the main job on data that ships with ddtrain.

Trains document 000's Simple-CNN on the bundled 8x8 digits (resized to 28x28) with 1, 2 and
4 worker processes on the CPU, each a fresh ``ddtrain train`` launch, and prints one table.
The per-rank batch is fixed (weak scaling), so more workers take fewer, larger global steps.
Every run gives each worker the same number of threads (``--threads-per-worker``, 1 by default),
so the speed-up compares workers, not threads: with ``cores // workers`` threads each, one
worker had 2 threads and each of several 1, and on a busy machine the 1-worker baseline ran up
to 17x slower than on one thread (issue 32). What the machine allows is said before the first run.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ddtrain.errors import DDTrainError


def add_arguments(p) -> None:
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker counts to compare")
    p.add_argument("--epochs", type=int, default=8, help="epochs per run")
    p.add_argument("--batch-size", type=int, default=32, help="samples per step on each worker")
    p.add_argument("--strategy", default="ddp", help="synchronisation strategy")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="threads of each worker in every run (default: OMP_NUM_THREADS if you set it, else 1), the "
                        "same for every worker count so that the speed-up compares workers, not threads")
    p.add_argument("--out", default="ddtrain-demo", help="folder for the JSON results records")


def threads_per_worker(given: int | None) -> int:
    """``given``, else the user's own OMP_NUM_THREADS (not one an earlier launch in this process set), else 1."""
    if given is not None:
        if given < 1:
            raise DDTrainError(f"--threads-per-worker must be at least 1, got {given}")
        return given
    own = os.environ.get("OMP_NUM_THREADS", "") if os.environ.get("DDTRAIN_SET_OMP_NUM_THREADS") != "1" else ""
    return int(own) if own.isdecimal() and int(own) >= 1 else 1


def machine_notes(counts: list[int], threads: int, cores: int | None, load: float | None) -> list[str]:
    """What the speed-ups can mean on this machine, said before the first run: too few cores for the largest
    worker count, or other programs already busy."""
    notes = [f"# every worker runs {threads} thread(s) (OMP_NUM_THREADS={threads}) at every worker count, so the "
             f"speed-up compares workers, not threads"]
    if not cores:
        return notes
    fits = max(1, cores // threads)
    over = [n for n in counts if n > fits]
    if over:
        notes.append(f"# note: this machine has {cores} CPU core(s): at most {fits} worker(s) of {threads} thread(s) "
                     f"run at once, so {', '.join(f'{n} workers' for n in over)} share cores and their speed-up over "
                     f"{counts[0]} worker(s) cannot pass {fits / counts[0]:g}x")
    if load is not None and load > cores - min(max(counts) * threads, cores) + 1.0:
        notes.append(f"# note: the machine is already busy (1-min load average {load:.1f} on {cores} cores): other "
                     f"programs will take CPU from every run, so the times and speed-ups will be lower and noisier "
                     f"than on an idle machine")
    return notes


def main(args) -> int:
    try:
        counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        raise DDTrainError(f"--workers takes comma-separated integers, got {args.workers!r}") from None
    if not counts or min(counts) < 1:
        raise DDTrainError(f"--workers must all be at least 1, got {args.workers!r}")
    threads = threads_per_worker(getattr(args, "threads_per_worker", None))
    from ddtrain.config import TrainConfig, to_argv   # here, not at the top: --help answers without torch
    from ddtrain.distributed import launch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count()
    print(f"# ddtrain demo: simple-cnn on the bundled digits, {args.epochs} epochs, batch {args.batch_size} "
          f"per worker, strategy {args.strategy}, {cores} CPU cores", flush=True)
    first_load = _loadavg()
    for line in machine_notes(counts, threads, cores, first_load):
        print(line, flush=True)
    rows, loads = [], [("before the first run", first_load, 0)]
    for i, n in enumerate(counts, 1):
        path = out / f"workers{n}.json"
        # rank 0's epoch lines are the progress of a run that takes minutes (issue 32: nothing was printed)
        print(f"# [{i}/{len(counts)}] training with {n} worker(s) x {threads} thread(s) ...", flush=True)
        started = time.perf_counter()
        config = TrainConfig.from_flat(model="simple-cnn", data="digits", epochs=args.epochs, batch_size=args.batch_size,
                                       lr=0.05, momentum=0.9, strategy=args.strategy, out=str(path))
        code = launch.run_local(n, ["train", *to_argv(config)], env={"OMP_NUM_THREADS": str(threads)})
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
        print(f"# [{i}/{len(counts)}] done in {rows[-1][-1]:.1f} s, validation accuracy {rows[-1][3]:.2%}", flush=True)
        loads.append((f"after the {n}-worker run", _loadavg(), n * threads))
    base = rows[0][2]
    print()
    print("# workers  threads/worker  epoch time (s)  samples/s  speed-up  val accuracy  wall (s)")
    for n, epoch_s, rate, acc, wall in rows:
        print(f"  {n:>7}  {threads:>14}  {epoch_s:>14.2f}  {rate:>9.0f}  {rate / base:>8.2f}  {acc:>12.2%}  {wall:>8.1f}")
    print(f"# epoch time and samples/s: median over epochs 2..{args.epochs}; speed-up: samples/s over the "
          f"{counts[0]}-worker run, every worker on {threads} thread(s)")
    from ddtrain.bench.scaling import load_warnings
    for line in load_warnings([("demo", n, counts[0], rate / base) for n, _, rate, _, _ in rows[1:]], loads,
                              cores):
        print(line)
    print(f"# results records (JSON): {out.resolve()}/; figures: ddtrain report {out}")
    return 0


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # not available on this platform
        return None
