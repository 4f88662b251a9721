"""A real SLURM (munge, slurmctld, one slurmd per node) in a 2-node emulated cluster: ``srun -N 2
--ntasks-per-node 2`` and ``sbatch --wait`` train to the parameters of ``ddtrain train --nproc 4`` /
examples/minimal.py under torchrun with 4 ranks on one node; an sbatch batch shell is no task;
``ddtrain cluster run --slurm`` leaves nothing behind after SIGTERM.

Needs root, network namespaces and the Debian packages slurm-wlm and munge (.ci/run installs
them); elsewhere it skips and says which is missing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddtrain.cluster import emulated_cluster, netns
from ddtrain.cluster import slurm as slurm_mod
from helpers import REPO, SAVE_MODEL_WRAPPER, assert_same_parameters, ddtrain, why_no_cluster


def _why_not() -> str | None:
    return why_no_cluster(slurm_mod.missing_requirements(), "run SLURM in an emulated cluster")


WHY = _why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--steps", "6", "--batch-size", "8", "--lr", "0.05",
         "--momentum", "0.9", "--seed", "3"]
WRAPPER = SAVE_MODEL_WRAPPER


def _env() -> dict:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "DDTRAIN_TIMEOUT_S": "120"}


@pytest.fixture(scope="module")
def slurm_cluster():
    with emulated_cluster(2, "1gbit") as cluster:
        slurm, _ = slurm_mod.start(cluster)
        try:
            yield cluster, slurm
        finally:
            for node in cluster.nodes:
                netns.kill_namespace_processes(node.namespace)
            slurm_mod.cleanup(slurm)


def _run(slurm_cluster, command, cwd, timeout=240):
    cluster, slurm = slurm_cluster
    proc = slurm_mod.run_command(cluster, slurm, ["sh", "-c", f"cd {cwd} && exec " + " ".join(command)], env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out.decode()[-2000:] + err.decode()[-3000:]
    return out.decode(), err.decode()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    (folder / "wrap.py").write_text(WRAPPER)
    result = ddtrain(*TRAIN, "--nproc", "4", "--save", str(folder / "train.pt"), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(_free_port()),
                           "wrap.py", "minimal.pt", str(REPO / "examples" / "minimal.py"), "--epochs", "1"], cwd=folder,
                          capture_output=True, text=True, timeout=240, env={**os.environ, **_env()})
    assert done.returncode == 0, done.stderr[-3000:]
    return {"train": torch.load(folder / "train.pt"), "minimal": torch.load(folder / "minimal.pt")}


@pytest.mark.slow  # 35 s with its SLURM start here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_srun_on_2_nodes_trains_like_nproc_4_on_one(slurm_cluster, reference, tmp_path):
    _run(slurm_cluster, ["srun", "-N", "2", "--ntasks-per-node", "2", sys.executable, "-m", "ddtrain", *TRAIN,
                         "--save", str(tmp_path / "train.pt"), "--out", str(tmp_path / "run.json")], tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 4 and record["global_batch_size"] == 32
    assert_same_parameters(reference["train"], torch.load(tmp_path / "train.pt"), rtol=1e-6)


@pytest.mark.slow
def test_sbatch_wait_runs_minimal_py_and_its_batch_shell_is_no_task(slurm_cluster, reference, tmp_path):
    (tmp_path / "wrap.py").write_text(WRAPPER)
    # The batch shell itself runs `ddtrain train --nproc 2` first: 2 workers, not "rank 0 of 4" (issue 17).
    (tmp_path / "job.sbatch").write_text(f"""#!/bin/sh
#SBATCH -N 2 --ntasks-per-node 2
set -e
{sys.executable} -m ddtrain {' '.join(TRAIN)} --nproc 2 --out {tmp_path}/batch.json
srun {sys.executable} wrap.py {tmp_path}/minimal.pt {REPO}/examples/minimal.py --epochs 1
""")
    _run(slurm_cluster, ["sbatch", "--wait", "-o", str(tmp_path / "job.out"), "job.sbatch"], tmp_path)
    log = (tmp_path / "job.out").read_text()
    assert "(world size 4)" in log, log
    assert "SLURM_NTASKS=4" in log and "--nproc 2 starts 2 worker(s)" in log, log
    assert json.loads((tmp_path / "batch.json").read_text())["world_size"] == 2
    assert_same_parameters(reference["minimal"], torch.load(tmp_path / "minimal.pt"), rtol=1e-6)


def _is_task(cmd: str) -> bool:
    """A task srun started: ``sleep 4242`` (not srun's or ddtrain's own command line that names it)."""
    return cmd.split(" ")[0].endswith("sleep") and "4242" in cmd


def _ours(run_prefix: str) -> list[str]:
    found = [f"namespace {n}" for n in netns.list_namespaces() if n.startswith(run_prefix)]
    found += [f"folder {n}" for n in os.listdir("/tmp") if n.startswith(run_prefix) and "-slurm-" in n]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (run_prefix in cmd or _is_task(cmd)) and int(pid) != os.getpid():
            found.append(f"process {pid}: {cmd}")
    return found


def test_cluster_run_slurm_leaves_nothing_after_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", "cluster", "run", "--nodes", "2", "--link", "1gbit",
                             "--slurm", "--", "srun", "-N", "2", "sleep", "4242"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **_env()})
    prefix = f"{netns.PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(_is_task(p.split(": ", 1)[-1]) for p in _ours(prefix)):
        time.sleep(0.3)   # until srun's tasks run on the nodes
    if not any(_is_task(p.split(": ", 1)[-1]) for p in _ours(prefix)):
        proc.send_signal(signal.SIGTERM)
        pytest.fail(f"srun's tasks never ran: {proc.communicate(timeout=60)}")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert _ours(prefix) == []
