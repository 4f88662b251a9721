"""The Kubernetes and SkyPilot files of examples/bridges, run in the environment their platform gives each pod/VM.

No Kubernetes cluster and no cloud ran here. What runs is each file's own container command (or
SkyPilot ``run`` script), read from the YAML, under ``bash`` inside 2 emulated nodes (network
namespaces, ``ddtrain.cluster``), with the variables the platform sets in each pod:
- Kubeflow training-operator v1, elastic PyTorchJob (pkg/controller.v1/pytorch/elastic.go and
  envvar.go): PET_RDZV_ENDPOINT (``<job>-worker-0:<port>``; node 0's address here: the namespaces
  have no cluster DNS), PET_RDZV_BACKEND=c10d, PET_NNODES=MIN:MAX, PET_MAX_RESTARTS,
  PET_NPROC_PER_NODE, PYTHONUNBUFFERED; and MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK counting
  pods, as the operator sets them when the job has a Master replica: ddtrain must not take those for
  a torchrun rank's;
- Kubeflow Trainer v2 TrainJob, torch-distributed runtime: PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT;
- SkyPilot: SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one per line, head first), SKYPILOT_NUM_NODES,
  SKYPILOT_NUM_GPUS_PER_NODE (0 on CPU VMs).
The shared volume is a directory both nodes see; the preemption is the kubelet's SIGTERM to the
container's process (``exec``: ddtrain itself), then the pod recreated alone (1 of the range 1:2).
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from helpers import REPO, why_no_cluster

WHY = why_no_cluster()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
yaml = pytest.importorskip("yaml", reason="pyyaml reads the manifests (pip install pyyaml)")

EXAMPLES = REPO / "examples" / "bridges"
PORT = 29400
TRAIN = "--model mlp --data digits --global-batch-size 48 --lr 0.05 --seed 1 --checkpoint-every 4"


def pytorchjob(node: int, nodes: list[str]) -> tuple[str, dict]:
    spec = yaml.safe_load((EXAMPLES / "kubernetes" / "pytorchjob.yaml").read_text())["spec"]
    container = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    elastic = spec["elasticPolicy"]
    platform = {"PYTHONUNBUFFERED": "0", "PET_RDZV_ENDPOINT": f"{nodes[0]}:{container['ports'][0]['containerPort']}",
                "PET_RDZV_BACKEND": elastic["rdzvBackend"],
                "PET_NNODES": f"{elastic['minReplicas']}:{elastic['maxReplicas']}",
                "PET_MAX_RESTARTS": str(elastic["maxRestarts"]), "PET_NPROC_PER_NODE": spec["nprocPerNode"],
                # with a Master replica the operator also sets these, counting pods
                "MASTER_ADDR": nodes[0], "MASTER_PORT": "23456", "WORLD_SIZE": str(len(nodes)), "RANK": str(node)}
    return container["args"][0], {**{e["name"]: e["value"] for e in container["env"]}, **platform}


def trainjob(node: int, nodes: list[str]) -> tuple[str, dict]:
    trainer = yaml.safe_load((EXAMPLES / "kubernetes" / "trainjob.yaml").read_text())["spec"]["trainer"]
    platform = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": str(node), "PET_MASTER_ADDR": nodes[0], "PET_MASTER_PORT": str(PORT)}
    return trainer["args"][0], {**{e["name"]: e["value"] for e in trainer["env"]}, **platform}


def skypilot(node: int, nodes: list[str]) -> tuple[str, dict]:
    task = yaml.safe_load((EXAMPLES / "skypilot.yaml").read_text())
    platform = {"SKYPILOT_NODE_RANK": str(node), "SKYPILOT_NODE_IPS": "\n".join(nodes),
                "SKYPILOT_NUM_NODES": str(task["num_nodes"]), "SKYPILOT_NUM_GPUS_PER_NODE": "0"}
    return task["run"], {**{k: str(v) for k, v in task["envs"].items()}, **platform}


def start_pods(cluster, platform, tmp_path, train_args: str, which=None, log=None) -> list[subprocess.Popen]:
    """Each node's container command under bash in its namespace, with the platform's and the file's variables."""
    from ddtrain.cluster.run import node_env
    bin_dir = tmp_path / "bin"   # `ddtrain` on PATH is this checkout's, as the image's would be
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "ddtrain"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m ddtrain \"$@\"\n")
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    addresses = [n.address for n in cluster.nodes]
    procs = []
    for node in cluster.nodes if which is None else [cluster.nodes[i] for i in which]:
        script, variables = platform(node.index, addresses)
        variables.update(CHECKPOINT_DIR=str(tmp_path / "shared" / "checkpoints"), TRAIN_ARGS=train_args)
        env = node_env(cluster, node, 1, {
            **variables, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DDTRAIN_TIMEOUT_S": "60",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))})
        procs.append(subprocess.Popen(["ip", "netns", "exec", node.namespace, "bash", "-c", script], env=env,
                                      stdout=log, stderr=log, start_new_session=True, cwd=tmp_path))
    return procs


def wait_all(procs, timeout_s=240) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [p.returncode for p in procs]


@pytest.mark.slow
@pytest.mark.parametrize("platform", [pytorchjob, trainjob, skypilot], ids=["pytorchjob", "trainjob", "skypilot"])
def test_two_pods_with_the_platforms_environment_train_as_one_elastic_job(platform, tmp_path):
    from ddtrain.cluster import emulated_cluster, netns
    log_path = tmp_path / "pods.log"
    with emulated_cluster(2, "1gbit") as cluster, open(log_path, "w") as log:
        try:
            procs = start_pods(cluster, platform, tmp_path, f"{TRAIN} --steps 8 --out {tmp_path / 'run.json'}", log=log)
            codes = wait_all(procs)
        finally:
            for node in cluster.nodes:
                netns.kill_namespace_processes(node.namespace)
    text = log_path.read_text()
    assert codes == [0, 0], text[-4000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 2 and record["config"]["dist"]["nnodes"] == "1:2", record["config"]["dist"]
    assert sorted(p.name for p in (tmp_path / "shared" / "checkpoints").glob("ckpt-*.pt"))[-1] == "ckpt-00000008.pt"
    assert "ignoring RANK=" not in text or platform is pytorchjob, text[-2000:]


@pytest.mark.slow
def test_preempted_pytorchjob_pods_save_and_the_job_resumes_on_one_pod(tmp_path):
    """SIGTERM to both pods (the job's nodes drained, its spot capacity reclaimed): the job stops at one
    step with a checkpoint on the shared volume, exit 75; a pod recreated alone (1 of the range 1:2)
    resumes from it at world size 1 and finishes. (SIGTERM to one pod only: docs/BRIDGES.md, limits.)"""
    from ddtrain.cluster import emulated_cluster, netns
    log_path = tmp_path / "pods.log"
    checkpoints = tmp_path / "shared" / "checkpoints"
    train = f"{TRAIN} --steps 400 --out {tmp_path / 'run.json'}"
    with emulated_cluster(2, "1gbit") as cluster, open(log_path, "w") as log:
        try:
            procs = start_pods(cluster, pytorchjob, tmp_path, train, log=log)
            deadline = time.monotonic() + 180
            while not list(checkpoints.glob("ckpt-*.pt")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert list(checkpoints.glob("ckpt-*.pt")), log_path.read_text()[-3000:]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)            # each kubelet, to its container's process (exec'd)
            first = wait_all(procs, 180)
            stopped_at = sorted(p.name for p in checkpoints.glob("ckpt-*.pt"))[-1]
            again = start_pods(cluster, pytorchjob, tmp_path, train, which=[0], log=log)   # the pod recreated
            second = wait_all(again, 240)
        finally:
            for node in cluster.nodes:
                netns.kill_namespace_processes(node.namespace)
    text = log_path.read_text()
    print(f"first attempt exit codes {first}, newest checkpoint then {stopped_at}; the recreated pod: {second}")
    assert first == [75, 75], text[-4000:]     # stopped on a signal with the state saved
    assert second == [0], text[-4000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 1
    assert f"resumed from {checkpoints / stopped_at}" in text or stopped_at in text, text[-3000:]
    assert sorted(p.name for p in checkpoints.glob("ckpt-*.pt"))[-1] == "ckpt-00000400.pt"
