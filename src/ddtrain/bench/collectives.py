"""``ddtrain bench collectives``: time every all-reduce algorithm over a range of message sizes.

    ddtrain bench collectives --algorithms native,ring,tree --sizes 1K:64M --nproc 4
    ddtrain bench collectives --sizes 8:1M --dtype float64 --json out.json --plot busbw.png

nccl-tests' ``all_reduce_perf`` for ``ddtrain.comm``. Per size and algorithm: warm-up calls,
then timed calls, each started right after a barrier; a call's time is the slowest rank's
and the figure printed is the median over calls. Algorithm and bus bandwidth, the α-β-γ
model's prediction from a calibration run at the start (``ddtrain.costmodel``), and the
number of wrong elements against an exact single-process reference. Large messages get
fewer calls (``--budget-s``) so a 1K:64M sweep fits in minutes on a laptop.
docs/PERFORMANCE.md defines every column.
"""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .. import launch, runtime
from ..costmodel import LinkParams, bus_bandwidth_factor, predict_time
from ..errors import DDTrainError, choice_error
from .collectives_output import check_plot_available, render, summarize, write_outputs
from .collectives_timing import Timing, pattern as _pattern, time_calls as _time_calls

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int8": torch.int8, "int16": torch.int16,
          "int32": torch.int32, "int64": torch.int64}
EXACT_INTEGERS = {"float16": 2048, "bfloat16": 256}   # largest whole number each holds exactly
BENCH_OPS = ("sum", "avg", "max", "min")   # ops whose reference is exact on our test pattern
# Largest calibration message: enough for β to show over α. A CPU loopback needs ~16 MiB, an
# NVLink, hundreds of times faster, much more.
CALIBRATION_MAX_BYTES = {"cpu": 16 << 20, "cuda": 512 << 20}


@dataclass(kw_only=True)
class BenchConfig:
    """What to measure; checked before any process starts."""

    algorithms: list[str]          # names in ddtrain.comm.ALGORITHMS
    sizes: list[int]               # message sizes in bytes, each a whole number of elements
    dtype: str = "float32"
    op: str = "sum"
    iters: int = 20                # most timed calls per size and algorithm
    min_iters: int = 3             # fewest timed calls, whatever the budget
    warmup: int = 5                # most untimed calls before timing
    budget_s: float = 0.6          # seconds of timed calls per size and algorithm, roughly
    calibrate: bool = True         # fit alpha, beta, gamma first and predict every time
    calibration_s: float = 4.0     # seconds the calibration may take, roughly

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise choice_error("dtype", self.dtype, DTYPES)
        if self.op not in BENCH_OPS:
            raise choice_error("op", self.op, BENCH_OPS)
        if self.op == "avg" and not DTYPES[self.dtype].is_floating_point:
            raise DDTrainError(f"--op avg needs a floating-point --dtype, got {self.dtype}")
        if not self.algorithms:
            raise DDTrainError("--algorithms: give at least one algorithm")
        if self.iters < 1 or self.min_iters < 1 or self.min_iters > self.iters:
            raise DDTrainError(f"need 1 <= --min-iters <= --iters, got --min-iters {self.min_iters} "
                               f"--iters {self.iters}")
        if self.warmup < 0:
            raise DDTrainError(f"--warmup must be >= 0, got {self.warmup}")
        if not self.budget_s > 0:
            raise DDTrainError(f"--budget-s must be positive, got {self.budget_s}")
        if not self.calibration_s > 0:
            raise DDTrainError(f"--calibration-s must be positive, got {self.calibration_s}")


