"""Start a job's ranks inside the emulated nodes and make sure nothing outlives it.

Each node runs one torch.distributed.run agent in its namespace (``ip netns exec``), static
rendezvous (c10d with ``max_restarts``), master on node 0's address, ``GLOO_SOCKET_IFNAME`` set to the node's link, so
every byte between nodes crosses a rate-limited veth (ranks on the same node talk over the
node's own address, i.e. inside the node, as on a real machine). The first node to fail ends
the job: every process in every node namespace is stopped and the job's status is non-zero.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from ddtrain.distributed.env import launcher_variables
from ddtrain.errors import DDTrainError
from ddtrain.cluster import checks, netns
from ddtrain.cluster.links import LINK_ENV, NODE_ENV, NODE_LINK_ENV, SERVER_LINK_ENV

MASTER_PORT = 29500  # every node has its own network stack, so a fixed port cannot collide
# Variables a surrounding launcher may have set; the ranks in the cluster must not see them.
_LAUNCHER_VARS = (*launcher_variables(), "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@contextlib.contextmanager
def emulated_cluster(nodes: int, link, *, server_link=None, server_node: int = 0, keep: bool = False):
    """Create ``nodes`` emulated nodes with ``link`` (e.g. "200mbit") links; yield the Cluster.

    ``server_link`` is a different rate for node ``server_node`` (negative: from the end).

    Refuses (DDTrainError naming what is missing) before creating anything; sweeps leftovers
    of dead earlier runs; tears everything down on exit, on exceptions, Ctrl-C and SIGTERM
    (with ``keep``, processes are stopped but namespaces and links stay for inspection,
    until ``ddtrain cluster clean``).
    """
    checks.preflight()
    link_bps = link if isinstance(link, int) else netns.parse_rate(link)
    server_bps = None if server_link is None else (
        server_link if isinstance(server_link, int) else netns.parse_rate(server_link))
    netns.sweep()
    previous = _raise_on_termination()
    run_id, cluster = netns.new_run_id(), None
    try:
        cluster = netns.create(nodes, link_bps, server_bps, run_id=run_id, server_node=server_node)
        yield cluster
    finally:
        _ignore_termination()  # a second Ctrl-C must not interrupt the teardown
        try:
            if keep and cluster is not None:
                for node in cluster.nodes:
                    netns.kill_namespace_processes(node.namespace)
                netns.mark_kept(cluster)
            else:
                netns.destroy_run(run_id)  # by name: also what a half-finished create left
        finally:
            _restore(previous)


def _raise_on_termination() -> dict:
    """SIGTERM/SIGHUP raise SystemExit (so ``finally`` blocks run); SIGINT raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return previous


def _ignore_termination() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def target_argv(command: list[str]) -> list[str]:
    """The torch.distributed.run target for ``command`` (ddtrain …, python -m M …, python S.py …)."""
    head = os.path.basename(command[0]) if command else ""
    if head == "ddtrain" and len(command) > 1:
        if command[1:3] == ["cluster", "run"]:
            raise DDTrainError("'ddtrain cluster run' cannot run inside an emulated cluster")
        return ["--module", "ddtrain", *command[1:]]
    if head.startswith("python") and len(command) > 2 and command[1] == "-m":
        return ["--module", command[2], *command[3:]]
    if head.startswith("python") and len(command) > 1 and command[1].endswith(".py"):
        return command[1:]
    if head.endswith(".py"):
        return list(command)
    raise DDTrainError(f"the command after -- must be 'ddtrain COMMAND …', 'python -m MODULE …' or "
                       f"'python SCRIPT.py …'; got {' '.join(command) or 'nothing'!r}")


@dataclass
class NodeTraffic:
    """Bytes a node's link carried during the job (kernel counters of its interface)."""

    node: int
    address: str
    link_bps: int
    bytes_sent: int
    bytes_received: int


