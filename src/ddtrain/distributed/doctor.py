"""``ddtrain doctor``: before any collective, compare what every rank runs on and probe every link.

Each rank writes its facts (Python, torch, CUDA, NCCL, driver, GPU model, the interface its
traffic to the master leaves by, the data's fingerprint) to the rendezvous store, as JSON
under ``ddtrain/doctor/<rank>``; rank 0 reads them all and prints one table, then one line
per field that differs, naming the node (host), the ranks and both values. Only then, with a
Gloo group, rank 0 times a round trip and a 4 MB transfer to every other rank (each link).

``DDTRAIN_DOCTOR_FAKE=node=1,torch=2.0.0`` overrides facts on the named node
(``DDTRAIN_CLUSTER_NODE``, or hostname) — for tests only: it is how the test gives one
emulated node a different torch without installing one.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import time

import torch

FIELDS = ("python", "torch", "cuda", "nccl", "driver", "gpu", "interface", "data")
# Fields that must agree for training to be trustworthy (interface and GPU may differ by design).
MUST_AGREE = ("python", "torch", "cuda", "nccl", "data")
FAKE_ENV = "DDTRAIN_DOCTOR_FAKE"
KEY = "ddtrain/doctor/"


def node_name() -> str:
    """The emulated node's index (inside ``ddtrain cluster run``), else this host's name.

    Under ``cluster run --slurm`` every task inherits the command's DDTRAIN_CLUSTER_NODE (0, the head
    node's) through SLURM, so an srun task's own SLURM_NODEID names its node (issue 32: "node 0" for both).
    """
    node = os.environ.get("DDTRAIN_CLUSTER_NODE")
    if node is None:
        return socket.gethostname()
    slurm_node = os.environ.get("SLURM_NODEID", "")
    if slurm_node.isdecimal() and os.environ.get("SLURM_STEP_ID") not in (None, "", "4294967294"):
        return f"node {slurm_node}"
    return f"node {node}"


def interface_to(address: str) -> str:
    """The network interface this host's traffic to ``address`` leaves by (GLOO_SOCKET_IFNAME if set)."""
    forced = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if forced:
        return forced
    try:
        out = subprocess.run(["ip", "-o", "route", "get", socket.gethostbyname(address)], capture_output=True,
                             text=True, timeout=5).stdout.split()
        return out[out.index("dev") + 1] if "dev" in out else "?"
    except (OSError, ValueError, subprocess.SubprocessError):
        return "?"


def _driver() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        return next((w for w in words if w[:1].isdigit() and "." in w), "?")
    except OSError:
        return "-"


def local_facts(master_addr: str = "127.0.0.1", data: str = "-") -> dict:
    """What this rank runs on; ``data`` is the data's fingerprint (computed by the caller)."""
    cuda = torch.cuda.is_available()
    nccl = "-"
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl = "-"
    facts = {"node": node_name(), "host": socket.gethostname(), "python": platform.python_version(),
             "torch": str(torch.__version__), "cuda": torch.version.cuda or "-", "nccl": nccl,
             "driver": _driver() if cuda else "-", "gpu": torch.cuda.get_device_name() if cuda else "-",
             "interface": interface_to(master_addr), "data": data}
    return _faked(facts)


def _faked(facts: dict) -> dict:
    raw = os.environ.get(FAKE_ENV, "")
    if not raw:
        return facts
    pairs = dict(item.split("=", 1) for item in raw.split(",") if "=" in item)
    where = pairs.pop("node", None)
    if where is not None and facts["node"] not in (f"node {where}", where):
        return facts
    return {**facts, **{k: v for k, v in pairs.items() if k in FIELDS}}


def exchange(store, rank: int, world: int, facts: dict, timeout_s: float = 60.0) -> list[dict] | None:
    """Every rank's facts through ``store`` (rank 0 gets the list, the others None). No collective."""
    store.set(f"{KEY}{rank}", json.dumps(facts))
    if rank != 0:
        return None
    store.wait([f"{KEY}{r}" for r in range(world)], datetime.timedelta(seconds=timeout_s))
    return [json.loads(store.get(f"{KEY}{r}")) for r in range(world)]


