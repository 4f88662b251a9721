"""The report's figures, one function each: the documents' plots, drawn from our results.

Every function takes plain data (rows of ``scaling.json``, a results record, a ``bench
collectives`` result) and a path, writes one PNG and returns its title. matplotlib is
imported only here (``pip install 'ddtrain[report]'``).
"""
from __future__ import annotations

from ddtrain.errors import DDTrainError

PARTS = (("data_s", "data wait"), ("compute_s", "forward+backward"), ("comm_wait_s", "communication wait"),
         ("optimizer_s", "optimizer"), ("other_s", "other (in-loop checks)"))


class NoMatplotlib(DDTrainError):
    """matplotlib is not installed: the report is written without its plots."""


INSTALL = "pip install 'ddtrain[report]'"


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise NoMatplotlib(f"matplotlib is not installed, so the report has no plots: {INSTALL}, then run "
                           "ddtrain report again") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path, title: str) -> str:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return title


def setup_label(row: dict, vary: set[str]) -> str:
    """A line's label: the strategy plus whichever of batch / loader / amp vary in the matrix."""
    parts = [row["strategy"]]
    if "batch_size" in vary:
        parts.append(f"batch {row['batch_size']}")
    if "loader_workers" in vary:
        parts.append(f"{row['loader_workers']} loader workers")
    if "amp" in vary:
        parts.append(f"amp {row['amp']}")
    return ", ".join(parts)


def varying(rows: list[dict], keys=("batch_size", "loader_workers", "amp", "workers", "strategy")) -> set[str]:
    return {k for k in keys if len({r[k] for r in rows}) > 1}


def _by_setup(rows: list[dict]) -> dict[str, list[dict]]:
    vary = varying(rows)
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["ok"]:
            out.setdefault(setup_label(r, vary), []).append(r)
    return {k: sorted(v, key=lambda r: r["workers"]) for k, v in out.items()}


def _lines(rows: list[dict], x: str) -> dict[str, list[dict]]:
    """One line per combination of everything but ``x`` that varies (strategy and workers always named)."""
    vary = varying(rows) - {x, "strategy", "workers"}
    out: dict[str, list[dict]] = {}
    for r in rows:
        if r["ok"]:
            label = f"{r['strategy']}, {r['workers']} worker(s)" + "".join(
                f", {name} {r[key]}" for key, name in (("batch_size", "batch"), ("loader_workers", "loader workers"),
                                                       ("amp", "amp")) if key in vary)
            out.setdefault(label, []).append(r)
    return out


def _against_workers(ax, ylabel: str, workers: list[int]) -> None:
    """The axes of a per-strategy line plot over the number of workers, from zero."""
    ax.set_xlabel("workers")
    ax.set_ylabel(ylabel)
    ax.set_xticks(workers)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def throughput_vs_workers(rows: list[dict], path) -> str:
    """002 Fig 4.1-4.2: images per second against the number of workers, one line per strategy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, members in _by_setup(rows).items():
        ax.plot([r["workers"] for r in members], [r["samples_per_s"] for r in members], "o-", label=label)
    _against_workers(ax, "throughput (samples/s)", sorted({r["workers"] for r in rows}))
    return _save(fig, path, "Throughput against workers, per strategy")


def speedup_vs_workers(rows: list[dict], path) -> str:
    """002 Fig 4.3-4.4: speed-up against workers, with the ideal (linear) line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    workers = sorted({r["workers"] for r in rows})
    base = min(r.get("baseline_workers", workers[0]) for r in rows if r["ok"])
    ax.plot(workers, [w / base for w in workers], "k--", label="ideal (linear)")
    for label, members in _by_setup(rows).items():
        members = [r for r in members if r.get("speedup") is not None]
        ax.plot([r["workers"] for r in members], [r["speedup"] for r in members], "o-", label=label)
    _against_workers(ax, f"speed-up over {base} worker{'s' if base > 1 else ''} (x)", workers)
    return _save(fig, path, "Speed-up against workers, with the ideal line")