@dataclass
class RunResult:
    """The job's exit status, each node agent's, the wall time and the per-node traffic."""

    returncode: int
    node_returncodes: list[int]
    wall_s: float
    traffic: list[NodeTraffic] = field(default_factory=list)
    # (seconds since start, [(bytes sent, bytes received) per node] since start), if sampled
    samples: list[tuple[float, list[tuple[int, int]]]] = field(default_factory=list)
    lost_nodes: list[int] = field(default_factory=list)   # nodes whose agent failed while the job went on (min_nodes)

    def traffic_table(self) -> str:
        """Per-node bytes and average rates over the whole job (startup included)."""
        lines = [f"# per-node traffic on the emulated links (interface byte counters over the whole "
                 f"job, {self.wall_s:.2f} s; average = bytes * 8 / that time)",
                 f"# {'node':>4} {'address':>12} {'link_Mbit/s':>11} {'sent_MB':>10} {'recv_MB':>10} "
                 f"{'sent_Mbit/s':>11} {'recv_Mbit/s':>11} {'sent/link':>9} {'recv/link':>9}"]
        wall = max(self.wall_s, 1e-9)
        for t in self.traffic:
            sent, recv = t.bytes_sent * 8 / wall, t.bytes_received * 8 / wall
            lines.append(f"  {t.node:>4} {t.address:>12} {t.link_bps / 1e6:>11.1f} {t.bytes_sent / 1e6:>10.3f} "
                         f"{t.bytes_received / 1e6:>10.3f} {sent / 1e6:>11.2f} {recv / 1e6:>11.2f} "
                         f"{sent / t.link_bps:>9.3f} {recv / t.link_bps:>9.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"returncode": self.returncode, "node_returncodes": self.node_returncodes,
                "wall_s": self.wall_s, "lost_nodes": self.lost_nodes, "traffic": [vars(t) for t in self.traffic],
                "samples": [{"t_s": t, "bytes_sent": [s for s, _ in nodes], "bytes_received": [r for _, r in nodes]}
                            for t, nodes in self.samples]}


def node_argv(cluster: netns.Cluster, node: netns.Node, procs_per_node: int, command: list[str],
              master_port: int = MASTER_PORT, max_restarts: int = 0, min_nodes: int | None = None) -> list[str]:
    """The command line that starts ``node``'s agent inside its namespace.

    Without restarts: the static rendezvous (node ranks as the nodes are numbered). With
    ``max_restarts``: torchrun's c10d rendezvous hosted by node 0's agent (``is_host`` said, as
    the namespaces' hostnames tell torch nothing), every attempt a fresh store (node_env). With
    ``min_nodes`` below the node count, ``--nnodes MIN:MAX``: the agents re-form the job without a
    lost node (elastic membership; node 0 hosts the rendezvous and must stay).
    """
    nnodes = str(len(cluster.nodes))
    if max_restarts:
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.master_addr}:{master_port}",
                      "--rdzv-id", cluster.run_id, "--rdzv-conf", f"is_host={str(node.index == 0).lower()}"]
        if min_nodes is not None and min_nodes < len(cluster.nodes):
            from ddtrain.distributed.launch import elastic_conf
            nnodes, rendezvous = f"{min_nodes}:{len(cluster.nodes)}", elastic_conf(rendezvous)
    else:
        rendezvous = ["--node-rank", str(node.index), "--rdzv-backend", "static",
                      "--master-addr", cluster.master_addr, "--master-port", str(master_port)]
    return ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "ddtrain.cluster.node",
            "--nnodes", nnodes, "--nproc-per-node", str(procs_per_node), *rendezvous,
            "--local-addr", node.address, "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
            *target_argv(command)]


def node_env(cluster: netns.Cluster, node: netns.Node, procs_per_node: int, extra: dict | None = None,
             max_restarts: int = 0) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    if max_restarts:
        # Read by every node's agent when it starts: a store shared by agent and workers keeps the
        # dead attempt's addresses and a restarted group cannot connect (docs/RELIABILITY.md, Restarts).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        # All agents are one run: they may hold the same checkpoint directory (reliability.ownership).
        env.setdefault("DDTRAIN_RUN_ID", f"cluster-{cluster.run_id}")
    ranks_here = procs_per_node * max(1, min(len(cluster.nodes), os.cpu_count() or 1))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks_here)))
    env.update({"GLOO_SOCKET_IFNAME": node.interface, NODE_ENV: str(node.index),
                LINK_ENV: str(cluster.link_bps), SERVER_LINK_ENV: str(cluster.nodes[cluster.server_node].link_bps),
                NODE_LINK_ENV: str(node.link_bps)})
    if not env.get("DDTRAIN_DEBUG"):
        # torchelastic's loggers read LOGLEVEL when created, the C++ side TORCH_CPP_LOG_LEVEL:
        # without these every node prints agent chatter and a reverse-DNS warning per socket.
        env.setdefault("LOGLEVEL", "CRITICAL")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.update(extra or {})
    return env


