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
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ddtrain.bench.tables import fmt, render_table
from ddtrain.costmodel import LinkParams, bus_bandwidth_factor, predict_time
from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError, choice_error

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








def run_bench(config: BenchConfig, group=None) -> dict:
    """Calibrate, then time every (size, algorithm); call on every rank. Same result everywhere."""
    from ddtrain.comm import all_reduce
    from ddtrain.costmodel import calibrate
    from ddtrain.costmodel.calibration import exchange_time

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
        inputs, expected = pattern(rank, count, dtype, ranks, config.op, device)
        for algorithm in config.algorithms:
            def call(work, algorithm=algorithm):
                all_reduce(work, algorithm=algorithm, op=config.op, group=group)
            timing = time_calls(call, inputs, expected, config, group, device)
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
    from ddtrain.cluster import link_fraction, link_rate_bps

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
             f"tops out near 0.956 of it at MTU 1500, docs/EMULATED_CLUSTER.md):"]
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


def pattern(rank, count, dtype, ranks, op, device):
    """This rank's input and the exact expected result, built on ``device``.

    Rank r holds ((i + 3r) mod 9) − 4 at index i: small integers, so every sum, average and
    extremum is exact in every dtype and any order of reduction gives the same bits. The
    reference combines all ranks' patterns in one process, in integers, before the cast.
    """
    index = torch.arange(count, dtype=torch.int32 if count < 2**31 - 64 else torch.int64, device=device)

    def of(r):
        return (index + 3 * r) % 9 - 4  # noqa: F821 (index is deleted only after the last call)

    mine = of(rank).to(dtype)
    acc = of(0)
    for r in range(1, ranks):
        other = of(r)
        acc = acc + other if op in ("sum", "avg") else (torch.maximum(acc, other) if op == "max"
                                                        else torch.minimum(acc, other))
    del index  # frees the index tensor early on large counts; `of` is not called after this
    expected = acc.to(dtype)
    if op == "avg":
        expected = expected / ranks
    return mine, expected


@dataclass
class Timing:
    """One (size, algorithm) cell: what ``time_calls`` measured."""

    seconds: float        # median over timed calls of the slowest rank's time
    iters: int            # timed calls
    wrong: int            # elements differing from the reference, summed over ranks
    cpu_cores: float      # median over calls of (CPU seconds of all ranks) / (call time)
    samples_s: list       # every timed call's time (slowest rank), in order


def time_calls(call, inputs, expected, config: BenchConfig, group, device) -> Timing:
    """Warm up, time adaptively many calls, check the last result against ``expected``."""
    work = torch.empty_like(inputs)

    def once() -> tuple[float, float]:
        work.copy_(inputs)
        _sync(device)
        if dist.is_initialized():
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()   # process time: all threads, user + system
        call(work)
        _sync(device)
        return time.perf_counter() - t0, time.process_time() - c0

    first = once()
    probe = _reduce([first[0]], group, device, "max")[0]   # the first call: untimed unless --warmup 0
    timed = [] if config.warmup else [first]
    for _ in range(min(config.warmup - 1, int(config.budget_s / 4 / max(probe, 1e-9)))):
        once()
    iters = int(max(config.min_iters, min(config.iters, config.budget_s / max(probe, 1e-9))))
    timed += [once() for _ in range(iters - len(timed))]
    walls = _reduce([w for w, _ in timed], group, device, "max")   # per call, the slowest rank
    cpus = _reduce([c for _, c in timed], group, device, "sum")    # per call, all ranks together
    wrong = _reduce([float((work != expected).sum())], group, device, "sum")[0]
    return Timing(seconds=statistics.median(walls), iters=iters, wrong=int(wrong),
                  cpu_cores=statistics.median(c / w for c, w in zip(cpus, walls) if w > 0), samples_s=walls)


