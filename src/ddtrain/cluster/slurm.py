"""A real SLURM inside the emulated cluster: munge, ``slurmctld`` and one ``slurmd`` per emulated node.

Every daemon lives in a node's network namespace, entered with ``nsenter --net`` (not ``ip
netns exec``, which remounts /sys, where slurmd then misses /sys/fs/cgroup), in its own UTS
and mount namespaces: ``hostname nI`` and a bind-mounted /etc/hosts naming every node, so
node names resolve to their 198.18.0.x addresses for the daemons and for every task they
start (ddtrain.init takes the master address from SLURM_JOB_NODELIST). Configuration,
munge key and socket, spool, state and logs are all in one private folder; the daemons run in
the foreground as root (``proctrack/linuxproc``, ``task/none``: no cgroups needed), so the
cluster's teardown (every process in every node namespace) stops them and the folder goes.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from ddtrain.errors import DDTrainError
from ddtrain.cluster import netns
from ddtrain.cluster.links import LINK_ENV, NODE_ENV, SERVER_LINK_ENV
from ddtrain.cluster.run import RunResult, NodeTraffic

DAEMONS = {"munged": "munge", "slurmctld": "slurmctld (slurm-wlm)", "slurmd": "slurmd (slurm-wlm)",
           "srun": "slurm-client (slurm-wlm)", "sinfo": "slurm-client (slurm-wlm)", "nsenter": "util-linux",
           "unshare": "util-linux"}
CPUS_PER_NODE = 4          # what slurm.conf promises each node (config_overrides: the 2-core host is not asked)
READY_TIMEOUT_S = 60.0
# squeue's reasons of a pending job that waiting does not resolve in the emulated cluster (no other user, no
# node coming back): the job is cancelled, its reason said, within seconds (issue 32: an sbatch asking 8 CPUs per
# task of 4-CPU nodes waited silently for the hour of --timeout-s). "Resources" is one too when the request is
# larger than a node or than the cluster, or when no running job will free what it waits for.
NEVER_RESOLVES = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "ReqNodeNotAvail",
                  "NodeDown", "InvalidQOS", "InvalidAccount")
PENDING_GRACE_S = 5.0      # a reason must hold this long (the scheduler's first pass may not have run)
POLL_S = 1.0


def missing_requirements() -> list[str]:
    """The commands this machine lacks to run SLURM in the emulated cluster, one phrase each."""
    return [f"the '{tool}' command (apt-get install {package.split()[0]})"
            for tool, package in DAEMONS.items() if shutil.which(tool) is None]


@dataclass
class Slurm:
    """A running SLURM: its folder, the slurm.conf path, and the environment its clients need."""

    folder: str
    conf: str
    hosts: str
    node_names: list[str]

    def env(self) -> dict:
        return {"SLURM_CONF": self.conf}


def node_name(index: int) -> str:
    return f"n{index}"


def in_node(node: netns.Node, argv: list[str], hosts: str) -> list[str]:
    """``argv`` inside ``node``: its network namespace, its own hostname and an /etc/hosts naming every node."""
    script = (f"hostname {node_name(node.index)} && mount --bind {shlex.quote(hosts)} /etc/hosts && "
              f"exec {' '.join(shlex.quote(a) for a in argv)}")
    return ["nsenter", f"--net=/run/netns/{node.namespace}", "unshare", "--uts", "--mount", "--propagation",
            "private", "sh", "-c", script]


def _config(cluster: netns.Cluster, folder: str) -> str:
    nodes = "\n".join(f"NodeName={node_name(n.index)} NodeAddr={n.address} NodeHostname={node_name(n.index)} "
                      f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for n in cluster.nodes)
    return f"""# written by ddtrain.cluster.slurm for emulated cluster {cluster.run_id}
