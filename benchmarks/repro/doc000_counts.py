"""Document 000 in the emulated cluster: ring, central and hybrid on 4 nodes at two batch sizes, and
the cost model's communication counts (Table 5.1) against the bytes our counters and the links saw.

    sudo python benchmarks/repro/doc000_counts.py --out results/cluster/doc000  # ~5 min on 2 cores

One emulated cluster of --nodes nodes (one rank each) at --link; every cell is ``ddtrain train
--strategy S --batch-size B ... --profile --monitor-system`` (``bench scaling``'s command) with
document 000's Simple-CNN on MNIST-shaped data. hybrid broadcasts rank 0's parameters every
--sync-every steps (the document: once per epoch; a short run needs a shorter period to see any).

For each cell: step time and throughput; E = all steps run (warm-up included: the counters
count every step), N = the model's gradient values, R = ranks; the Table 5.1 count for E
steps (``ddtrain.costmodel``) against the values our comm counters recorded sent
(``analysis.count_check`` says which view of the formula is compared); and the bytes on every
node's link (kernel interface counters over the whole job, and the monitor's per-rank
/proc/net/dev over the timed window against our counters over the same window).
Writes OUT/scaling.json (``ddtrain report OUT`` draws it), OUT/doc000.json, OUT/doc000.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from common import Clock, host_line, markdown_table, run_training_cells, write_results
from analysis import count_check

METHOD = {"central": "centralized", "ring": "decentralized", "hybrid": "proposed"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--strategies", default="ring,central,hybrid")
    p.add_argument("--batch-sizes", default="16,128", help="per-worker batch sizes")
    p.add_argument("--model", default="simple-cnn")
    p.add_argument("--data", default="synthetic:mnist")
    p.add_argument("--link", default="200mbit")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--sync-every", default="3", help="hybrid: steps between broadcasts")
    p.add_argument("--cell-timeout", type=float, default=300.0)
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ddtrain.bench.scaling import ScalingConfig, check, plan
    from ddtrain.bench.scaling import finish_rows
    from ddtrain.cluster import emulated_cluster
    from ddtrain.cluster.netns import parse_rate

    args = parse_args(argv)
    out = Path(args.out)
    clock = Clock()
    sync_every = int(args.sync_every) if args.sync_every.isdigit() else args.sync_every
    config = ScalingConfig.of(model=args.model, data=args.data, strategies=args.strategies.split(","),
                              workers=[args.nodes], batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
                              steps=args.steps, warmup_steps=args.warmup_steps, sync_every=sync_every,
                              monitor_system=True, monitor_every=0.5, cell_timeout_s=args.cell_timeout)
    cells = plan(config)
    n_train = check(config, cells)
    link_bps = parse_rate(args.link)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    clock.say(f"{len(cells)} cells on {args.nodes} nodes at {args.link}; {host_line()}")
    with emulated_cluster(args.nodes, args.link) as cluster:
        rows = run_training_cells(cluster, config, cells, out, args.link, clock, timeout_s=args.cell_timeout)
    finish_rows(rows)
    result = {"kind": "ddtrain-bench-scaling", "config": config.as_dict(), "train_samples": n_train,
              "cores": os.cpu_count(), "elapsed_s": time.perf_counter() - started, "cells": rows,
              "cluster": {"link": args.link, "link_bps": link_bps, "nodes": args.nodes, "host": host_line()}}
    summary = summarize(result)
    write_results(out, result, "doc000", summary, markdown(result, summary), title="Document 000 in the emulated cluster",
                  no_report=args.no_report, clock=clock, started=started)
    return 0 if all(r["ok"] for r in rows) else 1


def summarize(result: dict) -> dict:
    warm = result["config"]["warmup_steps"]
    cells = []
    for r in result["cells"]:
        if not r["ok"]:
            continue
        steps = r["timed_steps"] + warm
        params = r["gradient_bytes"] // 4
        comm = sorted(r["comm"], key=lambda c: c["rank"])
        op = "ring" if r["strategy"] == "hybrid" else r["strategy"]
        sent = [(c.get("by_operation") or {}).get(op, {}).get("bytes_sent", 0) for c in comm]
        bcast = [(c.get("by_operation") or {}).get("bcast", {}).get("bytes_sent", 0) for c in comm]
        broadcasts = max((c.get("by_operation") or {}).get("bcast", {}).get("messages_received", 0) for c in comm)
        check = count_check(METHOD[r["strategy"]], params, r["ranks"], steps, sent, broadcasts=broadcasts,
                            bcast_sent_bytes=bcast)
        wire = r["cluster"]["traffic"]
        window = [{"node": g["ranks"][0], "wire_sent_MB": _mb(g["net_tx_bytes"]), "ours_sent_MB": _mb(g["ours_sent_bytes"]),
                   "ratio": g["ratio"]} for g in r.get("network") or []]
        cells.append({"cell": r["cell"], "strategy": r["strategy"], "method": METHOD[r["strategy"]],
                      "batch_size": r["batch_size"], "ranks": r["ranks"], "steps": steps, "params": params,
                      "broadcasts": broadcasts, "step_time_s": r["step_time_s"], "samples_per_s": r["samples_per_s"],
                      "compute_s": r["split_s"]["compute_s"], "comm_wait_s": r["split_s"]["comm_wait_s"],
                      "count": check, "ours_sent_MB": [b / 1e6 for b in sent], "bcast_sent_MB": [b / 1e6 for b in bcast],
                      "ours_total_sent_MB": [c["bytes_sent"] / 1e6 for c in comm],
                      "wire_job_sent_MB": [t["bytes_sent"] / 1e6 for t in wire],
                      "wire_job_received_MB": [t["bytes_received"] / 1e6 for t in wire],
                      "window": window, "command": r["cluster"]["equivalent_command"]})
    return {"link_bps": result["cluster"]["link_bps"], "cells": cells}


def _mb(value):
    return None if value is None else value / 1e6


def _list(values, digits=2) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def markdown(result: dict, s: dict) -> str:
    c = result["config"]
    lines = [f"{result['cluster']['nodes']} nodes x 1 rank, link {s['link_bps'] / 1e6:g} Mbit/s each way; "
             f"{result['cluster']['host']}; {c['model']} on {c['data']}; {c['warmup_steps']} warm-up + {c['steps']} "
             f"timed steps per cell; hybrid broadcasts every {c['sync_every']} steps.", ""]
    lines.append(markdown_table(
        ["strategy", "batch/worker", "samples/s", "step (ms)", "compute (ms/step)", "comm wait (ms/step)"],
        [[x["strategy"], x["batch_size"], f"{x['samples_per_s']:.1f}", f"{1e3 * x['step_time_s']:.0f}",
          f"{1e3 * x['compute_s']:.0f}", f"{1e3 * x['comm_wait_s']:.0f}"] for x in s["cells"]]))
    lines += ["", "Table 5.1's count for the E steps run (N = gradient values, R = ranks) against the values our "
                  "counters saw sent (4 bytes a value):", ""]
    lines.append(markdown_table(
        ["strategy", "batch", "N", "R", "E", "broadcasts", "formula", "measured", "measured / formula", "what is compared"],
        [[x["strategy"], x["batch_size"], x["params"], x["ranks"], x["steps"], x["broadcasts"],
          f"{x['count']['formula']:.0f}", f"{x['count']['measured']:.0f}", f"{x['count']['ratio']:.4f}",
          x["count"]["view"]] for x in s["cells"]]))
    lines += ["", "Bytes per node: our counters (all operations, whole job) and the link's kernel counters (whole job, "
                  "start-up and DDP's initial broadcast included); over the timed window, the monitor's "
                  "/proc/net/dev bytes sent against ours:", ""]
    rows = []
    for x in s["cells"]:
        ratios = [w["ratio"] for w in x["window"] if w["ratio"]]
        rows.append([x["strategy"], x["batch_size"], _list(x["ours_total_sent_MB"]), _list(x["wire_job_sent_MB"]),
                     _list(x["wire_job_received_MB"]),
                     f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "n/a"])
    lines.append(markdown_table(["strategy", "batch", "ours sent (MB, per node)", "wire sent (MB, per node)",
                                 "wire received (MB, per node)", "wire / ours, timed window"], rows))
    lines += ["", "Commands (one per cell, all in one 4-node cluster):", "```"]
    lines += [x["command"] for x in s["cells"]] + ["```"]
    if s["cells"]:
        median = statistics.median(x["count"]["ratio"] for x in s["cells"])
        lines.append(f"\nMedian measured / formula over the cells: {median:.4f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
