"""The report's sections: blocks (headings, paragraphs, tables, figures) from each kind of result.

A block is a tuple: ``("h2", text)``, ``("p", text)``, ``("pre", text)``,
``("table", columns, rows)`` or ``("img", png_path, title)``; ``report`` renders them as
Markdown and as HTML. Table cells are strings, numbers formatted with their unit in the header.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ddtrain.report import plots
from ddtrain.report.auto import auto_blocks
from ddtrain.bench.tables import fmt
from ddtrain.config import record_settings



# a paragraph that says which figure the results do not allow and why; ``build`` lists them (issue 32: the demo's
# folder reported "0 figures" and nothing else)
NOT_DRAWN = "Not drawn:"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _ms(v) -> str:
    return fmt(None if v is None else 1e3 * v, 1)


def _figure(files: Path, name: str, draw, *args) -> tuple:
    """An image block, or (no matplotlib) a line saying which plot is missing and how to get it."""
    path = files / f"{_slug(name)}.png"
    try:
        title = draw(*args, path)
    except plots.NoMatplotlib:
        return ("p", f"(Plot `{path.name}` not drawn: matplotlib is not installed; `{plots.INSTALL}` and run "
                     "`ddtrain report` again to get it.)")
    return ("img", path, title)


def scaling_blocks(path: Path, result: dict, files: Path, calibration: dict | None, all_timelines: bool) -> list:
    c, rows = result["config"], result["cells"]
    ok = [r for r in rows if r["ok"]]
    prefix = _slug(path.parent.name or "scaling")
    blocks: list = [("h2", f"Scaling: {c['model']} on {c['data']}"),
                    ("p", f"From `{path}`: {len(rows)} cells ({len(ok)} ran), {result['cores']} CPU cores, "
                          f"{c['warmup_steps']} warm-up steps left out of every time, "
                          + (f"{c['steps']} timed steps per cell (epoch times extrapolated)" if c["steps"]
                             else f"{c['epochs']} epoch(s) per cell (epoch times measured)")
                          + ". Workers train on data; ps-* cells add their server ranks (column ranks)."
                          + _load_note(result))]
    table = []
    for r in rows:
        if not r["ok"]:
            table.append([r["strategy"], r["workers"], r["ranks"], r["batch_size"], r["loader_workers"], r["amp"],
                          "FAILED", *[""] * 11])
            continue
        s = r["split_s"]
        worst = max(r["split_sum_pct"], key=lambda v: abs(v - 100)) if r["split_sum_pct"] else None
        table.append([r["strategy"], r["workers"], r["ranks"], r["batch_size"], r["loader_workers"], r["amp"],
                      fmt(r["samples_per_s"], 1), _ms(r["step_time_s"]), fmt(r["epoch_time_s"], 1),
                      r["epoch_time_kind"], fmt(r.get("speedup"), 2),
                      fmt(100 * r["efficiency"] if r.get("efficiency") is not None else None, 0),
                      *[_ms(s.get(k)) for k, _ in plots.PARTS], fmt(worst, 1)])
    blocks.append(("table", ["strategy", "workers", "ranks", "batch (/worker)", "loader workers", "amp",
                             "throughput (samples/s)", "step (ms)", "epoch (s)", "epoch time is", "speed-up (x)",
                             "efficiency (%)", "data wait (ms)", "compute (ms)", "comm wait (ms)", "optimizer (ms)",
                             "other (ms)", "4 parts / step (%)"], table))
    if not ok:
        return blocks + [("p", "No cell ran; see the FAILED lines in scaling.txt and the cells' .log files.")]
    vary = plots.varying(ok)
    blocks.append(_figure(files, f"{prefix}-throughput", plots.throughput_vs_workers, ok))
    if "workers" in vary:
        blocks.append(_figure(files, f"{prefix}-speedup", plots.speedup_vs_workers, ok))
    blocks.append(_figure(files, f"{prefix}-step-split", plots.step_split, ok))
    blocks.append(("table", ["cell", "rank", "role", "data wait (ms)", "compute (ms)", "comm wait (ms)",
                             "optimizer (ms)", "other (ms)", "measured step (ms)", "4 parts / step (%)"],
                   [[r["cell"], x["rank"], x["role"], *[_ms(x.get(k)) for k, _ in plots.PARTS], _ms(x["step_time_s"]),
                     fmt(x["split_sum_pct"], 1)] for r in ok for x in r["per_rank"]]))
    if "batch_size" in vary:
        blocks.append(_figure(files, f"{prefix}-time-vs-batch", plots.time_vs_batch, ok))
    else:
        blocks.append(("p", "Training time against batch size (000 Tables 7.1-7.3) needs `--batch-sizes` with "
                            "two or more values."))
    if "loader_workers" in vary:
        blocks.append(_figure(files, f"{prefix}-time-vs-loader", plots.time_vs_loader_workers, ok))
    else:
        blocks.append(("p", "Epoch time against data-loader workers (004 §6.2.3) needs `--loader-workers` with "
                            "two or more values."))
    blocks += _timelines(path, ok, files, prefix, all_timelines)
    blocks += _network(ok)
    stragglers = [f"- {r['cell']}: {r['straggler']}" for r in ok if r.get("straggler") and r["workers"] > 1]
    if stragglers:
        blocks += [("h3", "Stragglers"), ("p", "\n".join(stragglers))]
    blocks += _cost_model(ok, calibration, files, prefix)
    return blocks


def _load_note(result: dict) -> str:
    load = result.get("loadavg_1min")
    if not load or load[0] is None:
        return ""
    note = f" The host's 1-minute load average was {load[0]:.1f} at the start and {load[1]:.1f} at the end"
    if max(load) > result["cores"]:
        note += (f", more than its {result['cores']} cores: other processes competed for the CPU, so times vary "
                 "from run to run (compare the 1-worker cells of different strategies, which run the same code)")
    return note + "."


def _timelines(path: Path, ok: list[dict], files: Path, prefix: str, all_timelines: bool) -> list:
    chosen = ok if all_timelines else [max((r for r in ok if r["strategy"] == s), key=lambda r: r["workers"])
                                       for s in dict.fromkeys(r["strategy"] for r in ok)]
    blocks: list = []
    for r in chosen:
        record = json.loads((path.parent / r["record"]).read_text())
        if record.get("monitor"):
            blocks.append(_figure(files, f"{prefix}-timeline-{r['cell']}", plots.utilisation_timeline, record,
                                  f"{r['strategy']}, {r['workers']} worker(s)"))
    if blocks:
        blocks.insert(0, ("h3", "Utilisation and traffic per rank (002 Fig 4.5-4.22)"))
    return blocks


def _network(ok: list[dict]) -> list:
    rows = [[r["cell"], ",".join(g["interfaces"]), ",".join(map(str, g["ranks"])), fmt(_mb(g["net_tx_bytes"]), 2),
             fmt(_mb(g["ours_sent_bytes"]), 2), g["ours_method"], fmt(g["ratio"], 3)]
            for r in ok for g in r.get("network", [])]
    if not rows:
        return []
    return [("h3", "Bytes on the wire against our counters (timed steps)"),
            ("p", "Interface bytes are the kernel's /proc/net/dev transmit counter (headers and every other "
                  "process's traffic on that interface included); ours are payload bytes counted by ddtrain.comm "
                  "(or the strategy's formula for ddp). Ranks sharing an interface are summed."),
            ("table", ["cell", "interface", "ranks", "interface sent (MB)", "ours sent (MB)", "ours from",
                       "interface / ours"], rows)]


def _mb(v):
    return None if v is None else v / 1e6


def _cost_model(ok: list[dict], calibration: dict | None, files: Path, prefix: str) -> list:
    from ddtrain.costmodel import LinkParams, predict_time
    if not calibration:
        return [("p", "Measured against cost-model time for these cells needs a calibration: put a "
                      "`bench collectives --json` file in this folder.")]
    params = LinkParams(alpha_s=calibration["params"]["alpha_s"],
                        beta_s_per_byte=calibration["params"]["beta_s_per_byte"],
                        gamma_s_per_byte=calibration["params"]["gamma_s_per_byte"])
    rows, points = [], []
    for r in ok:
        from ddtrain.sync import STRATEGIES
        spec = STRATEGIES.get(r["strategy"])  # its cost-model formula (ddtrain.sync.StrategySpec.algorithm)
        algorithm = spec.algorithm if spec is not None else None
        nbytes = r.get("gradient_bytes")
        if algorithm is None or r["ranks"] < 2 or not nbytes:
            continue
        predicted = predict_time(algorithm, nbytes, r["ranks"], params)
        measured = r["split_s"]["comm_wait_s"]
        points.append((r["strategy"], measured, predicted))
        rows.append([r["cell"], algorithm, r["ranks"], fmt(nbytes / 1e6, 2), _ms(predicted), _ms(measured)])
    if not rows:
        return []
    return [("h3", "Communication per step: measured wait against the α-β-γ model"),
            ("p", f"Model: calibration α {calibration['params']['alpha_s'] * 1e6:.1f} us, "
                  f"β {calibration['params']['beta_s_per_byte'] * 1e9:.3f} ns/B; predicted = one all-reduce of the "
                  "gradient bytes with the strategy's algorithm. The measured wait is only the part not hidden "
                  "behind the backward pass, so it can be below the prediction."),
            ("table", ["cell", "model formula", "ranks", "gradient (MB)", "predicted (ms)", "measured wait (ms)"],
             rows),
            _figure(files, f"{prefix}-cost-model", plots.measured_vs_model, points, "gradient sync per step")]


def records_blocks(records: list[tuple[Path, dict]], root: Path, files: Path) -> list:
    rows = []
    blocks: list = [("h2", "Training runs")]
    for path, r in records:
        last = r["epochs"][-1] if r["epochs"] else {}
        profile = r.get("profile") or {}
        settings = record_settings(r["config"])
        rows.append([str(path.relative_to(root)), settings["model"], settings["data"], r["strategy"],
                     r.get("workers", r["world_size"]), len(r["epochs"]), fmt(last.get("time_s"), 2),
                     fmt(profile.get("samples_per_s") or last.get("samples_per_s"), 1),
                     fmt(last.get("train_loss"), 4), fmt(last.get("val_accuracy"), 4)])
    blocks.append(("table", ["record", "model", "data", "strategy", "workers", "epochs", "last epoch (s)",
                             "throughput (samples/s)", "train loss", "val accuracy"], rows))
    runs = [(str(path.relative_to(root)), r) for path, r in records if r["epochs"]]
    if runs:
        blocks.append(_figure(files, "training-curves", plots.training_curves, runs))
    scaling = record_scaling_rows(records, root)
    if any(len({r["workers"] for r in members}) > 1 for members in _setups(scaling).values()):
        blocks.append(("p", "Records of one setup at several worker counts (as `ddtrain demo` writes): throughput is "
                            "the median samples/s over epochs 2 onwards (the first includes start-up); speed-up is "
                            "over the fewest workers of the same model, data, strategy, batch, loader and amp."))
        blocks.append(_figure(files, "records-throughput", plots.throughput_vs_workers, scaling))
        blocks.append(_figure(files, "records-speedup", plots.speedup_vs_workers, scaling))
    else:
        blocks.append(("p", f"{NOT_DRAWN} throughput and speed-up against workers: these records are not of one setup "
                            "at several worker counts (`ddtrain demo` and `ddtrain bench scaling` write such)."))
    blocks += memory_blocks(records, root)
    if not any(r.get("monitor") for _, r in records):
        blocks.append(("p", f"{NOT_DRAWN} CPU and network timelines: no record holds system samples (train with "
                            "`--monitor-system` to get them)."))
    for path, r in records:
        name = _slug(str(path.relative_to(root)))
        if r.get("profile"):
            ranks = [x for x in r["profile"]["ranks"] if x["timed_steps"]]
            blocks.append(("table", ["record", "rank", "data wait (ms)", "compute (ms)", "comm wait (ms)",
                                     "optimizer (ms)", "other (ms)", "measured step (ms)"],
                           [[str(path.relative_to(root)), x["rank"], *[_ms({**x["split_s"], "other_s": x.get("other_s")}[k])
                                                for k, _ in plots.PARTS], _ms(x["step_time_s"])] for x in ranks]))
        if r.get("monitor"):
            blocks.append(_figure(files, f"timeline-{name}", plots.utilisation_timeline, r, str(path.relative_to(root))))
        if (r.get("balance") or {}).get("history"):
            blocks += balance_blocks(str(path.relative_to(root)), r["balance"], files)
        if r.get("auto"):   # --strategy auto: its trials, switches and choice (report/auto.py)
            blocks += auto_blocks(str(path.relative_to(root)), r, lambda slug, draw, *a: _figure(files, slug, draw, *a))
    return blocks


def balance_blocks(label: str, balance: dict, files: Path) -> list:
    """The straggler report of a record trained with --balance: per-rank times and waits, shares over the run."""
    s, last = balance["straggler"], balance["history"][-1]
    changes = sum(1 for h in balance["history"] if "new_shares" in h)
    blocks: list = [("h3", f"Stragglers: {label}"),
                     ("p", f"--balance {balance['mode']}, re-measured every {balance['every']} steps "
                           f"({len(balance['history'])} windows, {changes} share changes; global batch "
                           f"{balance['global_batch']}). Local time: loading, forward and backward up to the rank's "
                           "last gradient; wait: the rest of the step (the others, the all-reduce's tail, the "
                           "optimizer). Means over the windows; per-sample time: the last smoothed value "
                           "(docs/BALANCE.md).")]
    blocks.append(("table", ["rank", "final share (samples)", "per-sample (ms)", "step (ms)", "local (ms)",
                             "wait (ms)"],
                   [[r, balance["final_shares"][r], fmt(last["per_sample_ms"][r], 3), _ms(s["step_s"][r]),
                     _ms(s["local_s"][r]), _ms(s["wait_s"][r])] for r in range(s["ranks"])]))
    blocks.append(("p", f"Slowest rank {s['slowest_rank']}. Predicted step at the last measured speeds: "
                        f"{_ms(s['uniform_step_s'])} ms with equal shares, {_ms(s['balanced_step_s'])} ms with shares "
                        f"proportional to speed ({s['balancing_gain']:.2f}x"
                        + (", worth --balance speed" if s["balancing_gain"] >= 1.05 and balance["mode"] != "speed"
                           else "") + f"; {_ms(s['overhead_s'])} ms of each step is not the slowest rank's local "
                        "work)."))
    blocks.append(_figure(files, f"balance-{_slug(label)}", plots.balance_over_steps, balance, label))
    return blocks


def memory_blocks(records: list[tuple[Path, dict]], root: Path) -> list:
    """Each rank's parameter, gradient and optimizer-state bytes at its optimizer steps (sync.memory), per record."""
    rows = []
    for path, r in records:
        for c in r.get("comm") or []:
            m = c.get("memory")
            if m:
                peak = m.get("cuda_max_allocated_bytes")
                rows.append([str(path.relative_to(root)), r["strategy"], c.get("rank"), fmt(_mb(m["parameter_bytes"]), 3),
                             fmt(_mb(m["gradient_bytes"]), 3), fmt(_mb(m["optimizer_state_bytes"]), 3),
                             fmt(_mb(peak), 1) if peak is not None else "-"])
    if not rows:
        return []
    return [("p", "Memory per rank, measured at the optimizer steps (docs/PERFORMANCE.md, Memory): the storage of "
                  "the parameters, of the gradients the step reads and of the optimizer state; the CUDA peak is "
                  "torch.cuda.max_memory_allocated (activations included)."),
            ("table", ["record", "strategy", "rank", "parameters (MB)", "gradients (MB)", "optimizer state (MB)",
                       "CUDA peak (MB)"], rows)]