def differences(all_facts: list[dict], fields=FIELDS) -> list[str]:
    """One line per field whose value is not the same everywhere: the majority value, and who differs."""
    lines = []
    for field in fields:
        values = [f.get(field) for f in all_facts]
        if len(set(values)) <= 1:
            continue
        # the most common value is the reference; in a tie, rank 0's (the others are named as differing)
        common = max(dict.fromkeys(values), key=values.count)
        odd = [(r, f) for r, f in enumerate(all_facts) if f.get(field) != common]
        for value in sorted({f.get(field) for _, f in odd}):
            who = [(r, f) for r, f in odd if f.get(field) == value]
            nodes = sorted({f["node"] for _, f in who})
            lines.append(f"{field} differs on {', '.join(nodes)} (rank{'s' if len(who) > 1 else ''} "
                         f"{', '.join(str(r) for r, _ in who)}): {value} vs {common} on the others")
    return lines


def table(all_facts: list[dict], links: dict | None = None) -> str:
    """Fixed-width: one row per rank, a column per field (and the link probe's figures, if measured)."""
    cols = ["rank", "node", *FIELDS] + (["rtt_us", "MB/s"] if links else [])
    rows = []
    for r, f in enumerate(all_facts):
        row = [str(r), f["node"], *[str(f.get(k, "?")) for k in FIELDS]]
        if links:
            rtt, bw = links.get(r, (None, None))
            row += ["-" if rtt is None else f"{rtt * 1e6:.0f}", "-" if bw is None else f"{bw / 1e6:.1f}"]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["# " + " ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  " + " ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    if links:
        lines.append("# rtt_us: median round trip of a 4-byte message rank 0 <-> rank (microseconds); "
                     "MB/s: 4 MB sent by rank 0 to the rank and acknowledged, 10^6 B/s")
    return "\n".join(lines)


def probe_links(rank: int, world: int, *, nbytes: int = 4_000_000, pings: int = 5) -> dict:
    """Collective (a process group must exist): rank 0's round trip and bandwidth to every other rank."""
    import torch.distributed as dist
    small, big, results = torch.zeros(1), torch.zeros(nbytes // 4), {}
    for peer in range(1, world):
        if rank == 0:
            rtts = []
            for _ in range(pings):
                t0 = time.perf_counter()
                dist.send(small, peer)
                dist.recv(small, peer)
                rtts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dist.send(big, peer)
            dist.recv(small, peer)
            results[peer] = (sorted(rtts)[len(rtts) // 2], nbytes / (time.perf_counter() - t0))
        elif rank == peer:
            for _ in range(pings):
                dist.recv(small, 0)
                dist.send(small, 0)
            dist.recv(big, 0)
            dist.send(small, 0)
    return results


def check_at_start(store, rank: int, world: int, master_addr: str, timeout_s: float = 60.0) -> str | None:
    """The cheap check at the start of a multi-node job, through ``store``: None when the must-agree fields agree.

    Otherwise every rank gets the same text (the table and one line per difference, from rank
    0), so that all of them can refuse at once rather than wait for a rank that stopped.
    """
    facts = exchange(store, rank, world, local_facts(master_addr), timeout_s)
    if rank == 0:
        found = differences(facts, MUST_AGREE)
        store.set(f"{KEY}verdict", "" if not found else table(facts) + "\n" + "\n".join(f"# {x}" for x in found))
    store.wait([f"{KEY}verdict"], datetime.timedelta(seconds=timeout_s))
    return store.get(f"{KEY}verdict").decode() or None


def check_job_at_start(timeout_s: float = 60.0) -> None:
    """At the start of a multi-node job (ranks on more than one node), refuse when the must-agree fields differ.

    Cheap: one small JSON value per rank through the process group's store, no collective,
    no probe. Skipped in a one-node job (one Python and torch install by construction).
    """
    import torch.distributed as dist

    from ddtrain.distributed import runtime
    from ddtrain.errors import DDTrainError
    if not dist.is_initialized() or runtime.local_world_size() >= dist.get_world_size():
        return
    from ddtrain.distributed.job import default_store, restart_attempt
    store = dist.PrefixStore(f"ddtrain-doctor-{restart_attempt()}", default_store())
    verdict = check_at_start(store, dist.get_rank(), dist.get_world_size(), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                             timeout_s)
    if verdict:
        if dist.get_rank() == 0:
            print(verdict, flush=True)
        first = verdict.splitlines()[-1].lstrip("# ")
        raise DDTrainError(f"the nodes of this job differ: {first} (table above; ddtrain doctor for more; "
                           f"--skip-doctor to start anyway)")
