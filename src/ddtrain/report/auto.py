"""The report of a ``--strategy auto`` run: its trials (predicted against measured), its switches, its choice, and
a picture of the step time over the run with the switches marked (the record's ``auto`` section, docs/AUTO.md)."""
from __future__ import annotations

from ddtrain.bench.tables import fmt


def _ms(v) -> str:
    return fmt(None if v is None else 1e3 * v, 1)


def auto_blocks(name: str, record: dict, figure) -> list:
    """Blocks for one record's ``auto`` section; ``figure(slug, draw, *args)`` makes an image block."""
    auto = record["auto"]
    train_s = sum(e.get("time_s", 0.0) for e in record.get("epochs", []))
    choice = auto.get("choice") or {}
    blocks: list = [("h2", f"auto: {name}"),
                     ("p", f"Allowed besides the exact methods: {', '.join(auto['allow']) or 'nothing'}. "
                           f"Committed to **{choice.get('label', '(no choice: the run ended during the trials)')}**"
                           + (f" at step {choice['step']} (running since step {choice['since_step']}), measured "
                              f"{_ms(choice['measured_step_s'])} ms per step" if choice else "")
                           + f". Selection (calibration, switches, the trials' time beyond the chosen method's) "
                             f"{fmt(auto['selection_s'], 2)} s"
                           + (f", {100 * auto['selection_s'] / train_s:.1f} % of the training time" if train_s else "")
                           + ".")]
    for why in auto.get("risks", {}).values():
        blocks.append(("p", f"Risk: {why}"))
    blocks.append(("table", ["round", "method", "predicted step (ms)", "measured step (ms)", "steps", "from step"],
                   [[t["round"], t["label"], _ms(t["predicted_step_s"]), _ms(t.get("measured_step_s")), t.get("steps"),
                     t.get("start_step")] for t in auto["trials"]]))
    blocks.append(("table", ["step", "from", "to", "why", "build (s)"],
                   [[s["step"], s["from"] or "-", s["to"], s["why"], fmt(s["seconds"], 3)] for s in auto["switches"]]))
    if auto.get("rechecks"):
        blocks.append(("table", ["step", "method", "wait before (ms)", "wait now (ms)", "ratio", "link probe ratio"],
                       [[r["step"], r["label"], _ms(r["baseline_wait_s"]), _ms(r["wait_s"]), fmt(r["ratio"], 2),
                         fmt(r.get("link_ratio"), 2)] for r in auto["rechecks"]]))
    if auto.get("step_times"):
        blocks.append(figure(f"auto-steps-{name}", step_times, auto, name))
    return blocks


def step_times(auto: dict, name: str, path) -> str:
    """Step time (this rank's, ms) against step, one colour per method, a line at every switch and re-check."""
    from ddtrain.report.plots import _plt, _save
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4))
    by_label: dict[str, list] = {}
    for step, seconds, label in auto["step_times"]:
        by_label.setdefault(label, []).append((step, 1e3 * seconds))
    for label, points in by_label.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], ".", markersize=4, label=label)
    top = max(ms for points in by_label.values() for _, ms in points)
    for s in auto["switches"]:
        ax.axvline(s["step"], color="black" if s["why"] == "commit" else "grey", lw=0.8,
                   ls="-" if s["why"] in ("commit", "recheck") else ":")
        ax.text(s["step"], top, f" {s['why']}", rotation=90, va="top", fontsize=7)
    for r in auto.get("rechecks", []):
        ax.axvline(r["step"], color="red", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms, this rank)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path, f"auto: step time over the run, switches marked ({name})")
