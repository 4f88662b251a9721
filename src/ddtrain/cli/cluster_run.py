"""``ddtrain cluster run``: a ddtrain command on N emulated nodes joined by rate-limited links.

    sudo ddtrain cluster run --nodes 4 --link 200mbit -- ddtrain bench collectives --sizes 1M:64M
    sudo ddtrain cluster run --nodes 2 --link 1gbit --node-cpu 1=0.25 -- ddtrain train --global-batch-size 128 --balance speed
    sudo ddtrain cluster run --nodes 5 --link 200mbit --server-link 1gbit --server-node -1 --traffic-out t.json \
         -- ddtrain train --strategy ps-sync …      # ps-sync's server is the last rank: give it the last node

World size = nodes × procs-per-node (a ``--nproc`` of the inner command is not used: the
cluster is the launcher). With ``--slurm`` a real SLURM runs in the nodes and the command
(``srun …``, ``sbatch --wait …``) runs on node 0; SLURM decides the ranks. Prints each node's traffic at the end; the
exit status is the job's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from ddtrain.errors import DDTrainError
from ddtrain.cluster import cpu, netns, slurm
from ddtrain.cluster.run import emulated_cluster, run_in_cluster, target_argv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, required=True, help="emulated nodes (network namespaces)")
    parser.add_argument("--procs-per-node", type=int, default=1, help="ranks started on every node")
    parser.add_argument("--link", required=True,
                        help="every node's link rate, each direction, in tc's bit units (e.g. 200mbit, 1gbit)")
    parser.add_argument("--server-link", default=None,
                        help="a different rate for the --server-node's link (the parameter server's node)")
    parser.add_argument("--server-node", type=int, default=0,
                        help="which node gets --server-link; negative counts from the end (ddtrain's ps-sync "
                             "and ps-async make the LAST ranks servers: use -1 for them)")
    parser.add_argument("--keep", action="store_true",
                        help="leave namespaces and links in place afterwards (processes are still stopped); "
                             "remove them with 'ddtrain cluster clean'")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="stop the job after this many seconds")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="every node's agent restarts all workers this often after one fails (c10d rendezvous)")
    parser.add_argument("--min-nodes", type=int, default=None,
                        help="elastic membership: the job goes on while at least this many nodes are left (their "
                             "agents re-form it at the new size, resuming from the last checkpoint: give the command "
                             "--checkpoint-dir); implies --max-restarts of at least --nodes minus this; node 0 hosts "
                             "the rendezvous and must stay")
    parser.add_argument("--node-cpu", action="append", default=[], metavar="NODE=FRACTION",
                        help="hold node NODE's processes to FRACTION of one CPU (cgroup CPU quota; repeat for "
                             "other nodes; negative NODE counts from the end, written --node-cpu=-1=0.5), e.g. 1=0.25 "
                             "to make node 1 a straggler; needs root and the cgroup cpu controller (v2 cpu.max, "
                             "else v1 cfs quota); docs/BALANCE.md")
    parser.add_argument("--traffic-out", default=None,
                        help="also write the per-node traffic (and samples) as JSON to this file")
    parser.add_argument("--traffic-interval", type=float, default=0.0,
                        help="sample every node's byte counters this often, in seconds (0: only before and after)")
    parser.add_argument("--slurm", action="store_true",
                        help="start a real SLURM (munge, slurmctld, one slurmd per node) and run the command on "
                             "node 0 as on a login node, e.g. 'srun -N 2 --ntasks-per-node 2 python train.py' or "
                             "'sbatch --wait job.sbatch'")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: 'ddtrain COMMAND …', 'python -m MODULE …' or 'python SCRIPT.py …'")


def main(args) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.slurm:
        if not command:
            raise DDTrainError("--slurm needs a command after --, e.g. srun -N 2 python train.py")
        missing = slurm.missing_requirements()
        if missing:
            raise DDTrainError("cannot run SLURM in the emulated cluster; missing: " + "; ".join(missing))
    else:
        target_argv(command)  # refuse a bad command before touching anything
    if args.nodes < 1 or args.procs_per_node < 1:
        raise DDTrainError(f"--nodes and --procs-per-node must be at least 1, got {args.nodes} and "
                           f"{args.procs_per_node}")
    max_restarts = args.max_restarts
    if args.min_nodes is not None:
        if args.slurm:
            raise DDTrainError("--min-nodes is for the node agents of ddtrain cluster run, not --slurm")
        if not 1 <= args.min_nodes <= args.nodes:
            raise DDTrainError(f"--min-nodes must be in 1..{args.nodes} (--nodes), got {args.min_nodes}")
        max_restarts = max(max_restarts, args.nodes - args.min_nodes)  # one restart per node that may be lost
    if args.traffic_interval < 0:
        raise DDTrainError(f"--traffic-interval must be >= 0, got {args.traffic_interval}")
    node_cpu = cpu.parse(args.node_cpu, args.nodes)
    if node_cpu:
        if args.slurm:
            raise DDTrainError("--node-cpu limits the node agents of ddtrain cluster run, not --slurm's daemons")
        cpu.controller()   # root and a CPU controller, before any namespace exists
    link_bps = netns.parse_rate(args.link)
    server_bps = netns.parse_rate(args.server_link) if args.server_link else None
    try:
        with emulated_cluster(args.nodes, link_bps, server_link=server_bps, server_node=args.server_node,
                              keep=args.keep) as cluster, cpu.limited(cluster.run_id, node_cpu) as limits:
            print(_header(cluster, args.procs_per_node, limits), flush=True)
            if args.slurm:
                result = slurm.run_with_slurm(cluster, command, timeout_s=args.timeout_s)
            else:
                result = run_in_cluster(cluster, command, procs_per_node=args.procs_per_node,
                                        timeout_s=args.timeout_s, sample_s=args.traffic_interval,
                                        max_restarts=max_restarts, min_nodes=args.min_nodes, cpu_limits=limits)
                if result.lost_nodes:
                    print(f"# lost node(s) {', '.join(map(str, result.lost_nodes))} (agent exit status "
                          f"{', '.join(str(result.node_returncodes[i]) for i in result.lost_nodes)}); the job went "
                          f"on with the other {args.nodes - len(result.lost_nodes)}", flush=True)
            print(result.traffic_table(), flush=True)
            if args.traffic_out:
                _write_json(args.traffic_out, {"cluster": {**_describe(cluster, args, command),
                                                           "node_cpu": limits.describe()}, **result.to_dict()})
    except KeyboardInterrupt:
        print("ddtrain: interrupted; the emulated cluster was torn down", file=sys.stderr, flush=True)
        return 130
    if args.keep:
        print(f"# kept: namespaces {cluster.run_id}-n0 … and {cluster.bridge_namespace}; "
              f"enter a node with 'ip netns exec {cluster.nodes[0].namespace} bash'; "
              f"remove with 'ddtrain cluster clean'", flush=True)
    if result.returncode != 0:
        print(f"ddtrain: error: the job failed with exit status {result.returncode} (node agents: "
              f"{result.node_returncodes}); every process was stopped"
              f"{'' if args.keep else ' and the cluster torn down'}", file=sys.stderr, flush=True)
    return result.returncode


def _header(cluster, procs_per_node: int, limits=None) -> str:
    p = netns.tbf_params(cluster.link_bps)
    lines = [f"# emulated cluster {cluster.run_id}: {len(cluster.nodes)} nodes x {procs_per_node} ranks, "
             f"link {netns.format_rate(cluster.link_bps)} each way (tc tbf burst {p['burst']} B, "
             f"limit {p['limit']} B), master {cluster.master_addr}"]
    server = cluster.nodes[cluster.server_node]
    if server.link_bps != cluster.link_bps:
        lines.append(f"# node {server.index} (server) link {netns.format_rate(server.link_bps)}")
    for node, fraction in sorted(limits.limits.items()) if limits is not None else ():
        lines.append(f"# node {node} held to {fraction:g} CPU (cgroup {limits.version} {limits.groups[node]})")
    return "\n".join(lines)


def _describe(cluster, args, command: list[str]) -> dict:
    return {"run_id": cluster.run_id, "nodes": len(cluster.nodes), "procs_per_node": args.procs_per_node,
            "link_bps": cluster.link_bps, "server_node": cluster.server_node,
            "server_link_bps": cluster.nodes[cluster.server_node].link_bps,
            "addresses": [n.address for n in cluster.nodes], "tbf": netns.tbf_params(cluster.link_bps),
            "command": command}


def _write_json(path: str, data: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1)
    os.replace(f.name, path)