def _reduce(values, group, device, op: str) -> list[float]:
    """Element-wise max or sum over the group's ranks (identity in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()


def _collective_device(group, device):
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


COLUMNS = [("size", "(B)"), ("count", "(elements)"), ("type", ""), ("algorithm", ""),
           ("time", "(us)"), ("algbw", "(GB/s)"), ("busbw", "(GB/s)"), ("predicted", "(us)"),
           ("error", "(%)"), ("#wrong", ""), ("iters", ""), ("cpu", "(cores)")]
RATIO_MIN_BYTES = 16 << 20    # "large" messages: where busbw is compared with native
ERROR_MIN_BYTES = 1 << 20     # where the model's error is summarised
PLOT_EXTRA = "pip install 'ddtrain[report]'"


def summarize(result: dict) -> dict:
    """Per algorithm: mean busbw, busbw / native's at large sizes, model error at >= 1 MiB."""
    rows = result["rows"]
    algorithms = list(dict.fromkeys(r["algorithm"] for r in rows))
    native = {r["size_bytes"]: r["busbw_GBps"] for r in rows if r["algorithm"] == "native"}
    summary = {"wrong_total": sum(r["wrong"] for r in rows), "avg_busbw_GBps": {},
               "busbw_ratio_to_native": {}, "prediction_error_pct": {}}
    for name in algorithms:
        mine = [r for r in rows if r["algorithm"] == name]
        summary["avg_busbw_GBps"][name] = statistics.fmean(r["busbw_GBps"] for r in mine)
        if native and name != "native":
            ratios = {r["size_bytes"]: r["busbw_GBps"] / native[r["size_bytes"]] for r in mine
                      if r["size_bytes"] >= RATIO_MIN_BYTES and native.get(r["size_bytes"])}
            if ratios:
                summary["busbw_ratio_to_native"][name] = ratios
        errors = [abs(r["error_pct"]) for r in mine
                  if r["size_bytes"] >= ERROR_MIN_BYTES and r["error_pct"] is not None]
        if errors:
            summary["prediction_error_pct"][name] = {"median_abs": statistics.median(errors),
                                                     "max_abs": max(errors), "sizes": len(errors)}
    return summary


def render(result: dict) -> str:
    """The whole printout: '#' header lines, the table, '#' summary lines."""
    config = result["config"]
    lines = [f"# ddtrain bench collectives: all-reduce, op {config['op']}, {result['world_size']} ranks, "
             f"backend {result['backend']}, device {result['device']}",
             f"# host: {result.get('host', {}).get('cpus', '?')} CPUs, load average "
             f"{result.get('host', {}).get('load_average', '?')} (1 min) at the start",
             "# time: median over timed calls of the slowest rank's time per call (a barrier before each call)",
             "# busbw = algbw * 2(n-1)/n; predicted: alpha-beta-gamma model; error = (predicted - time) / time",
             "# cpu: CPU time of all ranks together per call / the call's time (cores kept busy)",
             *_calibration_lines(result.get("calibration")), "#"]
    body = [[str(r["size_bytes"]), str(r["count"]), r["type"], r["algorithm"], fmt(r["time_us"], 1),
             fmt(r["algbw_GBps"], 3), fmt(r["busbw_GBps"], 3), fmt(r["predicted_us"], 1),
             fmt(r["error_pct"], 1), str(r["wrong"]), str(r["iters"]), fmt(r["cpu_cores"], 2)]
            for r in result["rows"]]
    lines += render_table(COLUMNS, body)
    summary = result["summary"]
    lines.append("#")
    lines.append("# Avg bus bandwidth (GB/s): " + ", ".join(
        f"{name} {value:.3f}" for name, value in summary["avg_busbw_GBps"].items()))
    for name, ratios in summary["busbw_ratio_to_native"].items():
        lines.append(f"# busbw / native busbw, {name}: " + ", ".join(
            f"{_size_name(size)} {ratio:.2f}" for size, ratio in ratios.items()))
    for name, err in summary["prediction_error_pct"].items():
        lines.append(f"# model |error| at >= 1 MiB, {name}: median {err['median_abs']:.1f}%, "
                     f"max {err['max_abs']:.1f}% over {err['sizes']} sizes")
    lines += _drift_line(result.get("calibration_drift"))
    lines.append(f"# #wrong total: {summary['wrong_total']}   elapsed: {result['elapsed_s']:.1f} s")
    return "\n".join(lines)