def record_scaling_rows(records: list[tuple[Path, dict]], root: Path) -> list[dict]:
    """Results records as the rows of ``scaling.json`` the scaling figures draw (one per record with epochs)."""
    rows = []
    for path, r in records:
        epochs = r["epochs"][1:] or r["epochs"]   # the first epoch includes start-up costs
        rates = sorted(e["samples_per_s"] for e in epochs if e.get("samples_per_s"))
        if not rates:
            continue
        settings = record_settings(r["config"])
        rows.append({"ok": True, "cell": str(path.relative_to(root)), "strategy": r["strategy"],
                     "workers": r.get("workers", r["world_size"]), "batch_size": settings.get("batch_size"),
                     "loader_workers": settings.get("loader_workers", 0), "amp": settings.get("amp", "off"),
                     "samples_per_s": rates[len(rates) // 2], "setup": (settings["model"], settings["data"])})
    for members in _setups(rows).values():
        base = min(members, key=lambda r: r["workers"])
        for r in members:
            r["baseline_workers"] = base["workers"]
            r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
    return rows


def _setups(rows: list[dict]) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["setup"], r["strategy"], r["batch_size"], r["loader_workers"], r["amp"]), []).append(r)
    return out


def collectives_blocks(path: Path, result: dict, root: Path, files: Path) -> list:
    name = _slug(str(path.relative_to(root)))
    blocks: list = [("h2", f"Collectives: {path.relative_to(root)}"),
                    _figure(files, f"busbw-{name}", plots.busbw_vs_size, result)]
    summary = result.get("summary", {})
    rows = [[a, fmt(v, 3), fmt((summary.get("prediction_error_pct", {}).get(a) or {}).get("median_abs"), 1)]
            for a, v in summary.get("avg_busbw_GBps", {}).items()]
    if rows:
        blocks.append(("table", ["algorithm", "mean busbw (GB/s)", "model |error| at >= 1 MiB, median (%)"], rows))
    points = [(r["algorithm"], r["time_us"] / 1e6, r["predicted_us"] / 1e6) for r in result["rows"] if r.get("predicted_us")]
    if points:
        blocks.append(_figure(files, f"cost-model-{name}", plots.measured_vs_model, points,
                              f"one all-reduce, {result['world_size']} ranks"))
    return blocks
