"""Issue 28, acceptance 2, in a real SLURM (munge, slurmctld, slurmd in 2 emulated nodes): an ``sbatch
--signal=B:USR1@60 --requeue`` job whose batch shell ``exec``s ``ddtrain train --nproc 2 --preempt-signal USR1
--requeue`` (the launcher gets USR1 and requeues), and an ``sbatch --signal=USR1@60 --requeue`` job of two
``srun ddtrain train`` tasks (each rank gets USR1; rank 0 requeues), get USR1 mid-run, save the step every
worker finished, requeue themselves, run again, resume by themselves and end with the parameters of an
uninterrupted run, bit for bit (experiments/preempt_slurm.py drives them; the transcripts are
results/preemption/slurm_requeue.txt and slurm_requeue_srun.txt).

Needs root, network namespaces and the Debian packages slurm-wlm and munge; elsewhere it skips and says why.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from ddtrain.cluster import slurm as slurm_mod
from helpers import REPO, why_no_cluster

WHY = why_no_cluster(slurm_mod.missing_requirements(), "run SLURM in an emulated cluster")
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")
DRIVER = REPO / "experiments" / "preempt_slurm.py"


def _train_flags() -> list[str]:
    spec = importlib.util.spec_from_file_location("preempt_slurm", DRIVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TRAIN


@pytest.mark.slow  # SLURM up, a job run twice (SLURM holds a requeued job about 2 min), a reference run: ~3.5 min each
@pytest.mark.parametrize("form", ["launcher", "srun"])
def test_an_sbatch_job_preempted_by_usr1_is_requeued_and_ends_like_an_uninterrupted_run(tmp_path, form):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, "-m", "ddtrain", "cluster", "run", "--nodes", "2", "--link", "1gbit",
                           "--slurm", "--", sys.executable, str(DRIVER), str(tmp_path / "job"),
                           *(["--srun"] if form == "srun" else [])],
                          capture_output=True, text=True, timeout=900, env=env)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    stopped = re.search(r"ddtrain: stopped by SIGUSR1: every worker finished step (\d+); checkpoint (\S+) written "
                        r"\d+\.\d+ s after the signal; requeueing SLURM job (\d+): it resumes from there by itself", out)
    assert stopped, out
    step, job = int(stopped.group(1)), stopped.group(3)
    assert step >= 40 and stopped.group(2) == str(tmp_path / "job" / "ck" / f"ckpt-{step:08d}.pt")
    assert f"== job {job} on n" in out and "SLURM_RESTART_COUNT=1" in out, out
    why = "--resume" if form == "launcher" else "SLURM requeue 1"   # the launcher passes --resume to its workers
    assert f"{why}: resumed from {tmp_path / 'job' / 'ck'}/ckpt-{step:08d}.pt at step {step}" in out, out
    assert f"# job {job}: COMPLETED after 1 requeue(s)" in out, out
    assert "Traceback" not in out, out

    reference = subprocess.run([sys.executable, "-m", "ddtrain", "train", "--nproc", "2", *_train_flags(), "--quiet",
                                "--save", str(tmp_path / "reference.pt")], capture_output=True, text=True, timeout=600,
                               env=env)
    assert reference.returncode == 0, reference.stderr
    a = torch.load(tmp_path / "reference.pt", weights_only=True)
    b = torch.load(tmp_path / "job" / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)   # bit for bit
