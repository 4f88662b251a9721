"""``ddtrain bench scaling``: its flags; the matrix itself is ``ddtrain.bench.scaling``."""
from __future__ import annotations

from pathlib import Path



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
    p.add_argument("--steps", type=int, default=None, help="timed steps per cell, after the warm-up (None: 30, or "
                   "0 with --epochs)")
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
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="threads of every worker (OMP_NUM_THREADS) in every cell: the same at every worker count, so "
                        "that a speed-up compares workers, not threads")
    p.add_argument("--cell-timeout", type=float, default=900.0, help="seconds one cell may take before it is stopped")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits on another")
    p.add_argument("--out", required=True, help="results folder (cells/, scaling.json, scaling.txt)")


def config_from_args(args):
    """The matrix's axes from their flags, every cell's shared settings as a TrainConfig (``ScalingConfig.of``)."""
    from ddtrain.bench.scaling import ScalingConfig, _ints   # here: --help answers without torch
    from ddtrain.config import parse_kv
    # isdecimal, not isdigit: '²'.isdigit() is True and int('²') was a traceback (issue 32)
    sync_every = int(args.sync_every) if str(args.sync_every).isdecimal() else args.sync_every
    return ScalingConfig.of(
        strategies=[s.strip() for s in args.strategies.split(",") if s.strip()],
        workers=_ints(args.workers, "--workers"), batch_sizes=_ints(args.batch_sizes, "--batch-sizes"),
        loader_workers=_ints(args.loader_workers, "--loader-workers"),
        amp=[a.strip() for a in args.amp.split(",") if a.strip()], trace=args.trace,
        cell_timeout_s=args.cell_timeout, repeats=args.repeats, threads_per_worker=args.threads_per_worker,
        model=args.model, model_args=parse_kv(args.model_arg, "--model-arg"), data=args.data,
        data_args=parse_kv(args.data_arg, "--data-arg"), channels_last=args.channels_last,
        steps=(args.steps if args.steps is not None else (0 if args.epochs else 30)), epochs=args.epochs,
        warmup_steps=args.warmup_steps, servers=args.servers, sync_every=sync_every, lr=args.lr, seed=args.seed,
        monitor_system=not args.no_monitor, monitor_every=args.monitor_every, timeout=args.timeout)


def main(args) -> int:
    from ddtrain.bench.scaling import run_matrix
    return run_matrix(config_from_args(args), Path(args.out))
