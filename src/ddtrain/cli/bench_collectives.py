"""``ddtrain bench collectives``: its flags, and the launch of --nproc ranks; the measurement is
``ddtrain.bench.collectives``."""
from __future__ import annotations

import torch

from ddtrain.bench.collectives import (BENCH_OPS, DTYPES, BenchConfig, check_plot_available, link_lines,
                                       parse_sizes, render, run_bench, write_outputs)
from ddtrain.distributed import launch, runtime
from ddtrain.distributed.config import BACKENDS
from ddtrain.errors import DDTrainError, choice_error


def add_arguments(parser) -> None:
    parser.add_argument("--algorithms", default="all", metavar="NAME[,NAME...]",
                        help="all-reduce algorithms to time, comma-separated; 'all' = every one in ddtrain.comm.ALGORITHMS")
    parser.add_argument("--sizes", default="1K:16M", metavar="MIN:MAX",
                        help="message sizes in bytes, doubling from MIN to MAX; K, M, G = 1024, 1024², 1024³")
    parser.add_argument("--nproc", type=int, default=2,
                        help="local ranks to start (ignored under a launcher; 1 rank measures nothing)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type")
    parser.add_argument("--op", default="sum", choices=BENCH_OPS, help="reduction")
    parser.add_argument("--iters", type=int, default=20, help="most timed calls per size and algorithm")
    parser.add_argument("--min-iters", type=int, default=3, help="fewest timed calls per size and algorithm")
    parser.add_argument("--warmup", type=int, default=5, help="most untimed calls before timing")
    parser.add_argument("--budget-s", type=float, default=0.6,
                        help="seconds of timed calls per size and algorithm: large messages get fewer calls")
    parser.add_argument("--calibration-s", type=float, default=4.0,
                        help="seconds the alpha-beta-gamma calibration may take, roughly")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="skip the alpha-beta-gamma calibration (no predicted column)")
    parser.add_argument("--json", metavar="FILE", help="write every number as JSON to FILE")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of busbw (and predicted) against size")
    parser.add_argument("--backend", choices=["auto", *BACKENDS], default="auto",
                        help="process-group backend; auto: NCCL when every local rank has a GPU, else Gloo")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")


def config_from_args(args) -> BenchConfig:
    from ddtrain.comm import ALGORITHMS

    names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if names == ["all"]:
        names = list(ALGORITHMS)
    for name in names:
        if name not in ALGORITHMS:
            raise choice_error("algorithm", name, ALGORITHMS)
    if args.dtype not in DTYPES:
        raise choice_error("dtype", args.dtype, DTYPES)
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    return BenchConfig(algorithms=names, sizes=parse_sizes(args.sizes, element_size), dtype=args.dtype,
                       op=args.op, iters=args.iters, min_iters=args.min_iters, warmup=args.warmup,
                       budget_s=args.budget_s, calibrate=not args.no_calibrate,
                       calibration_s=args.calibration_s)


def main(args) -> int:
    config = config_from_args(args)
    if args.plot:
        check_plot_available()
    if args.timeout <= 0:
        raise DDTrainError(f"--timeout must be positive, got {args.timeout}")
    if not launch.inside_launcher():
        if args.nproc < 1:
            raise DDTrainError(f"--nproc must be at least 1, got {args.nproc}")
        argv = ["bench", "collectives", *launch.strip_option(args.argv, "--nproc")]
        return launch.run_local(args.nproc, argv, env={"DDTRAIN_TIMEOUT_S": str(args.timeout)})
    runtime.init(backend=None if args.backend == "auto" else args.backend, timeout_s=args.timeout)
    try:
        result = run_bench(config)
        if runtime.rank() == 0:
            print(render(result), flush=True)
            for line in link_lines(result):
                print(line, flush=True)
            write_outputs(result, json_path=args.json, plot_path=args.plot)
    finally:
        runtime.shutdown()
    return 0

