"""``ddtrain bench scaling``: throughput, speed-up and the step split over a matrix of runs.

    ddtrain bench scaling --model simple-cnn --data synthetic:mnist --strategies ddp,ring,ps-sync \\
                          --workers 1,2,4 --steps 30 --out results/
    ddtrain report results/

One fresh launch per cell (strategy x workers x batch size x loader workers x precision): a new
Python process runs ``ddtrain.launch.run_local`` of ``ddtrain train ... --profile`` (so every
cell starts cold, with its own process group and thread settings), writes its results record
to ``DIR/cells/<cell>.json`` and its output to ``<cell>.log``. ``--warmup-steps`` steps run
first and are left out of every time. Workers are the ranks that train on data; ``ps-*``
strategies add ``--servers`` parameter-server ranks on top (4 workers + 1 server = 5 ranks), as
document 002 counts them. ``DIR/scaling.json`` holds every figure; docs/PERFORMANCE.md defines
them ("ddtrain bench scaling").
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..errors import DDTrainError, choice_error
from .cells import Progress, loadavg, run_cell
from .scaling_output import cell_row, finish_rows, pick_median, render



@dataclass(kw_only=True)
class ScalingConfig:
    """The matrix and what every cell runs; checked before the first launch."""

    model: str
    data: str
    strategies: list[str]
    workers: list[int]
    batch_sizes: list[int] = field(default_factory=lambda: [32])
    loader_workers: list[int] = field(default_factory=lambda: [0])
    amp: list[str] = field(default_factory=lambda: ["off"])
    channels_last: bool = False
    steps: int = 30                 # timed steps per cell (after the warm-up); 0 with epochs
    epochs: int = 0                 # whole epochs per cell instead of steps
    warmup_steps: int = 5
    servers: int = 1                # ps-* strategies: parameter-server ranks added to the workers
    lr: float = 0.01
    seed: int = 0
    model_args: list[str] = field(default_factory=list)
    data_args: list[str] = field(default_factory=list)
    sync_every: str = "1"
    trace: bool = False
    monitor: bool = True
    monitor_every: float = 0.5
    cell_timeout_s: float = 900.0
    timeout_s: float = 300.0
    repeats: int = 1                # run the whole matrix this often, interleaved; report each cell's median

    def __post_init__(self):
        if not self.strategies:
            raise DDTrainError("--strategies: give at least one strategy")
        for name, values in (("workers", self.workers), ("batch-sizes", self.batch_sizes)):
            if not values or min(values) < 1:
                raise DDTrainError(f"--{name} must be positive integers, got {values}")
        if not self.loader_workers or min(self.loader_workers) < 0:
            raise DDTrainError(f"--loader-workers must be integers >= 0, got {self.loader_workers}")
        for mode in self.amp:
            if mode not in ("off", "bf16", "fp16"):
                raise choice_error("--amp mode", mode, ("off", "bf16", "fp16"))
        if (self.steps > 0) == (self.epochs > 0):
            raise DDTrainError("give exactly one of --steps S (timed steps per cell) or --epochs E")
        if self.steps < 0 or self.epochs < 0 or self.warmup_steps < 0:
            raise DDTrainError("--steps, --epochs and --warmup-steps must be >= 0")
        if self.servers < 1:
            raise DDTrainError(f"--servers must be at least 1, got {self.servers}")
        if self.repeats < 1:
            raise DDTrainError(f"--repeats must be at least 1, got {self.repeats}")
        if not (self.cell_timeout_s > 0 and self.timeout_s > 0 and self.monitor_every > 0):
            raise DDTrainError("--cell-timeout, --timeout and --monitor-every must be positive")


@dataclass
class Cell:
    strategy: str
    workers: int
    ranks: int
    batch_size: int
    loader_workers: int
    amp: str
    repeat: int = 0

    @property
    def setup(self) -> str:
        return f"{self.strategy}-w{self.workers}-b{self.batch_size}-lw{self.loader_workers}-{self.amp}"

    @property
    def name(self) -> str:
        return self.setup + (f"-r{self.repeat}" if self.repeat else "")


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DDTrainError(f"{flag} takes comma-separated integers, got {text!r}") from None


def add_arguments(p) -> None:
    p.add_argument("--model", default="simple-cnn", help="model name (see ddtrain.models.MODELS)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="model option")
    p.add_argument("--data", default="synthetic:mnist", help="data spec (see ddtrain.data)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE", help="data option")
    p.add_argument("--strategies", default="ddp", help="comma-separated strategies (ddtrain.sync.STRATEGIES)")
    p.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (ps-*: servers come on top)")
    p.add_argument("--batch-sizes", default="32", help="comma-separated per-worker batch sizes")
    p.add_argument("--loader-workers", default="0", help="comma-separated DataLoader processes per rank")
    p.add_argument("--amp", default="off", help="comma-separated precisions: off, bf16, fp16")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout in every cell")
    p.add_argument("--steps", type=int, default=None, help="timed steps per cell, after the warm-up (None: 30, or 0 with --epochs)")
    p.add_argument("--epochs", type=int, default=0, help="whole epochs per cell instead of --steps")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps run first and left out of every time")
    p.add_argument("--servers", type=int, default=1, help="parameter-server ranks of ps-* strategies")
    p.add_argument("--sync-every", default="1", help="hybrid/local-sgd: steps between parameter syncs, or 'epoch'")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace per cell (cells/<cell>.trace.json)")
    p.add_argument("--no-monitor", action="store_true", help="do not sample CPU/GPU/network while cells run")
    p.add_argument("--monitor-every", type=float, default=0.5, metavar="SECONDS", help="seconds between samples")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the matrix this often, interleaved (cell by cell), and report each cell's median run")
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds one cell may take before it is stopped")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits on another")
    p.add_argument("--out", required=True, help="results folder (cells/, scaling.json, scaling.txt)")


def config_from_args(args) -> ScalingConfig:
    return ScalingConfig(
        model=args.model, data=args.data, strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        workers=_ints(args.workers, "--workers"), batch_sizes=_ints(args.batch_sizes, "--batch-sizes"),
        loader_workers=_ints(args.loader_workers, "--loader-workers"),
        amp=[a.strip() for a in args.amp.split(",") if a.strip()], channels_last=args.channels_last,
        steps=(args.steps if args.steps is not None else (0 if args.epochs else 30)), epochs=args.epochs,
        warmup_steps=args.warmup_steps, servers=args.servers, lr=args.lr, seed=args.seed,
        model_args=args.model_arg, data_args=args.data_arg, sync_every=args.sync_every, trace=args.trace,
        monitor=not args.no_monitor, monitor_every=args.monitor_every, cell_timeout_s=args.cell_timeout,
        timeout_s=args.timeout, repeats=args.repeats)


def plan(config: ScalingConfig) -> list[Cell]:
    """Every cell, in run order (a strategy's worker counts together, smallest first)."""
    cells = []
    for strategy in config.strategies:
        extra = config.servers if strategy.startswith("ps-") else 0
        for batch in config.batch_sizes:
            for loader in config.loader_workers:
                for amp in config.amp:
                    cells += [Cell(strategy, w, w + extra, batch, loader, amp) for w in sorted(set(config.workers))]
    return cells


def check(config: ScalingConfig, cells: list[Cell]) -> int:
    """Names, data and sizes, once, before any launch; returns the number of training samples."""
    from ..config import TrainConfig
    from ..sync import STRATEGIES
    from ..train_cli import load_and_build, parse_kv
    for name in config.strategies:
        if name not in STRATEGIES:
            raise choice_error("strategy", name, STRATEGIES)
    train = TrainConfig(model=config.model, data=config.data, val_fraction=0.0, seed=config.seed,
                        model_args=parse_kv(config.model_args, "--model-arg"),
                        data_args=parse_kv(config.data_args, "--data-arg"))
    data, _ = load_and_build(train, meta=True)
    n = len(data.train)
    for cell in cells:
        if cell.batch_size > n // cell.workers:
            raise DDTrainError(f"batch size {cell.batch_size} is larger than a worker's shard with {cell.workers} "
                               f"workers: {n} samples / {cell.workers} = {n // cell.workers}")
    return n


def train_argv(config: ScalingConfig, cell: Cell, out: Path) -> list[str]:
    total = config.warmup_steps + config.steps if config.steps else 0
    argv = ["train", "--model", config.model, "--data", config.data, "--strategy", cell.strategy,
            "--batch-size", str(cell.batch_size), "--loader-workers", str(cell.loader_workers), "--amp", cell.amp,
            "--lr", str(config.lr), "--seed", str(config.seed), "--val-fraction", "0",
            "--servers", str(config.servers), "--sync-every", config.sync_every, "--timeout", str(config.timeout_s),
            "--out", str(out / f"{cell.name}.json"), "--profile", "--warmup-steps", str(config.warmup_steps),
            "--log-every", "1"]
    argv += ["--steps", str(total)] if total else ["--epochs", str(config.epochs)]
    for item in config.model_args:
        argv += ["--model-arg", item]
    for item in config.data_args:
        argv += ["--data-arg", item]
    if config.channels_last:
        argv.append("--channels-last")
    if config.monitor:
        argv += ["--monitor-system", "--monitor-every", str(config.monitor_every)]
    if config.trace:
        argv += ["--trace", str(out / f"{cell.name}.trace.json")]
    return argv


def main(args) -> int:
    from .. import records
    config = config_from_args(args)
    out = Path(args.out)
    cells = plan(config)
    n_train = check(config, cells)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"# ddtrain bench scaling: {config.model} on {config.data} ({n_train} training samples), "
          f"{len(cells)} cells, {config.warmup_steps} warm-up + "
          f"{f'{config.steps} timed steps' if config.steps else f'{config.epochs} epoch(s)'} each, "
          f"{os.cpu_count()} CPU cores", flush=True)
    runs = [replace(cell, repeat=k) for k in range(config.repeats) for cell in cells]
    progress, rows = Progress(len(runs)), []
    load_start = loadavg()
    for i, cell in enumerate(runs, 1):
        total_steps = config.warmup_steps + config.steps if config.steps else None
        run = run_cell(config, cell, train_argv(config, cell, out / "cells"), out / "cells", progress, i, total_steps)
        row = cell_row(config, cell, run, out / "cells" / f"{cell.name}.json", out)
        rows.append(row)
        note = (f"{row['samples_per_s']:.1f} samples/s, step {1e3 * row['step_time_s']:.1f} ms" if row["ok"]
                else f"FAILED ({row['error']})")
        progress.cell(i, cell, f"{note}, {run['wall_s']:.0f} s", final=True)
    rows = pick_median(rows)
    finish_rows(rows)
    result = {"kind": "ddtrain-bench-scaling", "config": asdict(config), "train_samples": n_train,
              "cores": os.cpu_count(), "loadavg_1min": [load_start, loadavg()],
              "elapsed_s": time.perf_counter() - started, "cells": rows}
    text = render(result)
    records.write_json(out / "scaling.json", result)
    records.atomic_write(out / "scaling.txt", lambda tmp: Path(tmp).write_text(text + "\n"))
    print(text, flush=True)
    print(f"# results: {out}/scaling.json, per cell: {out}/cells/; plots: ddtrain report {out}", flush=True)
    failed = [r["cell"] for r in rows if not r["ok"]]
    if failed:
        print(f"ddtrain: error: {len(failed)} cell(s) failed: {', '.join(failed)} (see their .log files)",
              file=sys.stderr, flush=True)
        return 1
    return 0