def run_in_cluster(cluster: netns.Cluster, command: list[str], *, procs_per_node: int = 1,
                   timeout_s: float = 3600.0, env: dict | None = None, stdout=None, stderr=None,
                   sample_s: float = 0.0, max_restarts: int = 0, min_nodes: int | None = None,
                   cpu_limits=None) -> RunResult:
    """Run ``command`` as ``procs_per_node`` ranks on every node; wait, stop everything, measure.

    ``stdout``/``stderr`` are file objects for the ranks' output (default: ours). The job ends
    when every node agent has exited, when one exits non-zero (the rest are stopped) or after
    ``timeout_s`` (status 124). Every process in the node namespaces is gone on return.
    ``sample_s`` > 0 also records every node's byte counters that often (traffic over time).
    ``max_restarts`` > 0 lets every node's agent restart all workers that often after a failure.
    ``min_nodes`` below the node count (with ``max_restarts``) makes the job elastic: a node whose
    agent fails is lost, not fatal, while at least ``min_nodes`` agents run or have finished; the
    others re-form the job without it (``RunResult.lost_nodes`` names it).
    ``cpu_limits`` (a ``cluster.cpu.CpuLimits``): the nodes it limits start inside their cgroups.
    """
    if procs_per_node < 1:
        raise DDTrainError(f"--procs-per-node must be at least 1, got {procs_per_node}")
    if timeout_s <= 0:
        raise DDTrainError(f"timeout must be positive, got {timeout_s}")
    if max_restarts < 0:
        raise DDTrainError(f"--max-restarts must be >= 0, got {max_restarts}")
    if min_nodes is not None and not 1 <= min_nodes <= len(cluster.nodes):
        raise DDTrainError(f"--min-nodes must be in 1..{len(cluster.nodes)} (--nodes), got {min_nodes}")
    if min_nodes is not None and min_nodes < len(cluster.nodes) and not max_restarts:
        raise DDTrainError("--min-nodes below --nodes needs --max-restarts of at least 1 (the agents re-form the "
                           "job by restarting the workers)")
    least = len(cluster.nodes) if min_nodes is None else min_nodes
    argvs = [node_argv(cluster, node, procs_per_node, command, max_restarts=max_restarts, min_nodes=min_nodes)
             for node in cluster.nodes]
    before = [netns.interface_bytes(node) for node in cluster.nodes]
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = [None] * len(cluster.nodes)
    returncode = 0
    samples, next_sample = [], start + sample_s
    try:
        for node, argv in zip(cluster.nodes, argvs):
            procs.append(subprocess.Popen(argv, env=node_env(cluster, node, procs_per_node, env, max_restarts),
                                          stdout=stdout, stderr=stderr, start_new_session=True,
                                          preexec_fn=cpu_limits.preexec(node.index) if cpu_limits else None))
        deadline = start + timeout_s
        while any(code is None for code in codes):
            for i, proc in enumerate(procs):
                if codes[i] is None:
                    codes[i] = proc.poll()
            failed = [c for c in codes if c not in (None, 0)]
            if failed and len(codes) - len(failed) < least:
                returncode = failed[0] if failed[0] > 0 else 128 - failed[0]
                break
            if time.monotonic() > deadline:
                print(f"ddtrain: error: the job did not finish within {timeout_s:.0f} s; stopping it",
                      file=sys.stderr, flush=True)
                returncode = 124
                break
            if sample_s > 0 and time.monotonic() >= next_sample:
                next_sample += sample_s
                now = [netns.interface_bytes(node) for node in cluster.nodes]
                samples.append((time.monotonic() - start,
                                [(a[1] - b[1], a[0] - b[0]) for a, b in zip(now, before)]))
            time.sleep(0.1)
    finally:
        for node in cluster.nodes:  # everything inside the nodes, workers included (own sessions)
            netns.kill_namespace_processes(node.namespace)
        for i, proc in enumerate(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            codes[i] = proc.returncode
    wall_s = time.monotonic() - start
    lost = [i for i, code in enumerate(codes) if code not in (None, 0)] if returncode == 0 else []
    after = [netns.interface_bytes(node) for node in cluster.nodes]
    traffic = [NodeTraffic(node.index, node.address, node.link_bps, a[1] - b[1], a[0] - b[0])
               for node, b, a in zip(cluster.nodes, before, after)]
    return RunResult(returncode, codes, wall_s, traffic, samples, lost)