ClusterName=ddtrain
SlurmctldHost={node_name(0)}({cluster.master_addr})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge.socket
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool-%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=3
MinJobAge=10
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def start(cluster: netns.Cluster, *, log=None) -> tuple[Slurm, list[subprocess.Popen]]:
    """Write the configuration, start munged, slurmctld and every slurmd; wait until every node is idle.

    Returns the Slurm and the daemon processes. The caller's teardown of the node namespaces
    stops them; ``cleanup(slurm)`` removes the folder. Raises DDTrainError (with the end of the
    daemons' logs) when SLURM is not up within READY_TIMEOUT_S.
    """
    missing = missing_requirements()
    if missing:
        raise DDTrainError("cannot run SLURM in the emulated cluster; missing: " + "; ".join(missing))
    sweep_folders()
    folder = tempfile.mkdtemp(prefix=f"{cluster.run_id}-slurm-")
    os.chmod(folder, 0o700)
    os.makedirs(f"{folder}/state")
    hosts = f"{folder}/hosts"
    with open(hosts, "w") as f:
        f.write("127.0.0.1 localhost\n" + "".join(f"{n.address} {node_name(n.index)}\n" for n in cluster.nodes))
    os.chmod(hosts, 0o644)
    key = f"{folder}/munge.key"
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    conf = f"{folder}/slurm.conf"
    with open(conf, "w") as f:
        f.write(_config(cluster, folder))
    slurm = Slurm(folder, conf, hosts, [node_name(n.index) for n in cluster.nodes])
    env = {**os.environ, **slurm.env()}
    out = log if log is not None else subprocess.DEVNULL
    head = cluster.nodes[0]
    procs = [subprocess.Popen(in_node(head, ["munged", "--foreground", "--force", f"--socket={folder}/munge.socket",
                                             f"--key-file={key}", f"--log-file={folder}/munged.log",
                                             f"--pid-file={folder}/munged.pid", f"--seed-file={folder}/munged.seed"],
                                      hosts), env=env, stdout=out, stderr=out, start_new_session=True)]
    _wait_for(lambda: os.path.exists(f"{folder}/munge.socket"), "munged did not create its socket", slurm, procs)
    procs.append(subprocess.Popen(in_node(head, ["slurmctld", "-D", "-i", "-f", conf], hosts), env=env,
                                  stdout=out, stderr=out, start_new_session=True))
    for node in cluster.nodes:
        procs.append(subprocess.Popen(in_node(node, ["slurmd", "-D", "-N", node_name(node.index), "-f", conf], hosts),
                                      env=env, stdout=out, stderr=out, start_new_session=True))
    _wait_for(lambda: _all_idle(cluster, slurm), f"the {len(cluster.nodes)} slurmd did not all become idle", slurm,
              procs)
    return slurm, procs


def _all_idle(cluster: netns.Cluster, slurm: Slurm) -> bool:
    done = subprocess.run(in_node(cluster.nodes[0], ["sinfo", "-h", "-N", "-o", "%N %t"], slurm.hosts),
                          capture_output=True, text=True, env={**os.environ, **slurm.env()}, timeout=30)
    states = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
    return len(states) == len(cluster.nodes) and all(s == "idle" for s in states.values())


def _wait_for(ready, what: str, slurm: Slurm, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.3)
    raise DDTrainError(f"SLURM did not start in the emulated cluster: {what}; " + _log_tail(slurm.folder))


def _log_tail(folder: str) -> str:
    lines = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".log"):
            with open(os.path.join(folder, name), errors="replace") as f:
                tail = [ln.strip() for ln in f.readlines()[-3:] if "error" in ln.lower() or "fatal" in ln.lower()]
            lines += [f"{name}: {ln}" for ln in tail]
    return "; ".join(lines) or f"no error in the logs under {folder}"


def squeue(cluster: netns.Cluster, slurm: Slurm) -> list[dict]:
    """Every job SLURM holds: id, name, state, reason, CPUs and nodes asked for."""
    done = subprocess.run(in_node(cluster.nodes[0], ["squeue", "-h", "-o", "%i|%j|%T|%r|%C|%D"], slurm.hosts),
                          capture_output=True, text=True, env={**os.environ, **slurm.env()}, timeout=30)
    jobs = []
    for line in done.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 6:
            job, name, state, reason, cpus, nodes = parts
            jobs.append({"id": job, "name": name, "state": state, "reason": reason,
                         "cpus": int(cpus) if cpus.isdecimal() else 0, "nodes": int(nodes) if nodes.isdecimal() else 1})
    return jobs


