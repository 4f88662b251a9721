"""A SLURM job that can never start is said and cancelled within seconds (issue 32:
examples/slurm/one_torchrun_per_node_cpu.sbatch asked for 8 CPUs per task, an emulated node has 4, and
``ddtrain cluster run --slurm`` waited silently for the hour of --timeout-s); the CPU sbatch examples run as
written in the emulated cluster (issue 32 item 8).

The rule (``never_starts``) is tested on squeue's rows here; the real SLURM runs need root, network
namespaces, slurm-wlm and munge (.ci/run installs them) and are slow.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ddtrain.cluster import slurm as slurm_mod
from helpers import REPO, why_no_cluster


def job(state="PENDING", reason="Resources", cpus=4, nodes=1, id_="7"):
    return {"id": id_, "name": "j", "state": state, "reason": reason, "cpus": cpus, "nodes": nodes}


def test_a_request_larger_than_a_node_never_starts():
    why = slurm_mod.never_starts([job(reason="PartitionConfig", cpus=16, nodes=2)], nodes=2, cpus_per_node=4)
    assert why.startswith("SLURM job 7 (j) is pending (reason: PartitionConfig) and can never start: it asks for "
                          "16 CPU(s) on 2 node(s) (8 per node) and this emulated cluster has 2 node(s) of 4 CPUs")
    assert "--cpus-per-task" in why
    assert "can never start" in slurm_mod.never_starts([job(nodes=3, cpus=3)], nodes=2, cpus_per_node=4)


def test_a_job_waiting_for_a_running_one_may_start():
    assert slurm_mod.never_starts([job(state="RUNNING", reason="None"), job(id_="8")], nodes=2) is None
    assert slurm_mod.never_starts([job(state="RUNNING", reason="None")], nodes=2) is None
    # nothing runs that would free the CPUs it waits for, or a reason that does not resolve: stuck
    assert "nothing in the cluster will change that" in slurm_mod.never_starts([job()], nodes=2)
    assert "ReqNodeNotAvail" in slurm_mod.never_starts([job(reason="ReqNodeNotAvail")], nodes=2)


WHY = why_no_cluster(slurm_mod.missing_requirements(), "run SLURM in an emulated cluster")


def _cluster_run(*command, tmp_path, timeout=600):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "OUT": str(tmp_path / "out"), "DDTRAIN_TIMEOUT_S": "120"}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run([sys.executable, "-m", "ddtrain", "cluster", "run", "--nodes", "2", "--link", "1gbit",
                           "--slurm", "--", *command], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_a_job_too_large_for_the_nodes_is_cancelled_with_its_reason(tmp_path):
    started = time.monotonic()
    result = _cluster_run("sbatch", "--wait", "--cpus-per-task", "8", "-o", str(tmp_path / "job.out"),
                          "examples/slurm/one_torchrun_per_node_cpu.sbatch", tmp_path=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "is pending (reason: " in errors[0] and "can never start" in errors[0] \
        and "8 per node" in errors[0] and errors[0].endswith("the job was cancelled"), result.stderr
    assert time.monotonic() - started < 120   # SLURM's start-up, then seconds (was: the hour of --timeout-s)


@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("example, expect", [
    ("one_torchrun_per_node_cpu.sbatch", "world size 4"),
    ("one_task_per_rank_cpu.sbatch", "results record: "),
])
def test_the_cpu_sbatch_examples_run_as_written(example, expect, tmp_path):
    result = _cluster_run("sbatch", "--wait", "-o", str(tmp_path / "job.out"), f"examples/slurm/{example}",
                          tmp_path=tmp_path)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert result.returncode == 0, result.stderr[-2000:] + out[-3000:]
    assert expect in out, out[-3000:]
    if example.startswith("one_task"):   # under $OUT, not the repository's results/
        assert (tmp_path / "out" / "run.json").is_file(), out[-2000:]
