"""Document 001 in the emulated cluster: tree/butterfly against ring all-reduce across message sizes.

    sudo python benchmarks/repro/doc001_collectives.py --out results/cluster/doc001  # ~5.3 min on 2 cores (load 12)

One emulated cluster (8 nodes, --link each way) for everything. On the first 4 nodes, then on
all 8: ``ddtrain bench collectives --algorithms native,ring,ring-async,tree,butterfly`` over
--sizes (its own α-β-γ calibration included, then the JSON). On --order-nodes nodes,
benchmarks/repro/exchange_order.py times a Gloo exchange posted send-first and receive-first.

From each JSON: the measured crossover (the smallest size from which ring is at least as
fast as tree / butterfly at every larger size) and the α-β model's crossover, with α and β
fitted four ways: the bench's own fit (every size of its pairwise exchange, relative
residuals); refits (analysis.fit_alpha_beta) whose β comes only from messages >= --beta-min
bytes (10x the tbf burst by default), on the pairwise exchange and on the lone ping-pong; and
an effective α, the ring's smallest call divided by its 2(p-1) steps, with the ping-pong's β.
Writes OUT/doc001.json, OUT/doc001.md and the bench's own tables (OUT/collectives-<n>.txt);
--analyse-only rewrites the summary from those files without a cluster.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import Clock, HERE, cluster_command, host_line, markdown_table, on_nodes, read_json, run_job, write_json, \
    write_text
from analysis import crossover, fit_alpha_beta, predicted_crossover

ALGORITHMS = "native,ring,ring-async,tree,butterfly"
RIVALS = ("tree", "butterfly")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--nodes", default="4,8", help="node counts (one rank per node)")
    p.add_argument("--link", default="200mbit")
    p.add_argument("--sizes", default="256:8M")
    p.add_argument("--algorithms", default=ALGORITHMS)
    p.add_argument("--calibration-s", type=float, default=4.0)
    p.add_argument("--beta-min", type=int, default=1 << 20, help="refits: smallest message that fixes beta (bytes)")
    p.add_argument("--alpha-max", type=int, default=256, help="refits: largest message that fixes alpha (bytes)")
    p.add_argument("--order-nodes", type=int, default=4, help="run exchange_order.py on this many nodes (0: skip)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--analyse-only", action="store_true",
                   help="no cluster: re-read OUT/collectives-<n>.json and OUT/exchange_order.json, rewrite doc001.*")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from ddtrain.cluster import emulated_cluster
    from ddtrain.cluster.netns import parse_rate, tbf_params

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = [int(n) for n in args.nodes.split(",")]
    clock = Clock()
    started = time.perf_counter()
    link_bps = parse_rate(args.link)
    summary = {"link": args.link, "link_bps": link_bps, "tbf": tbf_params(link_bps), "host": host_line(),
               "beta_min_bytes": args.beta_min, "alpha_max_bytes": args.alpha_max, "runs": [], "order": None}
    if args.analyse_only:
        return reanalyse(out, counts, args, summary, link_bps)
    clock.say(f"cluster of {max(counts + [args.order_nodes])} nodes at {args.link}; {host_line()}")
    with emulated_cluster(max(counts + [args.order_nodes]), args.link) as cluster:
        if args.order_nodes:
            command = ["python", str(HERE / "exchange_order.py"), "--json", str(out / "exchange_order.json")]
            job = run_job(on_nodes(cluster, args.order_nodes), command, out / "exchange_order.log",
                          timeout_s=args.timeout)
            summary["order"] = {"command": cluster_command(args.order_nodes, args.link, command),
                                "returncode": job["returncode"],
                                "rows": read_json(out / "exchange_order.json")["rows"] if job["returncode"] == 0 else None}
            clock.say(f"exchange order: exit {job['returncode']}")
        for n in counts:
            path = out / f"collectives-{n}.json"
            command = ["ddtrain", "bench", "collectives", "--algorithms", args.algorithms, "--sizes", args.sizes,
                       "--calibration-s", str(args.calibration_s), "--json", str(path)]
            clock.say(f"bench collectives on {n} nodes")
            job = run_job(on_nodes(cluster, n), command, out / f"collectives-{n}.txt", timeout_s=args.timeout)
            clock.say(f"{n} nodes: exit {job['returncode']}, {job['wall_s']:.0f} s")
            if job["returncode"] != 0:
                summary["runs"].append({"nodes": n, "returncode": job["returncode"], "log": job["log"]})
                continue
            summary["runs"].append({"nodes": n, "command": cluster_command(n, args.link, command),
                                    "job_wall_s": job["wall_s"], "traffic": job["traffic"],
                                    **analyse(read_json(path), args.beta_min, args.alpha_max, link_bps)})
    summary["elapsed_s"] = time.perf_counter() - started
    write_json(out / "doc001.json", summary)
    text = markdown(summary)
    write_text(out / "doc001.md", text)
    print(text, flush=True)
    clock.say(f"done in {summary['elapsed_s']:.0f} s")
    return 0 if all(r.get("returncode", 0) == 0 for r in summary["runs"]) else 1


def reanalyse(out: Path, counts: list[int], args, summary: dict, link_bps: int) -> int:
    """--analyse-only: the same summary from the files an earlier run left in OUT."""
    old = read_json(out / "doc001.json") if (out / "doc001.json").exists() else {}
    summary.update(host=old.get("host", summary["host"]), order=old.get("order"))
    jobs = {r["nodes"]: r for r in old.get("runs", [])}
    for n in counts:
        bench = read_json(out / f"collectives-{n}.json")
        job = jobs.get(n, {})
        summary["runs"].append({"nodes": n, "command": job.get("command"), "job_wall_s": job.get("job_wall_s"),
                                "traffic": job.get("traffic"), **analyse(bench, args.beta_min, args.alpha_max, link_bps)})
    summary["elapsed_s"] = old.get("elapsed_s")
    write_json(out / "doc001.json", summary)
    text = markdown(summary)
    write_text(out / "doc001.md", text)
    print(text, flush=True)
    return 0


def analyse(bench: dict, beta_min: int, alpha_max: int, link_bps: int) -> dict:
    """Measured times by size, the crossovers measured and predicted under three α-β fits."""
    from ddtrain.costmodel import LinkParams, predict_time

    ranks = bench["world_size"]
    times: dict[str, dict[int, float]] = {}
    for r in bench["rows"]:
        times.setdefault(r["algorithm"], {})[r["size_bytes"]] = r["time_us"] * 1e-6
    sizes = sorted({r["size_bytes"] for r in bench["rows"]})
    wrong = sum(r["wrong"] for r in bench["rows"])
    calib = bench["calibration"]
    gamma = calib["params"]["gamma_s_per_byte"]
    fits = {"bench (all sizes)": (calib["params"]["alpha_s"], calib["params"]["beta_s_per_byte"])}
    for key, label in (("exchange", "pairwise exchange"), ("pingpong", "ping-pong")):
        points = calib.get(key)
        if points:
            try:
                fits[f"{label}, beta >= {beta_min >> 10} KiB"] = fit_alpha_beta(
                    points["sizes"], points["times_s"], beta_min_bytes=beta_min, alpha_max_bytes=alpha_max)
            except ValueError as exc:
                fits[f"{label}: {exc}"] = None
    if "ring" in times and calib.get("pingpong"):
        # A collective's step under load costs what its smallest call shows, not what back-to-back
        # exchanges do: α = the ring's time at the smallest size / its 2(p-1) steps.
        try:
            _, beta = fit_alpha_beta(calib["pingpong"]["sizes"], calib["pingpong"]["times_s"],
                                     beta_min_bytes=beta_min, alpha_max_bytes=alpha_max)
            fits[f"alpha = ring's {sizes[0]} B call / 2(p-1); ping-pong beta"] = (
                times["ring"][sizes[0]] / (2 * (ranks - 1)), beta)
        except ValueError as exc:
            fits[f"effective alpha: {exc}"] = None
    measured = {}
    best_rival = {s: min(times[a][s] for a in RIVALS if a in times and s in times[a]) for s in sizes
                  if any(a in times and s in times[a] for a in RIVALS)}
    for rival, table in [(a, times.get(a)) for a in RIVALS] + [("best of tree/butterfly", best_rival)]:
        if table and "ring" in times:
            measured[rival] = crossover(sizes, times["ring"], table)
    predicted = {}
    for label, fit in fits.items():
        if fit is None:
            continue
        params = LinkParams(alpha_s=fit[0], beta_s_per_byte=fit[1], gamma_s_per_byte=gamma)
        predicted[label] = {"alpha_us": fit[0] * 1e6, "beta_ns_per_byte": fit[1] * 1e9,
                            "bandwidth_of_link": (8 / fit[1] / link_bps) if fit[1] else None}
        for rival in RIVALS:
            predicted[label][rival] = predicted_crossover(
                lambda m, rival=rival: predict_time("ring", m, ranks, params) - predict_time(rival, m, ranks, params))
    fastest = {s: min((times[a][s], a) for a in times if s in times[a])[1] for s in sizes}
    ring_busbw = {r["size_bytes"]: r["busbw_GBps"] * 1e9 * 8 / link_bps for r in bench["rows"] if r["algorithm"] == "ring"}
    return {"ranks": ranks, "sizes": sizes, "times_s": {a: {str(s): t for s, t in v.items()} for a, v in times.items()},
            "fastest": {str(s): a for s, a in fastest.items()}, "ring_busbw_of_link": {str(s): v for s, v in ring_busbw.items()},
            "measured_crossover": measured, "predicted": predicted, "wrong": wrong,
            "calibration_text": _calibration_text(calib), "load_average": bench["host"].get("load_average")}


def _calibration_text(calib: dict) -> str:
    p = calib["params"]
    return (f"alpha {p['alpha_us']:.1f} us, beta {p['beta_s_per_byte'] * 1e9:.2f} ns/B "
            f"({1e-6 / p['beta_s_per_byte'] if p['beta_s_per_byte'] else float('inf'):.1f} MB/s), gamma "
            f"{p['gamma_s_per_byte'] * 1e9:.3f} ns/B")


def _size(b) -> str:
    if b is None:
        return "none"
    b = float(b)
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def markdown(s: dict) -> str:
    lines = [f"Link {s['link_bps'] / 1e6:g} Mbit/s each way (tc tbf burst {s['tbf']['burst']} B); {s['host']}.", ""]
    if s["order"] and s["order"]["rows"]:
        lines += [f"Exchange order (`{s['order']['command']}`):", ""]
        lines.append(markdown_table(["pattern", "posted as", "Mbit/s each way", "of link"],
                                    [[r["pattern"], r["mode"], f"{r['Mbit_per_s']:.1f}", f"{r['of_link']:.3f}"]
                                     for r in s["order"]["rows"]]))
        lines.append("")
    for run in s["runs"]:
        if "sizes" not in run:
            lines.append(f"{run['nodes']} nodes: FAILED (exit {run['returncode']}; {run['log']})")
            continue
        algos = list(run["times_s"])
        lines += [f"### {run['ranks']} nodes", "", f"`{run['command']}` (#wrong total {run['wrong']}; load average "
                                                   f"{run['load_average']} at the start; bench calibration: "
                                                   f"{run['calibration_text']})", ""]
        rows = []
        for size in run["sizes"]:
            busbw = run["ring_busbw_of_link"].get(str(size), float("nan"))
            rows.append([_size(size)] + [f"{1e6 * run['times_s'][a][str(size)]:.0f}" if str(size) in run["times_s"][a]
                                         else "" for a in algos] + [run["fastest"][str(size)], f"{busbw:.3f}"])
        lines.append(markdown_table(["size"] + [f"{a} (us)" for a in algos] + ["fastest", "ring busbw/link"], rows))
        lines += ["", "Crossover (smallest size from which ring is at least as fast at every larger size):", ""]
        head = ["", "alpha (us)", "beta (ns/B)", "beta as a share of the link"] + [f"ring vs {r}" for r in RIVALS]
        rows = [["measured", "", "", ""] + [_size(run["measured_crossover"].get(r)) for r in RIVALS]]
        for label, p in run["predicted"].items():
            rows.append([f"model, {label}", f"{p['alpha_us']:.0f}", f"{p['beta_ns_per_byte']:.2f}",
                         f"{p['bandwidth_of_link']:.3f}" if p["bandwidth_of_link"] else "inf"]
                        + [_size(p[r]) for r in RIVALS])
        lines.append(markdown_table(head, rows))
        lines.append(f"\nMeasured, ring against the faster of tree and butterfly: "
                     f"{_size(run['measured_crossover'].get('best of tree/butterfly'))}.\n")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
