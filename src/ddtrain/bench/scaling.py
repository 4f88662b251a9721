"""``ddtrain bench scaling``: throughput, speed-up and the step split over a matrix of runs.

    ddtrain bench scaling --model simple-cnn --data synthetic:mnist --strategies ddp,ring,ps-sync \\
                          --workers 1,2,4 --steps 30 --out results/
    ddtrain report results/

One fresh launch per cell (strategy x workers x batch size x loader workers x precision): a new
Python process runs ``ddtrain.distributed.launch.run_local`` of ``ddtrain train ... --profile`` (so every
cell starts cold, with its own process group and thread settings), writes its results record
to ``DIR/cells/<cell>.json`` and its output to ``<cell>.log``. ``--warmup-steps`` steps run
first and are left out of every time. Workers are the ranks that train on data; ``ps-*``
strategies add ``--servers`` parameter-server ranks on top (4 workers + 1 server = 5 ranks), as
document 002 counts them. ``DIR/scaling.json`` holds every figure; docs/PERFORMANCE.md defines
them ("ddtrain bench scaling").
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ddtrain.bench.cells import Progress, loadavg, run_cell
from ddtrain.bench.tables import fmt, render_table
from ddtrain.config import AMP_MODES, TrainConfig
from ddtrain.errors import DDTrainError, choice_error


# What the matrix gives every cell unless told otherwise (``ScalingConfig.of``; the flags' defaults)
BENCH_DEFAULTS = dict(data="synthetic:mnist", lr=0.01, val_fraction=0.0, steps=30, warmup_steps=5,
                      monitor_system=True)


@dataclass(kw_only=True)
class ScalingConfig:
    """The matrix: its axes, over one ``TrainConfig`` every cell shares; checked before the first launch."""

    train: TrainConfig              # every cell's settings; its steps are the timed ones (profile.warmup_steps run first)
    strategies: list[str]           # axis: strategies (ps-*: train.sync.servers server ranks on top of the workers)
    workers: list[int]              # axis: worker counts
    batch_sizes: list[int] = field(default_factory=lambda: [32])   # axis: per-worker batch sizes
    loader_workers: list[int] = field(default_factory=lambda: [0])   # axis: DataLoader processes per rank
    amp: list[str] = field(default_factory=lambda: ["off"])   # axis: precisions
    trace: bool = False             # also a Chrome trace per cell (cells/<cell>.trace.json)
    cell_timeout_s: float = 900.0   # seconds one cell may take before it is stopped
    repeats: int = 1                # run the whole matrix this often, interleaved; report each cell's median
    # threads of every worker in every cell (OMP_NUM_THREADS), the same at every worker count so that a speed-up
    # compares workers, not threads (issue 32: cores // ranks gave 1 worker 2 threads and each of several 1)
    threads_per_worker: int = 1

    def __post_init__(self):
        if not self.strategies:
            raise DDTrainError("--strategies: give at least one strategy")
        for name, values in (("workers", self.workers), ("batch-sizes", self.batch_sizes)):
            if not values or min(values) < 1:
                raise DDTrainError(f"--{name} must be positive integers, got {values}")
        if not self.loader_workers or min(self.loader_workers) < 0:
            raise DDTrainError(f"--loader-workers must be integers >= 0, got {self.loader_workers}")
        for mode in self.amp:
            if mode not in AMP_MODES:
                raise choice_error("--amp mode", mode, AMP_MODES)
        if (self.train.steps > 0) == (self.train.epochs > 0):
            raise DDTrainError("give exactly one of --steps S (timed steps per cell) or --epochs E")
        if self.repeats < 1:
            raise DDTrainError(f"--repeats must be at least 1, got {self.repeats}")
        if self.threads_per_worker < 1:
            raise DDTrainError(f"--threads-per-worker must be at least 1, got {self.threads_per_worker}")
        if not self.cell_timeout_s > 0:
            raise DDTrainError("--cell-timeout must be positive")

    @classmethod
    def of(cls, **values) -> ScalingConfig:
        """The matrix's own fields by name, every other setting by its flat ``TrainConfig`` name (``BENCH_DEFAULTS``
        fill the rest): ``ScalingConfig.of(model="mlp", strategies=["ddp"], workers=[1, 2], steps=20)``."""
        own = {f.name for f in fields(cls)} - {"train"}
        settings = {**BENCH_DEFAULTS, **({"steps": 0} if values.get("epochs") else {}),
                    **{k: v for k, v in values.items() if k not in own}}
        return cls(train=TrainConfig.from_flat(**settings), **{k: v for k, v in values.items() if k in own})

    def as_dict(self) -> dict:
        """Flat, as ``scaling.json`` records it: the shared settings by name, then the axes (``of`` reads it back)."""
        axes = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}
        return {**self.train.flat(), **axes}


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


def plan(config: ScalingConfig) -> list[Cell]:
    """Every cell, in run order (a strategy's worker counts together, smallest first)."""
    from ddtrain.sync import strategy_spec
    cells = []
    for strategy in config.strategies:
        extra = strategy_spec(strategy).extra_ranks(config.train.sync.servers)
        for batch in config.batch_sizes:
            for loader in config.loader_workers:
                for amp in config.amp:
                    cells += [Cell(strategy, w, w + extra, batch, loader, amp) for w in sorted(set(config.workers))]
    return cells


def check(config: ScalingConfig, cells: list[Cell]) -> int:
    """Names, data and sizes, once, before any launch; returns the number of training samples."""
    from ddtrain.sync import STRATEGIES
    from ddtrain.training.build import load_and_build
    for name in config.strategies:
        if name not in STRATEGIES:
            raise choice_error("strategy", name, STRATEGIES)
    train = config.train
    data, _ = load_and_build(train, meta=True)
    n = len(data.train)
    for cell in cells:
        if cell.batch_size > n // cell.workers:
            raise DDTrainError(f"batch size {cell.batch_size} is larger than a worker's shard with {cell.workers} "
                               f"workers: {n} samples / {cell.workers} = {n // cell.workers}")
    return n


def train_config(config: ScalingConfig, cell: Cell, out: Path) -> TrainConfig:
    """The ``TrainConfig`` of one cell: the shared settings, this cell's axes, and measurement on."""
    from ddtrain.sync import SyncOptions, strategy_spec
    train, spec = config.train, strategy_spec(cell.strategy)
    # the shared strategy options go to the cells whose strategy reads them
    defaults = SyncOptions()
    sync = replace(train.sync, **{f.name: getattr(defaults, f.name) for f in fields(SyncOptions)
                                  if not spec.takes_option(f.name)})
    timed = train.steps
    return replace(
        train, strategy=cell.strategy, amp=cell.amp, sync=sync, out=str(out / f"{cell.name}.json"), log_every=1,
        steps=train.profile.warmup_steps + timed if timed else 0, epochs=0 if timed else train.epochs,
        recipe=replace(train.recipe, batch_size=cell.batch_size),
        data=replace(train.data, loader_workers=cell.loader_workers),
        profile=replace(train.profile, profile=True,
                        trace=str(out / f"{cell.name}.trace.json") if config.trace else None))


def train_argv(config: ScalingConfig, cell: Cell, out: Path) -> list[str]:
    """``ddtrain train`` flags of one cell (``to_argv`` of its ``train_config``)."""
    from ddtrain.config import to_argv
    return ["train", *to_argv(train_config(config, cell, out))]


PARTS = ("data_s", "compute_s", "comm_wait_s", "optimizer_s")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(path)


def _log_error(log: str) -> str:
    try:
        lines = [line.strip() for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def network_check(record: dict) -> list[dict]:
    """Per interface group: bytes on the interface (/proc/net/dev) against our counters, over the timed window.

    Ranks on one host in one network namespace share an interface's counters, so those are
    compared with the sum of the ranks' counted bytes. ``ours`` is what the comm layer counted
    (payload) where it counted anything, else the strategy's own figure (``method`` says which).
    """
    from ddtrain.observe.monitor import delta
    monitor, profile = record.get("monitor"), record.get("profile") or {}
    if not monitor:
        return []
    windows = [r["window_s"] for r in profile.get("ranks", []) if r.get("window_s") and r["role"] == "worker"]
    start, end = (windows[0] if windows else (None, None))
    groups: dict[tuple, dict] = {}
    for r in monitor["ranks"]:
        if not r["interfaces"]:
            continue
        key = (r["host"], r["netns"], tuple(r["interfaces"]))
        s = r["samples"]
        g = groups.setdefault(key, {"host": r["host"], "interfaces": list(r["interfaces"]), "ranks": [],
                                    "net_tx_bytes": delta(s, "net_tx_bytes", start, end),
                                    "net_rx_bytes": delta(s, "net_rx_bytes", start, end),
                                    "net_tx_packets": delta(s, "net_tx_packets", start, end),
                                    "counted_sent_bytes": 0, "strategy_sent_bytes": 0})
        g["ranks"].append(r["rank"])
        g["counted_sent_bytes"] += delta(s, "counted_bytes_sent", start, end) or 0
        g["strategy_sent_bytes"] += delta(s, "strategy_bytes_sent", start, end) or 0
    out = []
    for g in groups.values():
        ours, method = ((g["counted_sent_bytes"], "counted") if g["counted_sent_bytes"]
                        else (g["strategy_sent_bytes"], "strategy"))
        g.update(ours_sent_bytes=ours, ours_method=method,
                 ratio=(g["net_tx_bytes"] / ours if ours and g["net_tx_bytes"] is not None else None))
        out.append(g)
    return out


def cell_row(config, cell, run: dict, record_path: Path, root: Path) -> dict:
    """Everything the table, scaling.json and the report need about one cell."""
    from ddtrain.data.loading import steps_per_epoch
    row = {"cell": cell.name, "setup": cell.setup, "repeat": cell.repeat, "strategy": cell.strategy,
           "workers": cell.workers, "ranks": cell.ranks,
           "batch_size": cell.batch_size, "loader_workers": cell.loader_workers, "amp": cell.amp,
           "ok": False, "exit_code": run["exit_code"], "wall_s": run["wall_s"], "log": _rel(run["log"], root),
           "record": _rel(record_path, root)}
    record = None
    if run["exit_code"] == 0 and record_path.exists():
        record = json.loads(record_path.read_text())
    profile = (record or {}).get("profile") or {}
    if not profile.get("step_time_s"):
        row["error"] = ("stopped at --cell-timeout" if run["timed_out"] else
                        _log_error(run["log"]) if run["exit_code"] else "no timed steps in the record")
        return row
    step = profile["step_time_s"]
    per_epoch = steps_per_epoch(record["sharding"]["samples_per_rank"], cell.batch_size)
    if config.train.epochs:
        times = [e["time_s"] for e in record["epochs"]]
        epoch_s = statistics.median(times[1:] or times)
        kind = "measured" if len(times) > 1 else "measured, incl. warm-up"
    else:
        epoch_s, kind = step * per_epoch, "extrapolated"
    per_rank = [{"rank": r["rank"], "role": r["role"], **(r["split_s"] if r["timed_steps"] else {}),
                 "other_s": r.get("other_s"), "step_time_s": r["step_time_s"], "split_sum_pct": r["split_sum_pct"]}
                for r in profile["ranks"]]
    workers = [r for r in per_rank if r["role"] == "worker" and r.get("data_s") is not None]
    last = record["epochs"][-1] if record["epochs"] else {}
    row.update(ok=True, step_time_s=step, samples_per_s=profile["samples_per_s"], steps_per_epoch=per_epoch,
               epoch_time_s=epoch_s, epoch_time_kind=kind, timed_steps=min(r["timed_steps"] for r in profile["ranks"]
                                                                           if r["role"] == "worker"),
               split_s={k: statistics.fmean(r[k] for r in workers) for k in (*PARTS, "other_s")}, per_rank=per_rank,
               split_sum_pct=[r["split_sum_pct"] for r in workers],
               straggler=profile.get("straggler", {}).get("text"), gradient_bytes=profile.get("gradient_bytes"),
               train_loss=last.get("train_loss"),
               comm=record.get("comm"), network=network_check(record),
               trace=_rel(profile["trace"], root) if profile.get("trace") else None)
    return row


def pick_median(rows: list[dict]) -> list[dict]:
    """One row per setup: with repeats, the run with the median samples/s (the lower middle one)."""
    setups: dict[str, list[dict]] = {}
    for r in rows:
        setups.setdefault(r.get("setup", r["cell"]), []).append(r)
    out = []
    for members in setups.values():
        if len(members) == 1:
            out.append(members[0])
            continue
        ok = sorted((r for r in members if r["ok"]), key=lambda r: r["samples_per_s"])
        chosen = dict(ok[(len(ok) - 1) // 2] if ok else members[0])
        chosen["repeats_samples_per_s"] = [r["samples_per_s"] if r["ok"] else None for r in members]
        out.append(chosen)
    return out


def finish_rows(rows: list[dict]) -> None:
    """Speed-up and efficiency against the smallest-worker cell (1 worker when there is one) of each setup."""
    setups: dict[tuple, list[dict]] = {}
    for r in rows:
        setups.setdefault((r["strategy"], r["batch_size"], r["loader_workers"], r["amp"]), []).append(r)
    for members in setups.values():
        ok = [r for r in members if r["ok"]]
        base = min(ok, key=lambda r: r["workers"]) if ok else None
        for r in members:
            if r["ok"] and base is not None:
                r["baseline_workers"] = base["workers"]
                r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
                r["efficiency"] = r["speedup"] / (r["workers"] / base["workers"])


def load_warnings(speedups, loads, cores: int | None) -> list[str]:
    """'# warning:' lines for figures the machine's load makes meaningless.

    ``speedups``: (label, workers, baseline workers, speed-up); a speed-up above the worker ratio
    (5% tolerance) means the baseline was slowed by something else. ``loads``: (when, 1-min load
    average, this benchmark's own busy processes then); a load beyond the cores after taking
    our own processes out means other programs competed for the CPU.
    """
    lines = []
    for label, workers, base, speedup in speedups:
        if speedup is not None and base and speedup > 1.05 * workers / base:
            lines.append(f"# warning: {label}: a {speedup:.2f}x speed-up with {workers} workers over {base} is more than "
                         f"{workers / base:g}x, which the workers alone cannot give: the {base}-worker run was slowed by "
                         "other load, so this speed-up is not meaningful")
    busy = [(when, load, load - own) for when, load, own in loads if load is not None]
    if cores and busy:
        when, load, other = max(busy, key=lambda b: b[2])
        if other > cores:
            lines.append(f"# warning: the 1-min load average was {load:.1f} on {cores} CPU cores {when} ({other:.1f} "
                         "besides this run's own processes): other programs competed for the CPU, so these times and "
                         "speed-ups measure that competition as much as ddtrain; run again on an idle machine")
    return lines


COLUMNS = [("strategy", ""), ("workers", ""), ("ranks", ""), ("batch", "(/worker)"), ("loader", ""),
           ("amp", ""), ("samples/s", "(1/s)"), ("step", "(ms)"), ("epoch", "(s)"), ("", ""),
           ("speed-up", "(x)"), ("effic.", "(%)"), ("data", "(ms)"), ("compute", "(ms)"), ("comm", "(ms)"),
           ("optim", "(ms)"), ("other", "(ms)"), ("sum", "(%)")]
RANK_COLUMNS = [("cell", ""), ("rank", ""), ("role", ""), ("data", "(ms)"), ("compute", "(ms)"),
                ("comm wait", "(ms)"), ("optimizer", "(ms)"), ("other", "(ms)"), ("4 parts", "(ms)"), ("step", "(ms)"),
                ("4 parts/step", "(%)")]


def _ms(value) -> str:
    return fmt(None if value is None else 1e3 * value, 1)


def render(result: dict) -> str:
    """The printout: '#' header lines, the cell table, the per-rank split, network and straggler lines."""
    c, rows = result["config"], result["cells"]
    load = result.get("loadavg_1min") or [None, None]
    lines = [f"# ddtrain bench scaling: {c['model']} on {c['data']}, {result['cores']} CPU cores "
             f"(1-min load average {fmt(load[0], 1)} at the start, {fmt(load[1], 1)} at the end), "
             f"{c['warmup_steps']} warm-up steps excluded, "
             + (f"{c['steps']} timed steps per cell" if c["steps"] else f"{c['epochs']} epoch(s) per cell")
             + (f", median of {c['repeats']} interleaved repeats" if c.get("repeats", 1) > 1 else ""),
             "# step: mean wall time of a timed step (slowest worker); samples/s = workers x batch / step;",
             "# epoch: x = extrapolated (step x steps per epoch), m = measured; speed-up: samples/s over the",
             "# smallest-worker cell of the same strategy/batch/loader/amp; efficiency = speed-up / worker ratio;",
             f"# every worker runs {c.get('threads_per_worker') or '(cores // ranks)'} thread(s) (OMP_NUM_THREADS) "
             "in every cell;",
             "# data/compute/comm/optim/other: mean over workers of the step split (other: in-loop checks after an",
             "# epoch's last step); sum: (data + compute + comm + optim) / step, the worst worker", "#"]
    body = []
    for r in rows:
        if not r["ok"]:
            body.append([r["strategy"], str(r["workers"]), str(r["ranks"]), str(r["batch_size"]),
                         str(r["loader_workers"]), r["amp"], "FAILED", *["" for _ in COLUMNS[7:]]])
            continue
        s, sums = r["split_s"], r["split_sum_pct"]
        worst = max(sums, key=lambda v: abs(v - 100)) if sums else None
        body.append([r["strategy"], str(r["workers"]), str(r["ranks"]), str(r["batch_size"]), str(r["loader_workers"]),
                     r["amp"], fmt(r["samples_per_s"], 1), _ms(r["step_time_s"]), fmt(r["epoch_time_s"], 1),
                     "m" if r["epoch_time_kind"].startswith("measured") else "x", fmt(r.get("speedup"), 2),
                     fmt(100 * r["efficiency"] if r.get("efficiency") is not None else None, 0),
                     *[_ms(s[k]) for k in (*PARTS, "other_s")], fmt(worst, 1)])
    lines += render_table(COLUMNS, body)
    lines += ["#", "# per rank (mean per timed step):"]
    rank_body = []
    for r in rows:
        for x in r.get("per_rank", []) if r["ok"] else []:
            if x.get("data_s") is None:
                rank_body.append([r["cell"], str(x["rank"]), x["role"], *["-"] * 8])
                continue
            total = sum(x[k] for k in PARTS)
            rank_body.append([r["cell"], str(x["rank"]), x["role"], *[_ms(x[k]) for k in PARTS], _ms(x["other_s"]),
                              _ms(total),
                              _ms(x["step_time_s"]), fmt(x["split_sum_pct"], 1)])
    lines += render_table(RANK_COLUMNS, rank_body)
    net = [(r, g) for r in rows if r["ok"] for g in r.get("network", [])]
    if net:
        lines += ["#", "# network over the timed window: bytes sent on the interface (/proc/net/dev) vs ours"]
        for r, g in net:
            lines.append(f"#   {r['cell']}: {','.join(g['interfaces'])} (ranks {','.join(map(str, g['ranks']))}) "
                         f"{_mb(g['net_tx_bytes'])} MB on the interface, {_mb(g['ours_sent_bytes'])} MB "
                         f"{g['ours_method']} by us, ratio {fmt(g['ratio'], 3)}")
    stragglers = [(r["cell"], r["straggler"]) for r in rows if r["ok"] and r.get("straggler") and r["workers"] > 1]
    if stragglers:
        lines += ["#", "# stragglers:"] + [f"#   {name}: {text}" for name, text in stragglers]
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        lines.append(f"# FAILED {r['cell']}: {r.get('error')} (log: {r['log']})")
    lines.append(f"# elapsed: {result['elapsed_s']:.1f} s")
    return "\n".join(lines)


def _mb(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value / 1e6:.2f}"


def run_matrix(config: ScalingConfig, out: Path) -> int:
    """Run every cell of ``config`` (one launch each), write ``out/scaling.json`` and the table; exit status."""
    from ddtrain.observe import files
    out = Path(out)
    cells = plan(config)
    n_train = check(config, cells)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train = config.train
    print(f"# ddtrain bench scaling: {train.model} on {train.data.data} ({n_train} training samples), "
          f"{len(cells)} cells, {train.profile.warmup_steps} warm-up + "
          f"{f'{train.steps} timed steps' if train.steps else f'{train.epochs} epoch(s)'} each, "
          f"{os.cpu_count()} CPU cores", flush=True)
    runs = [replace(cell, repeat=k) for k in range(config.repeats) for cell in cells]
    progress, rows = Progress(len(runs)), []
    load_start = loadavg()
    for i, cell in enumerate(runs, 1):
        total_steps = train.profile.warmup_steps + train.steps if train.steps else None
        run = run_cell(config, cell, train_argv(config, cell, out / "cells"), out / "cells", progress, i, total_steps)
        row = cell_row(config, cell, run, out / "cells" / f"{cell.name}.json", out)
        rows.append(row)
        note = (f"{row['samples_per_s']:.1f} samples/s, step {1e3 * row['step_time_s']:.1f} ms" if row["ok"]
                else f"FAILED ({row['error']})")
        progress.cell(i, cell, f"{note}, {run['wall_s']:.0f} s", final=True)
    rows = pick_median(rows)
    finish_rows(rows)
    result = {"kind": "ddtrain-bench-scaling", "config": config.as_dict(), "train_samples": n_train,
              "cores": os.cpu_count(), "loadavg_1min": [load_start, loadavg()],
              "elapsed_s": time.perf_counter() - started, "cells": rows}
    warnings = load_warnings([(f"{r['strategy']} batch {r['batch_size']}", r["workers"], r.get("baseline_workers"),
                                r.get("speedup")) for r in rows if r["ok"]],
                             [("at the start", load_start, 0), ("at the end", result["loadavg_1min"][1],
                                                                runs[-1].ranks if runs else 0)], os.cpu_count())
    result["warnings"] = [w[len("# warning: "):] for w in warnings]
    text = "\n".join([render(result), *warnings]) if warnings else render(result)
    files.write_json(out / "scaling.json", result)
    files.atomic_write(out / "scaling.txt", lambda tmp: Path(tmp).write_text(text + "\n"))
    print(text, flush=True)
    print(f"# results: {out}/scaling.json, per cell: {out}/cells/; plots: ddtrain report {out}", flush=True)
    failed = [r["cell"] for r in rows if not r["ok"]]
    if failed:
        print(f"ddtrain: error: {len(failed)} cell(s) failed: {', '.join(failed)} (see their .log files)",
              file=sys.stderr, flush=True)
        return 1
    return 0

