"""What ``ddtrain bench collectives`` prints and writes: the table, its summary, JSON and a plot.

Every figure here is defined in docs/PERFORMANCE.md (section ``ddtrain bench collectives``).
"""
from __future__ import annotations

import statistics

from ..errors import DDTrainError
from .tables import fmt, render_table

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
    from ..records import atomic_write, write_json

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