def step_split(rows: list[dict], path) -> str:
    """Stacked bars: each worker's mean step split into data wait, compute, communication wait, optimizer."""
    plt = _plt()
    bars = [(f"{r['strategy']} x{r['workers']}\nrank {x['rank']}" if len(varying(rows) - {"strategy", "workers"}) == 0
             else f"{r['cell']}\nrank {x['rank']}", x)
            for r in rows if r["ok"] for x in r["per_rank"] if x.get("data_s") is not None]
    fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(bars) + 2), 4.8))
    bottom = [0.0] * len(bars)
    for key, name in PARTS:
        values = [1e3 * (x.get(key) or 0.0) for _, x in bars]
        ax.bar(range(len(bars)), values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.plot(range(len(bars)), [1e3 * x["step_time_s"] for _, x in bars], "k_", markersize=14,
            label="measured step time")
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=90, fontsize=7)
    ax.set_ylabel("time per step (ms)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path, "Step time split per rank (mean over timed steps)")


def time_vs_batch(rows: list[dict], path) -> str:
    """000 Tables 7.1-7.3: training (epoch) time against batch size, one line per setup."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    setups = _lines(rows, "batch_size")
    kinds = set()
    for label, members in setups.items():
        members.sort(key=lambda r: r["batch_size"])
        kinds |= {r["epoch_time_kind"] for r in members}
        ax.plot([r["batch_size"] for r in members], [r["epoch_time_s"] for r in members], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size per worker")
    ax.set_ylabel(f"epoch time (s, {'/'.join(sorted(kinds))})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return _save(fig, path, "Training time per epoch against batch size, per setup")


def time_vs_loader_workers(rows: list[dict], path) -> str:
    """004 §6.2.3: epoch time against data-loader worker processes."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, members in _lines(rows, "loader_workers").items():
        members.sort(key=lambda r: r["loader_workers"])
        ax.plot([r["loader_workers"] for r in members], [r["epoch_time_s"] for r in members], "o-", label=label)
    ax.set_xticks(sorted({r["loader_workers"] for r in rows}))
    ax.set_xlabel("data-loader worker processes per rank")
    ax.set_ylabel("epoch time (s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path, "Epoch time against data-loader workers")


def utilisation_timeline(record: dict, label: str, path) -> str:
    """002 Fig 4.5-4.22: CPU (and GPU) utilisation and network traffic per rank over time."""
    from ddtrain.observe.monitor import rates
    plt = _plt()
    ranks = record["monitor"]["ranks"]
    gpu = any(v is not None for r in ranks for v in r["samples"]["gpu_util_pct"])
    panels = 4 if gpu else 3
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.3 * panels), sharex=True)
    window = next((r["window_s"] for r in (record.get("profile") or {}).get("ranks", [])
                   if r.get("window_s") and r["role"] == "worker"), None)
    for r in ranks:
        s, name = r["samples"], f"rank {r['rank']} ({r['role']})"
        axes[0].plot(s["t_s"], s["cpu_process_pct"], label=name)
        if gpu:
            axes[1].plot(s["t_s"], s["gpu_util_pct"], label=name)
        column = "counted_bytes_sent" if any(s["counted_bytes_sent"]) else "strategy_bytes_sent"
        t, v = rates(s, column)
        axes[-1].plot(t, [x / 1e6 for x in v], label=f"{name}, {'counted' if column.startswith('counted') else 'strategy'}")
    host = ranks[0]["samples"]
    axes[0].plot(host["t_s"], [None if v is None else v * (ranks[0]["cores"] or 1) for v in host["cpu_host_pct"]],
                 "k:", label="whole host (all processes)")
    axes[0].set_ylabel("CPU (% of one core)")
    if gpu:
        axes[1].set_ylabel("GPU utilisation (%)")
    net_ax, seen = axes[-2], set()
    for r in ranks:
        key = (r["host"], r["netns"], tuple(r["interfaces"]))
        if not r["interfaces"] or key in seen:
            continue
        seen.add(key)
        shared = [x["rank"] for x in ranks if (x["host"], x["netns"], tuple(x["interfaces"])) == key]
        who = f"{','.join(r['interfaces'])} of rank{'s' if len(shared) > 1 else ''} {','.join(map(str, shared))}"
        for column, style in (("net_tx_packets", "-"), ("net_rx_packets", "--")):
            t, v = rates(r["samples"], column)
            net_ax.plot(t, [x / 1e3 for x in v], style, label=f"{who}: {column[4:6]}")
    net_ax.set_ylabel("packets (k/s)")
    axes[-1].set_ylabel("our bytes sent (MB/s)")
    axes[-1].set_xlabel("time since training started (s, rank 0's clock)")
    for ax in axes:
        ax.set_ylim(bottom=0)
        if window:
            ax.axvspan(window[0], window[1], color="0.9", zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper right")
    return _save(fig, path, f"{label}: CPU utilisation and network traffic per rank over time "
                            "(grey: timed steps)")


def busbw_vs_size(result: dict, path) -> str:
    """nccl-tests' figure: bus bandwidth against message size, the model's prediction dashed."""
    from ddtrain.bench.collectives import plot_busbw
    _plt()  # our own message without matplotlib: plot_busbw's speaks of bench collectives' --plot flag
    plot_busbw(result, path)
    return (f"Bus bandwidth against message size, {result['world_size']} ranks "
            f"({result['backend']} on {result['device']})")


def measured_vs_model(points: list[tuple[str, float, float]], what: str, path) -> str:
    """Measured against cost-model time, log-log, with the line where they are equal."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 5))
    for i, label in enumerate(dict.fromkeys(p[0] for p in points)):
        mine = [(m, p) for name, m, p in points if name == label and m > 0 and p > 0]
        ax.plot([p for _, p in mine], [m for m, _ in mine], "o", color=f"C{i}", label=label)
    values = [v for _, m, p in points for v in (m, p) if v > 0]
    if values:
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", label="measured = predicted")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import NullFormatter
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short log ranges
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("cost-model time (s)")
    ax.set_ylabel("measured time (s)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return _save(fig, path, f"Measured against cost-model time: {what}")


def training_curves(runs: list[tuple[str, dict]], path) -> str:
    """Train loss and validation accuracy against epoch, one line per results record (``(label, record)``)."""
    plt = _plt()
    val = any(e.get("val_accuracy") is not None for _, r in runs for e in r["epochs"])
    fig, axes = plt.subplots(1, 2 if val else 1, figsize=(10 if val else 6, 4), squeeze=False)
    for label, record in runs:
        epochs = record["epochs"]
        axes[0][0].plot([e["epoch"] for e in epochs], [e.get("train_loss") for e in epochs], "o-", label=label)
        if val:
            axes[0][1].plot([e["epoch"] for e in epochs], [e.get("val_accuracy") for e in epochs], "o-", label=label)
    axes[0][0].set_ylabel("train loss")
    if val:
        axes[0][1].set_ylabel("validation accuracy")
    for ax in axes[0]:
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path, "Training curves per run" + (": loss and validation accuracy" if val else ": loss"))


def balance_over_steps(balance: dict, label: str, path) -> str:
    """Each rank's share of the global batch, and its step and local time, at every --balance re-measure."""
    plt = _plt()
    history = balance["history"]
    steps = [h["step"] for h in history]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    # the shares in force: the first ones from step 0, each change from its first step, held to the last window
    changes = [(0, history[0]["shares"])] + [(h["from_step"], h["new_shares"]) for h in history if "new_shares" in h]
    changes.append((max(steps[-1], changes[-1][0]), changes[-1][1]))
    for rank in range(len(history[0]["shares"])):
        axes[0].step([c[0] for c in changes], [c[1][rank] for c in changes], where="post", label=f"rank {rank}")
        line, = axes[1].plot(steps, [1e3 * h["local_s"][rank] for h in history], "o-", label=f"rank {rank} local")
        axes[1].plot(steps, [1e3 * h["step_s"][rank] for h in history], "--", color=line.get_color(),
                     label=f"rank {rank} step")
    axes[0].set_ylabel("share of the global batch (samples)")
    axes[1].set_ylabel("time per step (ms)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path, f"Shares and step times over the run: {label}")