def parse_size(text: str) -> int:
    """``"64"``, ``"1K"``, ``"64M"``, ``"1G"`` (binary units, optional trailing B) -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise DDTrainError(f"bad size {text!r}: expected a whole number of bytes with an optional "
                           "K, M or G suffix (powers of 1024), e.g. 1K or 64M")
    return int(match.group(1)) * SIZE_UNITS[match.group(2)]


def parse_sizes(text: str, element_size: int) -> list[int]:
    """``"MIN:MAX"`` -> MIN, 2·MIN, 4·MIN, … up to MAX (bytes); ``"SIZE"`` -> [SIZE]."""
    low, _, high = text.partition(":")
    low, high = parse_size(low), parse_size(high or low)
    if low < element_size:
        raise DDTrainError(f"--sizes: the smallest size must hold one element ({element_size} B), got {low} B")
    if high < low:
        raise DDTrainError(f"--sizes: MAX ({high} B) is smaller than MIN ({low} B)")
    sizes, size = [], low
    while size <= high:
        sizes.append(size - size % element_size)
        size *= 2
    return sizes


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
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="process-group backend; auto: NCCL when every local rank has a GPU, else Gloo")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")


def config_from_args(args) -> BenchConfig:
    from ..comm import ALGORITHMS

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


def run_bench(config: BenchConfig, group=None) -> dict:
    """Calibrate, then time every (size, algorithm); call on every rank. Same result everywhere."""
    from ..comm import all_reduce
    from ..costmodel import calibrate
    from ..costmodel.calibration import exchange_time

    start = time.perf_counter()
    host = {"cpus": os.cpu_count(), "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    device = runtime.device()
    ranks = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    dtype = DTYPES[config.dtype]
    exact_up_to = EXACT_INTEGERS.get(config.dtype)
    if exact_up_to is not None and config.op in ("sum", "avg") and 4 * ranks > exact_up_to:
        raise DDTrainError(f"--dtype {config.dtype} holds whole numbers exactly only up to {exact_up_to}; "
                           f"sums over {ranks} ranks of the test pattern (|values| <= 4) exceed that, "
                           "so #wrong could not tell rounding from error: use a wider dtype")
    calibration = None
    if config.calibrate:
        cap = CALIBRATION_MAX_BYTES.get(device.type, CALIBRATION_MAX_BYTES["cpu"])
        calib_max = min(cap, max(64 << 10, max(config.sizes)))
        calibration = calibrate(group, max_bytes=calib_max, budget_s=config.calibration_s, device=device)
        _progress(rank, f"# calibration done in {calibration.elapsed_s:.1f} s")
    rows = []
    for done, size in enumerate(config.sizes, 1):
        count = size // torch.empty((), dtype=dtype).element_size()
        inputs, expected = _pattern(rank, count, dtype, ranks, config.op, device)
        for algorithm in config.algorithms:
            def call(work, algorithm=algorithm):
                all_reduce(work, algorithm=algorithm, op=config.op, group=group)
            timing = _time_calls(call, inputs, expected, config, group, device)
            rows.append(_row(size, count, config.dtype, algorithm, timing, ranks,
                             calibration.params if calibration else None))
        _progress(rank, f"# {done}/{len(config.sizes)} sizes done (up to {size} B), "
                        f"{time.perf_counter() - start:.1f} s")
    drift = None
    if calibration is not None and calibration.exchange is not None:
        # Other processes' load can change during a long run: the calibration's largest
        # exchange, timed again at the end, shows how far (predictions keep the start's).
        size = calibration.exchange.sizes[-1]
        drift = {"size_bytes": size, "start_s": calibration.exchange.times_s[-1],
                 "end_s": exchange_time(size, group, device=device, budget_s=config.calibration_s / 8)}
    result = {"config": asdict(config), "world_size": ranks, "host": host, "backend": runtime.backend() or "none",
              "device": str(device), "calibration": calibration.as_dict() if calibration else None,
              "calibration_drift": drift,
              "rows": rows, "elapsed_s": time.perf_counter() - start}
    result["summary"] = summarize(result)
    _add_link_fractions(result)
    return result


def _add_link_fractions(result: dict) -> None:
    """Inside ``ddtrain cluster run`` (DDTRAIN_LINK_BPS set): busbw as a fraction of the emulated link."""
    from ..cluster import link_fraction, link_rate_bps

    link = link_rate_bps()
    if not link:
        return
    result["link_bps"] = link
    for row in result["rows"]:
        row["busbw_of_link"] = link_fraction(bytes_per_s=row["busbw_GBps"] * 1e9)


def link_lines(result: dict, min_bytes: int = 1 << 20) -> list[str]:
    """'#' lines of busbw / link per algorithm at sizes >= ``min_bytes`` (none outside a cluster run)."""
    if not result.get("link_bps"):
        return []
    lines = [f"# busbw / link ({result['link_bps'] / 1e6:g} Mbit/s each way, DDTRAIN_LINK_BPS; TCP payload "
             f"tops out near 0.956 of it at MTU 1500, docs/CLUSTER.md):"]
    for name in dict.fromkeys(r["algorithm"] for r in result["rows"]):
        cells = [(r["size_bytes"], r["busbw_of_link"]) for r in result["rows"]
                 if r["algorithm"] == name and r["size_bytes"] >= min_bytes]
        if cells:
            lines.append(f"#   {name}: " + ", ".join(f"{size / (1 << 20):g}M {value:.3f}" for size, value in cells))
    return lines


def _row(size, count, type_name, algorithm, timing: Timing, ranks, params: LinkParams | None) -> dict:
    seconds = timing.seconds
    algbw = size / seconds / 1e9 if seconds > 0 else float("nan")
    predicted = predict_time(algorithm, size, ranks, params) if params is not None else None
    error = (100 * (predicted - seconds) / seconds) if predicted is not None and seconds > 0 else None
    return {"size_bytes": size, "count": count, "type": type_name, "algorithm": algorithm,
            "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_bandwidth_factor(ranks),
            "predicted_us": predicted * 1e6 if predicted is not None else None, "error_pct": error,
            "wrong": timing.wrong, "iters": timing.iters, "cpu_cores": timing.cpu_cores,
            "samples_us": [t * 1e6 for t in timing.samples_s]}


def _progress(rank: int, message: str) -> None:
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
