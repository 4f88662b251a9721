"""Emulated nodes on one machine: network namespaces, veth links to a bridge, tc tbf rate limits.

Layout of one run (``RUN`` = ``ddtrain-<owner pid>-<random hex>``)::

    RUN-n0 [ddt<hex>n0 198.18.0.1] ==veth== [ddt<hex>b0] \
    RUN-n1 [ddt<hex>n1 198.18.0.2] ==veth== [ddt<hex>b1]  >- bridge ddt<hex>br in RUN-br
    ...                                                   /

Every interface is created directly inside its namespace (``ip -n NS link add``), so nothing
of ours ever appears in the host's root namespace, and deleting a node's namespace destroys
its veth pair. Addresses come from 198.18.0.0/24, the range RFC 2544 sets aside for network
benchmarks; the only route in a node's namespace is that subnet (no default route), so ranks
can reach each other and nothing else, and the host has no route into them. Each link is
limited to RATE in both directions by a tbf qdisc on the egress of both veth ends: the node
end limits what the node sends, the bridge end what it receives.

Namespace names carry the owner's pid, so a later run sweeps away the leftovers of an owner
that died (SIGKILL cannot be caught) without touching a concurrent run that is still alive.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

PREFIX = "ddtrain-"
SUBNET = "198.18.0"          # RFC 2544 benchmarking range, /24: node i is 198.18.0.(i+1)
MAX_NODES = 250
_NAME = re.compile(r"^ddtrain-(\d+)-([0-9a-f]+)-(n\d+|br)$")
KEEP_ALIAS = "ddtrain:keep"  # set on a kept run's bridge, so the startup sweep spares it


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, the name and address of its link, the link's rate."""

    index: int
    namespace: str
    interface: str
    address: str
    link_bps: int


@dataclass(frozen=True)
class Cluster:
    """A live emulated cluster (what ``emulated_cluster`` yields)."""

    run_id: str              # "ddtrain-<pid>-<hex>", the prefix of every namespace of this run
    nodes: tuple[Node, ...]
    bridge_namespace: str
    link_bps: int            # the --link rate (the workers' links)
    server_node: int = 0     # the node that got --server-link (if any)

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address


# ---------------------------------------------------------------- rates and tbf parameters
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "kibit": 2**10, "mibit": 2**20, "gibit": 2**30}


def parse_rate(text: str) -> int:
    """``"200mbit"`` -> 200_000_000 bits/s. tc's own spelling; ``mbps`` is refused as ambiguous."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    unit = match.group(2) if match else ""
    if match and unit.endswith("bps"):
        raise DDTrainError(f"rate {text!r} is ambiguous (tc reads 'mbps' as megabytes per second); "
                           f"write it in bits, e.g. 200mbit or 1gbit")
    if not match or unit not in _UNITS and unit != "":
        raise DDTrainError(f"cannot read rate {text!r}; write a number and one of "
                           f"{', '.join(_UNITS)} (bits per second), e.g. 200mbit")
    bps = int(float(match.group(1)) * _UNITS.get(unit, 1))
    if not 10**5 <= bps <= 10**11:
        raise DDTrainError(f"rate {text!r} is out of range; use 100kbit to 100gbit")
    return bps


def format_rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.4g} {unit}"
    return f"{bps:.4g} bit/s"


def tbf_params(bps: int) -> dict:
    """burst and queue limit (bytes) for a tbf of ``bps``: see docs/EMULATED_CLUSTER.md for why these.

    burst: 4 ms of tokens (at least 64 KiB, one TSO/GSO super-packet), so a dequeue that the
    softirq runs a few ms late on a busy 2-core machine does not waste tokens, and TCP keeps
    the link full. limit: burst + 20 ms of queue, enough for several senders converging on one
    receiver (incast at a parameter server) without tail drops on every burst, small enough
    that a saturated link adds at most ~20 ms of queueing delay.
    """
    bytes_per_s = bps / 8
    burst = max(64 * 1024, int(bytes_per_s * 0.004))
    return {"burst": burst, "limit": burst + int(bytes_per_s * 0.020)}


# ---------------------------------------------------------------- commands
def _run(argv: list[str], *, check: bool = True, timeout_s: float = 30.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise DDTrainError(f"'{' '.join(argv)}' did not finish within {timeout_s:.0f} s") from None
    if check and done.returncode != 0:
        raise DDTrainError(f"'{' '.join(argv)}' failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def list_namespaces() -> list[str]:
    """Every network namespace with our prefix (any run, any owner)."""
    out = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(PREFIX))


def _pids_in(namespace: str) -> list[int]:
    out = _run(["ip", "netns", "pids", namespace], check=False)
    return [int(tok) for tok in out.split() if tok.isdigit() and int(tok) != os.getpid()]


def kill_namespace_processes(namespace: str, grace_s: float = 3.0) -> None:
    """SIGTERM everything living in ``namespace``, then SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(namespace)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _pids_in(namespace)
        if not pids:
            return
    raise DDTrainError(f"processes {pids} in namespace {namespace} survived SIGKILL")


