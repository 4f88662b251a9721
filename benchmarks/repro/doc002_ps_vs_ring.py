"""Document 002 in the emulated cluster: parameter server (ps-sync) against ring all-reduce, 2/4/6 workers.

    sudo python benchmarks/repro/doc002_ps_vs_ring.py --out results/cluster/doc002  # 6.6-8 min on 2 cores (load 5-12)

One emulated cluster (7 nodes, --link each way, tc tbf) for the whole sweep; every cell is
``ddtrain train ... --profile --monitor-system`` (the very command ``ddtrain bench scaling``
builds: ``ddtrain.bench.scaling.train_argv``) with one rank per node, run on the first k nodes:
ring on ``workers`` nodes, ps-sync on ``workers + 1`` (the server is the last rank, on the last
node, as ``cluster run --server-node -1`` would place it). Ring cells time --steps steps, ps-sync
cells --ps-steps (each of theirs moves 90-270 MB through the server's link). The compute-only
reference is one training step timed in this process (one thread, no communication: wall and
CPU time); --baseline-cell adds a launched one-worker cell too (~45 s of start-up).

Writes OUT/scaling.json (the ``bench scaling`` format, so ``ddtrain report OUT`` draws it), with
the cluster's per-node interface counters added to every cell (``cluster``), OUT/scaling.txt,
OUT/doc002.md (the tables docs/REPRODUCING.md quotes), OUT/doc002_shapes.png (throughput and
per-node traffic against workers) and OUT/doc002_traffic_time.png (send rate per node over
time for the largest cells, as in the document's Figures 4.12/4.13 and 4.21/4.22), then runs
``ddtrain report OUT``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from common import Clock, host_line, markdown_table, run_training_cells, write_results
from analysis import expected_step_bytes, flattening, per_step, rates_over_time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder")
    p.add_argument("--workers", default="2,4,6", help="worker counts (ps-sync adds one server node)")
    p.add_argument("--strategies", default="ps-sync,ring", help="strategies to compare")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--data", default="synthetic:cifar10")
    p.add_argument("--batch-size", type=int, default=4, help="samples per worker per step")
    p.add_argument("--link", default="200mbit", help="every node's link rate, each way")
    p.add_argument("--steps", type=int, default=2, help="timed steps per ring (all-reduce) cell")
    p.add_argument("--ps-steps", type=int, default=1,
                   help="timed steps per ps-* cell (each is 8-23 s of transfers at the defaults)")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--monitor-every", type=float, default=1.0, help="seconds between --monitor-system samples")
    p.add_argument("--traffic-every", type=float, default=1.0, help="seconds between per-node counter samples")
    p.add_argument("--baseline-cell", action="store_true",
                   help="also run a one-worker ddtrain train cell (no communication; ~45 s of start-up) besides "
                        "the in-process compute-only timing")
    p.add_argument("--cell-timeout", type=float, default=300.0)
    p.add_argument("--no-report", action="store_true", help="do not run ddtrain report afterwards")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ddtrain.bench.scaling import Cell, ScalingConfig, check, plan
    from ddtrain.config import parse_kv
    from ddtrain.bench.scaling import finish_rows
    from ddtrain.cluster import emulated_cluster
    from ddtrain.cluster.netns import parse_rate

    args = parse_args(argv)
    out = Path(args.out)
    clock = Clock()
    config = ScalingConfig.of(model=args.model, data=args.data, strategies=args.strategies.split(","),
                              workers=[int(w) for w in args.workers.split(",")], batch_sizes=[args.batch_size],
                              steps=args.steps, warmup_steps=args.warmup_steps, lr=args.lr,
                              model_args=parse_kv(args.model_arg, "--model-arg"), monitor_system=True,
                              monitor_every=args.monitor_every, cell_timeout_s=args.cell_timeout)
    ps_config = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=args.ps_steps))
    cells = [(ps_config if c.strategy.startswith("ps-") else config, c) for c in plan(config)]
    if args.baseline_cell:
        cells.insert(0, (config, Cell("ddp", 1, 1, args.batch_size, 0, "off")))
    n_train = check(config, [c for _, c in cells])
    compute = compute_only(args.model, args.data, args.model_arg, args.batch_size)
    clock.say(f"compute only, one process, one thread: {compute['step_s']:.3f} s per step of {args.batch_size} "
              f"({compute['cpu_s']:.3f} s CPU)")
    nodes = max(c.ranks for _, c in cells)
    parse_rate(args.link)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    clock.say(f"{len(cells)} cells on up to {nodes} nodes at {args.link}; {host_line()}")
    with emulated_cluster(nodes, args.link) as cluster:
        rows = []
        for cell_config, cell in cells:
            rows += run_training_cells(cluster, cell_config, [cell], out, args.link, clock,
                                       timeout_s=args.cell_timeout, sample_s=args.traffic_every)
    finish_rows(rows)
    result = {"kind": "ddtrain-bench-scaling", "config": {**config.as_dict(), "ps_steps": args.ps_steps},
              "compute_only": compute, "train_samples": n_train,
              "cores": os.cpu_count(), "elapsed_s": time.perf_counter() - started, "cells": rows,
              "cluster": {"link": args.link, "link_bps": parse_rate(args.link), "nodes": nodes,
                          "host": host_line(), "script": "benchmarks/repro/doc002_ps_vs_ring.py " + " ".join(
                              sys.argv[1:] if argv is None else argv)}}
    summary = summarize(result)
    plot_shapes(summary, out / "doc002_shapes.png")
    plot_traffic_time(result, out / "doc002_traffic_time.png")
    write_results(out, result, "doc002", summary, markdown(result, summary), title="Document 002 in the emulated cluster",
                  no_report=args.no_report, clock=clock, started=started)
    return 0 if all(r["ok"] for r in rows) else 1


def compute_only(model: str, data: str, model_args: list[str], batch_size: int, steps: int = 5) -> dict:
    """Seconds of one training step (forward, backward, SGD update) in this process, one thread, no communication.

    The one-worker reference without the ~45 s start-up of a launched cell: the same model and
    input shape as the cells, a random batch, median of ``steps`` after one untimed step.
    """
    import statistics as st

    import torch

    from ddtrain.config import TrainConfig
    from ddtrain.config import parse_kv
    from ddtrain.training.build import load_and_build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train = TrainConfig.from_flat(model=model, data=data, val_fraction=0.0, model_args=parse_kv(model_args, "--model-arg"))
        dataset, net = load_and_build(train, meta=False)
        x = torch.randn(batch_size, *dataset.sample_shape)     # content does not change the time
        y = torch.randint(0, dataset.num_classes or 1, (batch_size,))
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        times, cpu = [], []
        for i in range(steps + 1):
            t0, c0 = time.perf_counter(), time.process_time()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
            if i:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
    finally:
        torch.set_num_threads(threads)
    step = st.median(times)
    # wall time depends on how much of a core the machine's other work leaves us; CPU time does not
    return {"step_s": step, "cpu_s": st.median(cpu), "samples_per_s": batch_size / step, "batch_size": batch_size,
            "threads": 1, "steps": steps, "params": sum(p.numel() for p in net.parameters()),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def summarize(result: dict) -> dict:
    """Per cell: throughput, speed-ups, step split, per-node bytes (interface and ours), expected bytes."""
    rows = [r for r in result["cells"] if r["ok"]]
    base = next((r for r in rows if r["strategy"] == "ddp" and r["workers"] == 1), None)
    warm = result["config"]["warmup_steps"]
    ref = result["compute_only"]
    out = {"link_bps": result["cluster"]["link_bps"], "compute_only": ref,
           "baseline_cell": base and {"samples_per_s": base["samples_per_s"], "compute_s": base["split_s"]["compute_s"]},
           "cells": [], "flattening": {}}
    for r in rows:
        if r is base:
            continue
        steps = r["timed_steps"] + warm
        m = r["gradient_bytes"]
        expected = expected_step_bytes(r["strategy"], r["workers"], m)
        nodes = []
        comm = {c["rank"]: c for c in (r.get("comm") or [])}
        for t in r["cluster"]["traffic"]:
            c = comm.get(t["node"], {})      # one rank per node: rank = node
            role = c.get("role", "worker")
            # the steps' traffic only (ps-* also count a final STOP/FINAL exchange, apart)
            c = (c.get("by_operation") or {}).get(r["strategy"], c)
            exp = expected["server"] if role == "server" else expected["worker"]
            nodes.append({"node": t["node"], "role": role,
                          "wire_sent_MB": t["bytes_sent"] / 1e6, "wire_received_MB": t["bytes_received"] / 1e6,
                          "ours_sent_MB_per_step": per_step(c.get("bytes_sent", 0), steps) / 1e6,
                          "ours_received_MB_per_step": per_step(c.get("bytes_received", 0), steps) / 1e6,
                          "expected_MB_per_step": exp[0] / 1e6})
        out["cells"].append({
            "cell": r["cell"], "strategy": r["strategy"], "workers": r["workers"], "ranks": r["ranks"],
            "samples_per_s": r["samples_per_s"], "step_time_s": r["step_time_s"],
            "timed_steps": r["timed_steps"], "speedup_vs_first": r.get("speedup"),
            "speedup_vs_one_worker": r["samples_per_s"] / ref["samples_per_s"],
            "compute_s": r["split_s"]["compute_s"], "comm_wait_s": r["split_s"]["comm_wait_s"],
            "steps_in_job": steps, "job_wall_s": r["cluster"]["wall_s"], "gradient_bytes": m, "nodes": nodes,
            "command": r["cluster"]["equivalent_command"]})
    for strategy in dict.fromkeys(c["strategy"] for c in out["cells"]):
        points = {c["workers"]: c["samples_per_s"] for c in out["cells"] if c["strategy"] == strategy}
        if len(points) >= 2:
            out["flattening"][strategy] = flattening(points)
    return out


def markdown(result: dict, s: dict) -> str:
    link_mbit = s["link_bps"] / 1e6
    lines = [f"Link {link_mbit:g} Mbit/s each way; {result['cluster']['host']}; "
             f"{result['config']['warmup_steps']} warm-up step + {result['config']['steps']} timed steps per ring cell, "
             f"{result['config']['ps_steps']} per ps-sync cell; "
             f"model {result['config']['model']} on {result['config']['data']}, "
             f"batch {result['config']['batch_sizes'][0]} per worker.", ""]
    ref = s["compute_only"]
    lines.append(f"Compute only (one process, one thread, no communication; forward + backward + SGD step of "
                 f"{ref['batch_size']} samples, median of {ref['steps']}): {ref['step_s']:.3f} s per step "
                 f"({ref['cpu_s']:.3f} s of CPU) = {ref['samples_per_s']:.2f} samples/s, load average "
                 f"{ref['load_average']:.1f}; {ref['params']:,} parameters.")
    if s["baseline_cell"]:
        lines.append(f"One-worker `ddtrain train` cell (no communication): {s['baseline_cell']['samples_per_s']:.2f} "
                     f"samples/s, compute {1e3 * s['baseline_cell']['compute_s']:.0f} ms/step.")
    lines.append("")
    rows = [[c["strategy"], c["workers"], c["ranks"], c["timed_steps"], f"{c['samples_per_s']:.2f}",
             f"{c['step_time_s']:.2f}",
             f"{c['speedup_vs_first']:.2f}" if c["speedup_vs_first"] else "",
             f"{c['speedup_vs_one_worker']:.2f}" if c["speedup_vs_one_worker"] else "",
             f"{1e3 * c['compute_s']:.0f}", f"{1e3 * c['comm_wait_s']:.0f}"] for c in s["cells"]]
    lines.append(markdown_table(["strategy", "workers", "nodes", "timed steps", "samples/s", "step (s)",
                                 "speed-up vs 2 workers", "vs compute only", "compute (ms/step)", "comm wait (ms/step)"], rows))
    lines.append("")
    for strategy, value in s["flattening"].items():
        lines.append(f"- {strategy}: throughput gain from the second-largest to the largest worker count = "
                     f"{value:.2f} of proportional (1 = linear, 0 = flat)")
    lines.append("")
    rows = []
    for c in s["cells"]:
        for n in c["nodes"]:
            rows.append([c["strategy"], c["workers"], n["node"], n["role"], f"{n['wire_sent_MB']:.1f}",
                         f"{n['wire_received_MB']:.1f}", f"{n['ours_sent_MB_per_step']:.1f}",
                         f"{n['ours_received_MB_per_step']:.1f}", f"{n['expected_MB_per_step']:.1f}"])
    lines.append(markdown_table(["strategy", "workers", "node", "role", "wire sent (MB, job)",
                                 "wire received (MB, job)", "ours sent (MB/step)", "ours received (MB/step)",
                                 "design (MB/step, each way)"], rows))
    lines += ["", "Commands (one per cell; the script runs them in one cluster, on its first k nodes):", "```"]
    lines += [c["command"] for c in s["cells"]] + ["```"]
    return "\n".join(lines) + "\n"


def plot_shapes(s: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, strategy in enumerate(dict.fromkeys(c["strategy"] for c in s["cells"])):
        cs = [c for c in s["cells"] if c["strategy"] == strategy]
        a.plot([c["workers"] for c in cs], [c["samples_per_s"] for c in cs], "o-", color=f"C{i}", label=strategy)
        busiest = [max(n["ours_sent_MB_per_step"] + n["ours_received_MB_per_step"] for n in c["nodes"]) for c in cs]
        workers = [statistics_mean([n["ours_sent_MB_per_step"] + n["ours_received_MB_per_step"]
                                    for n in c["nodes"] if n["role"] == "worker"]) for c in cs]
        b.plot([c["workers"] for c in cs], busiest, "o-", color=f"C{i}", label=f"{strategy}: busiest node")
        b.plot([c["workers"] for c in cs], workers, "s--", color=f"C{i}", alpha=0.6, label=f"{strategy}: worker node (mean)")
    a.set(xlabel="worker nodes", ylabel="samples/s", ylim=(0, None),
          title=f"throughput (1 worker, compute only: {s['compute_only']['samples_per_s']:.1f} samples/s)")
    b.set(xlabel="worker nodes", ylabel="MB per step (sent + received)", title="per-node traffic per step (our counters)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, path)


def plot_traffic_time(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["cells"] if r["ok"] and r["strategy"] != "ddp"]
    largest = {}
    for r in rows:
        if r["workers"] >= largest.get(r["strategy"], {"workers": 0})["workers"]:
            largest[r["strategy"]] = r
    if not largest:
        return
    fig, axes = plt.subplots(1, len(largest), figsize=(5.5 * len(largest), 4), squeeze=False)
    for ax, (strategy, r) in zip(axes[0], largest.items()):
        roles = {c["rank"]: c["role"] for c in r.get("comm") or []}
        for node in range(r["cluster"]["nodes"]):
            series = rates_over_time(r["cluster"]["samples"], node)
            if series:
                ax.plot([t for t, _, _ in series], [s for _, s, _ in series],
                        label=f"node {node} ({roles.get(node, 'worker')})", lw=2.5 if roles.get(node) == "server" else 1)
        ax.set(xlabel="seconds since the job started", ylabel="Mbit/s sent", title=f"{strategy}, {r['workers']} workers")
        ax.axhline(result["cluster"]["link_bps"] / 1e6, color="grey", ls=":")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    fig.tight_layout()
    _save(fig, path)


def statistics_mean(values):
    return sum(values) / len(values) if values else float("nan")


def _save(fig, path: Path) -> None:
    from ddtrain.observe.files import atomic_write
    import matplotlib.pyplot as plt
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
