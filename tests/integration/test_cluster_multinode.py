"""Across 2 emulated nodes (own network stacks, rate-limited links): multi-node torchrun and
``ddtrain train --nnodes 2 --node-rank I --rdzv-endpoint HOST:PORT`` train to the parameters of
``ddtrain train --nproc 4`` on one node; ``ddtrain doctor`` names the node whose torch differs, and the
start of a multi-node ``ddtrain train`` refuses when a node's Python differs.

Needs root and network namespaces; elsewhere it skips and says why.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ddtrain.cluster import emulated_cluster, netns, run_in_cluster
from ddtrain.cluster.remote import node_hosts
from helpers import REPO, SAVE_MODEL_WRAPPER, assert_same_parameters, ddtrain, why_no_cluster


def _why_not() -> str | None:
    return why_no_cluster()


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--steps", "8", "--batch-size", "16", "--lr", "0.05",
         "--momentum", "0.9", "--seed", "1"]
ENDPOINT = "198.18.0.1:29400"


def _env(**extra) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DDTRAIN_FAULT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", DDTRAIN_TIMEOUT_S="120", **extra)
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    result = ddtrain(*TRAIN, "--nproc", "4", "--save", str(folder / "model.pt"), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    return torch.load(folder / "model.pt")


def _on_every_node(cluster, argv_of, timeout=300, **env):
    """Run ``argv_of(node)`` in every node's namespace at once (each node's own launcher); their outputs."""
    procs = [subprocess.Popen(["nsenter", f"--net=/run/netns/{node.namespace}", *argv_of(node)],
                              env=_env(GLOO_SOCKET_IFNAME=node.interface, DDTRAIN_CLUSTER_NODE=str(node.index), **env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for node in cluster.nodes]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for node in cluster.nodes:
            netns.kill_namespace_processes(node.namespace)
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-2000:] + err[-3000:]
    return outputs


@pytest.mark.slow  # 23 s with its cluster start here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_torchrun_on_2_nodes_trains_like_nproc_4_on_one(reference, tmp_path):
    with emulated_cluster(2, "1gbit") as cluster:
        result = run_in_cluster(cluster, ["ddtrain", *TRAIN, "--save", str(tmp_path / "model.pt")], procs_per_node=2,
                                timeout_s=300, env=_env())
    assert result.returncode == 0
    assert_same_parameters(reference, torch.load(tmp_path / "model.pt"), rtol=1e-6)


@pytest.mark.slow  # 11 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_ddtrain_train_nnodes_2_trains_like_nproc_4_on_one(reference, tmp_path):
    with emulated_cluster(2, "1gbit") as cluster:
        _on_every_node(cluster, lambda node: [
            sys.executable, "-m", "ddtrain", *TRAIN, "--nproc", "2", "--nnodes", "2", "--node-rank", str(node.index),
            "--rdzv-endpoint", ENDPOINT, "--save", str(tmp_path / "model.pt"), "--out", str(tmp_path / "run.json")])
    assert json.loads((tmp_path / "run.json").read_text())["world_size"] == 4
    assert_same_parameters(reference, torch.load(tmp_path / "model.pt"), rtol=1e-6)


def _mpi_across_nodes(kind: str, agent: str, argv: list[str], folder) -> list[str]:
    if kind == "mpich":  # Hydra: host file, its ssh launcher with our agent instead of ssh
        (folder / "hosts").write_text("n0:2\nn1:2\n")
        return ["mpiexec.mpich", "-launcher", "ssh", "-launcher-exec", agent, "-f", str(folder / "hosts"), "-n", "4",
                "-genv", "MASTER_ADDR", "n0", "-genv", "MASTER_PORT", "29411", *argv]
    (folder / "hostfile").write_text("n0 slots=2\nn1 slots=2\n")
    return ["mpirun.openmpi", "--allow-run-as-root", "--mca", "plm_rsh_agent", agent,
            "--hostfile", str(folder / "hostfile"), "-n", "4", "--bind-to", "none", "-x", "MASTER_ADDR=n0",
            "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS",
            "-x", "DDTRAIN_TIMEOUT_S", "--mca", "oob_tcp_if_include", "198.18.0.0/24", *argv]


@pytest.mark.parametrize("kind", ["mpich", "openmpi"])
@pytest.mark.slow  # 9-10 s each here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_mpi_host_lists_across_2_nodes_train_like_nproc_4_on_one(kind, reference, tmp_path):
    launcher = {"mpich": "mpiexec.mpich", "openmpi": "mpirun.openmpi"}[kind]
    if shutil.which(launcher) is None:
        pytest.skip(f"{launcher} is not installed (apt-get install {'mpich' if kind == 'mpich' else 'openmpi-bin'})")
    with emulated_cluster(2, "1gbit") as cluster, node_hosts(cluster) as hosts:
        train = [sys.executable, "-m", "ddtrain", *TRAIN, "--save", str(tmp_path / "model.pt"),
                 "--out", str(tmp_path / "run.json")]
        argv = _mpi_across_nodes(kind, hosts.agent, train, tmp_path)
        root_ok = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        done = subprocess.run(hosts.head(argv), env=_env(**root_ok), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 4 and record["global_batch_size"] == 64
    assert_same_parameters(reference, torch.load(tmp_path / "model.pt"), rtol=1e-6)


# examples/minimal.py unchanged, its model saved by rank 0 after the script ran (as in test_launchers.py)
WRAPPER = SAVE_MODEL_WRAPPER


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mpich", "openmpi"])
def test_mpi_host_lists_across_2_nodes_run_minimal_py_like_torchrun_with_4_ranks(kind, tmp_path):
    launcher = {"mpich": "mpiexec.mpich", "openmpi": "mpirun.openmpi"}[kind]
    if shutil.which(launcher) is None:
        pytest.skip(f"{launcher} is not installed (apt-get install {'mpich' if kind == 'mpich' else 'openmpi-bin'})")
    (tmp_path / "wrap.py").write_text(WRAPPER)
    script = [str(tmp_path / "wrap.py"), str(tmp_path / "{}.pt"), str(REPO / "examples" / "minimal.py"), "--epochs", "1"]
    local = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29413",
             script[0], script[1].format("torchrun"), *script[2:]]
    done = subprocess.run(local, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with emulated_cluster(2, "1gbit") as cluster, node_hosts(cluster) as hosts:
        argv = _mpi_across_nodes(kind, hosts.agent, [sys.executable, script[0], script[1].format("mpi"), *script[2:]],
                                 tmp_path)
        root_ok = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        done = subprocess.run(hosts.head(argv), env=_env(**root_ok), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "(world size 4)" in done.stdout, done.stdout
    assert_same_parameters(torch.load(tmp_path / "torchrun.pt"), torch.load(tmp_path / "mpi.pt"), rtol=1e-6)


def test_doctor_names_the_node_whose_torch_differs(tmp_path):
    # DDTRAIN_DOCTOR_FAKE (test-only) gives node 1 another torch version
    log = tmp_path / "doctor.log"
    with emulated_cluster(2, "200mbit") as cluster, open(log, "w") as f:
        result = run_in_cluster(cluster, ["ddtrain", "doctor", "--data", "digits"], timeout_s=180, stdout=f, stderr=f,
                                env=_env(DDTRAIN_DOCTOR_FAKE="node=1,torch=2.0.0"))
    text = log.read_text()
    assert result.returncode == 1, text
    assert "# torch differs on node 1 (rank 1): 2.0.0 vs " in text, text
    assert "ddtrain: error: the ranks disagree: torch differs on node 1" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("     ")]
    assert [row[2] for row in rows[:2]] == ["0", "1"]  # node column: node 0, node 1
    bandwidth = float(rows[1][-1])  # MB/s from rank 0 to rank 1 over the 200 Mbit/s links (25 MB/s)
    assert 5 < bandwidth < 30, text


def test_doctor_at_the_start_of_a_multi_node_train_refuses_naming_node_and_field(tmp_path):
    with emulated_cluster(2, "1gbit") as cluster:
        procs = [subprocess.Popen(["nsenter", f"--net=/run/netns/{node.namespace}", sys.executable, "-m", "ddtrain",
                                   *TRAIN, "--nproc", "1", "--nnodes", "2", "--node-rank", str(node.index),
                                   "--rdzv-endpoint", ENDPOINT],
                                  env=_env(GLOO_SOCKET_IFNAME=node.interface, DDTRAIN_CLUSTER_NODE=str(node.index),
                                           DDTRAIN_DOCTOR_FAKE="node=1,python=3.0.1"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in cluster.nodes]
        outputs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode != 0 for p in procs)
    text = "".join(out + err for out, err in outputs)
    assert "the nodes of this job differ: python differs on node 1 (rank 1): 3.0.1 vs" in text, text


@pytest.mark.slow
def test_killed_rank_of_2_node_train_restarts_and_finishes_like_an_uninterrupted_run(reference, tmp_path):
    # Rank 3 is SIGKILLed at step 5 (DDTRAIN_FAULT, the first attempt only); checkpoints every 2 steps in a
    # directory both nodes see. torchrun counts the restart on the failed rank's node only: before the ranks
    # agreed on the attempt, the restarted ranks waited on keys of different attempts until the deadline.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in _env()  # nothing set by the user: ddtrain sets it
    with emulated_cluster(2, "1gbit") as cluster:
        outputs = _on_every_node(cluster, lambda node: [
            sys.executable, "-m", "ddtrain", *TRAIN, "--nproc", "2", "--nnodes", "2", "--node-rank", str(node.index),
            "--rdzv-endpoint", ENDPOINT, "--max-restarts", "1", "--checkpoint-every", "2",
            "--checkpoint-dir", str(tmp_path / "ck"), "--save", str(tmp_path / "model.pt")],
            timeout=240, DDTRAIN_FAULT="rank=3,step=5,kind=kill", DDTRAIN_LOG_DIR=str(tmp_path))
    text = "".join(out + err for out, err in outputs)
    assert "was killed by SIGKILL; restarting all workers (restart 1 of 1)" in text, text
    assert "restart 1: resumed from " in text and "ckpt-00000004.pt at step 4" in text, text
    assert_same_parameters(reference, torch.load(tmp_path / "model.pt"), rtol=1e-6)


@pytest.mark.slow  # ~35 s: a second 2-node restart, through the emulated cluster's own agents
def test_cluster_run_max_restarts_resumes_a_killed_rank_like_an_uninterrupted_run(reference, tmp_path):
    # run_in_cluster(max_restarts=1) (ddtrain cluster run --max-restarts 1): c10d agents, the store not shared
    log = tmp_path / "job.log"
    with emulated_cluster(2, "1gbit") as cluster, open(log, "w") as f:
        result = run_in_cluster(cluster, ["ddtrain", *TRAIN, "--checkpoint-every", "2", "--checkpoint-dir",
                                          str(tmp_path / "ck"), "--save", str(tmp_path / "model.pt")],
                                procs_per_node=2, timeout_s=240, max_restarts=1, stdout=f, stderr=f,
                                env=_env(DDTRAIN_FAULT="rank=0,step=5,kind=kill"))
    text = log.read_text()
    assert result.returncode == 0, text[-4000:]
    assert "was killed by SIGKILL; restarting all workers (restart 1 of 1)" in text, text[-4000:]
    assert "restart 1: resumed from " in text and "ckpt-00000004.pt at step 4" in text, text[-4000:]
    assert_same_parameters(reference, torch.load(tmp_path / "model.pt"), rtol=1e-6)