def destroy_run(run_id: str) -> list[str]:
    """End every process of run ``run_id`` and delete its namespaces (and so its links)."""
    removed = []
    namespaces = [ns for ns in list_namespaces() if ns.startswith(run_id + "-")]
    for ns in namespaces:  # stop all processes first, so none is left talking to a dead peer
        kill_namespace_processes(ns)
    for ns in namespaces:
        _run(["ip", "netns", "delete", ns], check=False)
        removed.append(ns)
    return removed


def _owner_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def _is_kept(run_id: str) -> bool:
    out = _run(["ip", "-n", run_id + "-br", "-j", "link", "show"], check=False)
    try:
        return any(link.get("ifalias") == KEEP_ALIAS for link in json.loads(out or "[]"))
    except ValueError:
        return False


def sweep(*, include_kept: bool = False, include_live: bool = False) -> list[str]:
    """Remove the namespaces of runs whose owner process is gone; the names removed.

    The startup sweep of every run spares kept runs (``--keep``) and runs whose owner is still
    alive (a concurrent run); ``ddtrain cluster clean`` can include them.
    """
    runs = {}
    for ns in list_namespaces():
        match = _NAME.match(ns)
        if match:
            runs[f"{PREFIX}{match.group(1)}-{match.group(2)}"] = int(match.group(1))
    removed = []
    for run_id, owner in sorted(runs.items()):
        if owner == os.getpid() and not include_live:
            continue
        if _owner_alive(owner) and not include_live:
            continue
        if not include_kept and _is_kept(run_id):
            continue
        removed += destroy_run(run_id)
    return removed


# ---------------------------------------------------------------- creating
def _tbf(namespace: str, interface: str, bps: int) -> list[str]:
    p = tbf_params(bps)
    return ["tc", "-n", namespace, "qdisc", "replace", "dev", interface, "root", "tbf",
            "rate", f"{bps}bit", "burst", str(p["burst"]), "limit", str(p["limit"])]


def _sysctl_no_ipv6(namespace: str) -> None:
    # IPv6 neighbour discovery would add a trickle of our-own traffic to the byte counters.
    if os.path.isdir("/proc/sys/net/ipv6") and shutil.which("sysctl"):
        _run(["ip", "netns", "exec", namespace, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)


def new_run_id() -> str:
    """``ddtrain-<our pid>-<6 random hex digits>``: unique per run, and says who owns it."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"


def create(nodes: int, link_bps: int, server_link_bps: int | None = None, run_id: str | None = None,
           server_node: int = 0) -> Cluster:
    """Build the namespaces, bridge, links, addresses and rate limits; on failure, undo all.

    ``server_link_bps`` is the rate of node ``server_node``'s link (negative counts from the end).
    """
    if not 1 <= nodes <= MAX_NODES:
        raise DDTrainError(f"--nodes must be 1..{MAX_NODES}, got {nodes}")
    if not -nodes <= server_node < nodes:
        raise DDTrainError(f"--server-node must be in {-nodes}..{nodes - 1} for {nodes} nodes, got {server_node}")
    server_node %= nodes
    run_id = run_id or new_run_id()
    tag = run_id.rsplit("-", 1)[1]
    bridge_ns, bridge = f"{run_id}-br", f"ddt{tag}br"
    try:
        for ns in [bridge_ns] + [f"{run_id}-n{i}" for i in range(nodes)]:
            _run(["ip", "netns", "add", ns])
            _sysctl_no_ipv6(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        _run(["ip", "-n", bridge_ns, "link", "add", bridge, "type", "bridge", "stp_state", "0"])
        _run(["ip", "-n", bridge_ns, "link", "set", bridge, "up"])
        built = []
        for i in range(nodes):
            ns, here, there = f"{run_id}-n{i}", f"ddt{tag}n{i}", f"ddt{tag}b{i}"
            bps = server_link_bps if (i == server_node and server_link_bps) else link_bps
            address = f"{SUBNET}.{i + 1}"
            _run(["ip", "-n", ns, "link", "add", here, "type", "veth", "peer", "name", there,
                  "netns", bridge_ns])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", here])
            _run(["ip", "-n", ns, "link", "set", here, "up"])
            _run(["ip", "-n", bridge_ns, "link", "set", there, "master", bridge, "up"])
            _run(_tbf(ns, here, bps))            # what node i sends
            _run(_tbf(bridge_ns, there, bps))    # what node i receives
            built.append(Node(i, ns, here, address, bps))
        return Cluster(run_id, tuple(built), bridge_ns, link_bps, server_node)
    except BaseException:
        destroy_run(run_id)
        raise


def mark_kept(cluster: Cluster) -> None:
    _run(["ip", "-n", cluster.bridge_namespace, "link", "set", f"ddt{cluster.run_id.rsplit('-', 1)[1]}br",
          "alias", KEEP_ALIAS])


def interface_bytes(node: Node) -> tuple[int, int]:
    """(bytes received, bytes sent) by the node's link so far, from the kernel's counters."""
    out = _run(["ip", "-n", node.namespace, "-j", "-s", "link", "show", "dev", node.interface])
    stats = json.loads(out)[0]["stats64"]
    return stats["rx"]["bytes"], stats["tx"]["bytes"]
