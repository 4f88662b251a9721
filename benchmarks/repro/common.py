"""What the three cluster reproductions share: one emulated cluster, jobs on a prefix of its nodes, tables.

The reproductions (doc002_ps_vs_ring.py, doc001_collectives.py, doc000_counts.py) each build ONE
emulated cluster with as many nodes as their largest cell needs and run every cell on the first
k nodes of it (``on_nodes``): the namespaces, links and rate limits are the same for every cell,
and the 10 s or so of creating and removing namespaces is paid once. Nodes outside a cell stay
idle (no processes, no traffic); every process of a cell is stopped before the next starts.

Pure functions live in ``analysis.py`` (tested in tests/integration/test_cluster_repro.py).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def on_nodes(cluster, count: int, server_last: bool = False):
    """The same cluster restricted to its first ``count`` nodes (the master stays on node 0).

    ``server_last``: the last of them is the parameter server's node (``ps-*`` make the last
    rank the server), so ``DDTRAIN_SERVER_LINK_BPS`` names that node's link.
    """
    if not 1 <= count <= len(cluster.nodes):
        raise ValueError(f"the cluster has {len(cluster.nodes)} nodes; asked for {count}")
    return dataclasses.replace(cluster, nodes=cluster.nodes[:count], server_node=count - 1 if server_last else 0)


def run_job(cluster, command: list[str], log_path: Path, *, timeout_s: float, sample_s: float = 0.0,
            env: dict | None = None) -> dict:
    """Run ``command`` on every node of ``cluster`` (one rank per node); output to ``log_path``.

    Returns the cluster's RunResult as a dict (exit status, wall time, per-node interface
    bytes, traffic samples) plus the command line, so every figure names its command.
    """
    from ddtrain.cluster import run_in_cluster

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("# " + shlex.join(command) + "\n")
        log.flush()
        result = run_in_cluster(cluster, command, procs_per_node=1, timeout_s=timeout_s, stdout=log,
                                stderr=log, sample_s=sample_s, env=env)
        log.write(result.traffic_table() + "\n")
    out = result.to_dict()
    out.update(command=command, nodes=len(cluster.nodes), link_bps=cluster.link_bps, log=str(log_path))
    return out


def cluster_command(nodes: int, link: str, command: list[str], server_last: bool = False) -> str:
    """The equivalent ``ddtrain cluster run`` command line of one job (what a reader can retype)."""
    extra = ["--server-node", "-1"] if server_last else []
    return shlex.join(["ddtrain", "cluster", "run", "--nodes", str(nodes), "--link", link, *extra, "--", *command])


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub Markdown table; floats are printed as given (format them first)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, data) -> None:
    from ddtrain.observe.files import write_json as _write
    _write(path, data)


def write_text(path: Path, text: str) -> None:
    from ddtrain.observe.files import atomic_write
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def read_json(path: Path):
    return json.loads(Path(path).read_text())


class Clock:
    """Seconds since the reproduction started, for progress lines on stderr."""

    def __init__(self):
        self.start = time.perf_counter()

    def say(self, message: str) -> None:
        print(f"# [{time.perf_counter() - self.start:6.1f} s] {message}", file=sys.stderr, flush=True)


def host_line() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPU cores, load average {load:.1f} (1 min) at the start"


def run_training_cells(cluster, config, cells, out: Path, link: str, clock: Clock, *, timeout_s: float,
                       sample_s: float = 1.0) -> list[dict]:
    """Every ``bench scaling`` cell as ``ddtrain train`` on the first ``cell.ranks`` nodes of ``cluster``.

    The command is ``ddtrain.bench.scaling.train_argv`` (what ``bench scaling`` launches locally);
    the row is ``scaling_output.cell_row`` plus ``row["cluster"]``: the per-node interface
    counters, traffic samples and the equivalent ``ddtrain cluster run`` command line.
    ``ps-*`` cells put their server (the last rank) on the last of their nodes.
    """
    from ddtrain.bench.scaling import train_argv
    from ddtrain.bench.scaling import cell_row

    rows = []
    for cell in cells:
        ps = cell.strategy.startswith("ps-")
        sub = on_nodes(cluster, cell.ranks, server_last=ps)
        command = ["ddtrain", *train_argv(config, cell, out / "cells")]
        log = out / "cells" / f"{cell.name}.log"
        clock.say(f"{cell.name}: {cell.ranks} node(s)")
        job = run_job(sub, command, log, timeout_s=timeout_s, sample_s=sample_s)
        run = {"exit_code": job["returncode"], "timed_out": job["returncode"] == 124, "wall_s": job["wall_s"],
               "log": str(log)}
        row = cell_row(config, cell, run, out / "cells" / f"{cell.name}.json", out)
        row["cluster"] = {**job, "equivalent_command": cluster_command(cell.ranks, link, command, ps)}
        rows.append(row)
        clock.say(f"{cell.name}: " + (f"{row['samples_per_s']:.2f} samples/s, step {row['step_time_s']:.2f} s, "
                                      f"job {job['wall_s']:.0f} s" if row["ok"] else f"FAILED: {row.get('error')}"))
    return rows


def write_results(out: Path, result: dict, doc: str, summary: dict, text: str, *, title: str, no_report: bool,
                  clock: Clock, started: float) -> None:
    """What every reproduction ends with: ``scaling.json``/``.txt`` as ``bench scaling`` writes them,
    the document's summary (``DOC.json``) and Markdown (``DOC.md``), both printed, then ``ddtrain report``."""
    from ddtrain.bench.scaling import render
    write_json(out / "scaling.json", result)
    write_text(out / "scaling.txt", render(result) + "\n")
    write_json(out / f"{doc}.json", summary)
    write_text(out / f"{doc}.md", text)
    print(render(result), flush=True)
    print(text, flush=True)
    if not no_report:
        code = subprocess.call(["ddtrain", "report", str(out), "--title", title])
        clock.say(f"ddtrain report exit status {code}")
    clock.say(f"done in {time.perf_counter() - started:.0f} s")