def _calibration_lines(calibration: dict | None) -> list[str]:
    if calibration is None:
        return ["# calibration: skipped (--no-calibrate), no predictions"]
    p = calibration["params"]
    out = [f"# calibration ({calibration['elapsed_s']:.1f} s): alpha {p['alpha_us']:.1f} us, "
           f"beta {p['beta_s_per_byte'] * 1e9:.3f} ns/B ({_gbps(p['beta_s_per_byte'])} GB/s), "
           f"gamma {p['gamma_s_per_byte'] * 1e9:.3f} ns/B ({_gbps(p['gamma_s_per_byte'])} GB/s)"]
    if calibration.get("exchange"):
        out.append(f"#   alpha, beta from pairwise exchange, all ranks at once "
                   f"(fit max residual {100 * calibration['exchange']['max_rel_residual']:.0f}%); "
                   f"gamma from a local add on every rank at once")
    for key, label in (("ring", "reference ring-neighbour exchange, all ranks"),
                       ("pingpong", "reference ping-pong, ranks 0-1 alone")):
        if calibration.get(key):
            fit = calibration[key]
            out.append(f"#   {label}: alpha {fit['alpha_s'] * 1e6:.1f} us, beta "
                       f"{fit['beta_s_per_byte'] * 1e9:.3f} ns/B ({_gbps(fit['beta_s_per_byte'])} GB/s)")
    if calibration.get("copy"):
        out.append(f"#   reference local copy on every rank at once: {_gbps(calibration['copy']['beta_s_per_byte'])} GB/s")
    return out + [f"#   {note}" for note in calibration.get("notes", [])]


def _drift_line(drift: dict | None) -> list[str]:
    """The calibration's largest exchange at the start and again at the end of the run."""
    if not drift or not drift["start_s"]:
        return []
    return [f"# load drift: the {_size_name(drift['size_bytes'])} exchange took {drift['start_s'] * 1e3:.2f} ms "
            f"at the start, {drift['end_s'] * 1e3:.2f} ms at the end "
            f"({drift['end_s'] / drift['start_s']:.2f}x; predictions use the start)"]


def _gbps(seconds_per_byte: float) -> str:
    return f"{1e-9 / seconds_per_byte:.2f}" if seconds_per_byte > 0 else "inf"


def _size_name(size: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def check_plot_available() -> None:
    """Fail before any measurement if --plot cannot be honoured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise DDTrainError(f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}") from None


def write_outputs(result: dict, *, json_path=None, plot_path=None) -> None:
    """JSON and PNG, each written atomically (rank 0 only)."""
    from ddtrain.observe.files import atomic_write, write_json

    if json_path:
        write_json(json_path, result)
    if plot_path:
        atomic_write(plot_path, lambda tmp: plot_busbw(result, tmp))


def plot_busbw(result: dict, path) -> None:
    """busbw against size, log-log: one solid line per algorithm, its prediction dashed."""
    check_plot_available()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5))
    for i, name in enumerate(dict.fromkeys(r["algorithm"] for r in result["rows"])):
        rows = [r for r in result["rows"] if r["algorithm"] == name]
        color = f"C{i}"
        axes.plot([r["size_bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-", color=color, label=name)
        predicted = [(r["size_bytes"], r["busbw_GBps"] * r["time_us"] / r["predicted_us"])
                     for r in rows if r["predicted_us"]]
        if predicted:
            axes.plot(*zip(*predicted), "--", color=color, alpha=0.7, label=f"{name} (model)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title(f"all-reduce {result['config']['op']}, {result['world_size']} ranks, "
                   f"{result['backend']} on {result['device']}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", ncol=2)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)
    plt.close(figure)