def never_starts(jobs: list[dict], nodes: int, cpus_per_node: int = CPUS_PER_NODE) -> str | None:
    """Why a pending job of ``jobs`` cannot start in a cluster of ``nodes`` nodes of ``cpus_per_node`` CPUs (None:
    every pending job may still start)."""
    running = any(j["state"] in ("RUNNING", "COMPLETING") for j in jobs)
    for j in jobs:
        if j["state"] != "PENDING":
            continue
        per_node = -(-j["cpus"] // max(1, j["nodes"]))
        size = (f"{j['cpus']} CPU(s) on {j['nodes']} node(s)" + (f" ({per_node} per node)" if j["nodes"] > 1 else ""))
        cluster = f"this emulated cluster has {nodes} node(s) of {cpus_per_node} CPUs"
        if j["nodes"] > nodes or per_node > cpus_per_node:
            return (f"SLURM job {j['id']} ({j['name']}) is pending (reason: {j['reason']}) and can never start: it "
                    f"asks for {size} and {cluster}; ask for at most {cpus_per_node} CPUs per node (--cpus-per-task "
                    f"x --ntasks-per-node) and {nodes} node(s), or give cluster run more --nodes")
        if j["reason"] in NEVER_RESOLVES or (j["reason"] == "Resources" and not running):
            return (f"SLURM job {j['id']} ({j['name']}) is pending (reason: {j['reason']}) and nothing in the cluster "
                    f"will change that: it asks for {size} and {cluster}")
    return None


def cancel_all(cluster: netns.Cluster, slurm: Slurm) -> None:
    """``scancel`` every job (a stuck one, so that ``sbatch --wait`` returns)."""
    jobs = [j["id"] for j in squeue(cluster, slurm)]
    if jobs:
        subprocess.run(in_node(cluster.nodes[0], ["scancel", *jobs], slurm.hosts), capture_output=True,
                       env={**os.environ, **slurm.env()}, timeout=30)


def wait_watching_the_queue(proc: subprocess.Popen, cluster: netns.Cluster, slurm: Slurm, timeout_s: float,
                            ) -> int:
    """Wait for ``proc`` (srun, sbatch --wait) like ``proc.wait(timeout_s)``; a pending job whose reason cannot
    resolve is cancelled after ``PENDING_GRACE_S`` and said (DDTrainError: its reason, what it asks, what the
    cluster has)."""
    deadline = time.monotonic() + timeout_s
    stuck_since, why = None, None
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        try:
            why = never_starts(squeue(cluster, slurm), len(cluster.nodes))
        except (subprocess.SubprocessError, OSError):
            why = None
        if why is None:
            stuck_since = None
            continue
        stuck_since = stuck_since or time.monotonic()
        if time.monotonic() - stuck_since >= PENDING_GRACE_S:
            cancel_all(cluster, slurm)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            raise DDTrainError(f"{why}; the job was cancelled")


def run_command(cluster: netns.Cluster, slurm: Slurm, command: list[str], *, env: dict | None = None,
                stdout=None, stderr=None) -> subprocess.Popen:
    """Start ``command`` (``srun …``, ``sbatch --wait …``) on the head node, where a login node would run it."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(slurm.env(), **(env or {}))
    return subprocess.Popen(in_node(cluster.nodes[0], command, slurm.hosts), env=full, stdout=stdout, stderr=stderr,
                            start_new_session=True)


def cleanup(slurm: Slurm | None) -> None:
    """Remove SLURM's folder (config, key, state, logs); the processes went with the namespaces."""
    if slurm is not None:
        shutil.rmtree(slurm.folder, ignore_errors=True)


def sweep_folders() -> list[str]:
    """Remove the SLURM folders of runs whose owner is gone (killed by SIGKILL, so no teardown ran)."""
    removed = []
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        parts = name.split("-")
        if name.startswith(netns.PREFIX) and "-slurm-" in name and parts[1].isdigit() \
                and not os.path.exists(f"/proc/{parts[1]}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


def run_with_slurm(cluster: netns.Cluster, command: list[str], *, timeout_s: float = 3600.0, env: dict | None = None,
                   stdout=None, stderr=None) -> RunResult:
    """Start SLURM in ``cluster``, run ``command`` on the head node, then stop every process and remove SLURM's folder.

    The ranks SLURM starts inherit the command's environment (SLURM's default), so nothing
    node-specific is set there: Gloo finds each node's address from its hostname.
    """
    if timeout_s <= 0:
        raise DDTrainError(f"timeout must be positive, got {timeout_s}")
    before = [netns.interface_bytes(node) for node in cluster.nodes]
    start_t = time.monotonic()
    slurm, returncode = None, 0
    extra = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), LINK_ENV: str(cluster.link_bps),
             SERVER_LINK_ENV: str(cluster.nodes[cluster.server_node].link_bps), NODE_ENV: "0"}
    if not os.environ.get("DDTRAIN_DEBUG"):
        extra.update(LOGLEVEL="CRITICAL", TORCH_CPP_LOG_LEVEL="ERROR")
    try:
        slurm, _ = start(cluster)
        proc = run_command(cluster, slurm, command, env={**extra, **(env or {})}, stdout=stdout, stderr=stderr)
        try:
            returncode = wait_watching_the_queue(proc, cluster, slurm, timeout_s)
        except subprocess.TimeoutExpired:
            print(f"ddtrain: error: the job did not finish within {timeout_s:.0f} s; stopping it", flush=True)
            returncode = 124
        returncode = returncode if returncode >= 0 else 128 - returncode
    finally:
        for node in cluster.nodes:  # daemons, steps and tasks: all of them live in the node namespaces
            netns.kill_namespace_processes(node.namespace)
        cleanup(slurm)
    wall_s = time.monotonic() - start_t
    after = [netns.interface_bytes(node) for node in cluster.nodes]
    traffic = [NodeTraffic(node.index, node.address, node.link_bps, a[1] - b[1], a[0] - b[0])
               for node, b, a in zip(cluster.nodes, before, after)]
    return RunResult(returncode, [returncode], wall_s, traffic)
