"""The real launchers on one node: MPICH's Hydra (``mpiexec.mpich``) and Open MPI (``mpirun.openmpi``) start
``examples/minimal.py`` and ``ddtrain train`` as 2 ranks, which train to the parameters of the same job
under torchrun / ``ddtrain train --nproc 2``; and what a launcher's environment must not fool.

The launchers are Debian packages (mpich, openmpi-bin) that .ci/run installs; where they are
missing these tests skip and say so.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from helpers import REPO, SAVE_MODEL_WRAPPER, assert_same_parameters, ddtrain

MPICH, OPENMPI = shutil.which("mpiexec.mpich"), shutil.which("mpirun.openmpi")
needs_mpich = pytest.mark.skipif(MPICH is None, reason="MPICH's mpiexec.mpich is not installed (apt-get install mpich)")
needs_openmpi = pytest.mark.skipif(OPENMPI is None,
                                   reason="Open MPI's mpirun.openmpi is not installed (apt-get install openmpi-bin)")
TRAIN = ["train", "--model", "mlp", "--data", "digits", "--steps", "6", "--batch-size", "16", "--lr", "0.05",
         "--momentum", "0.9", "--seed", "3"]
# Runs examples/minimal.py unchanged (runpy) and saves rank 0's final parameters.
WRAPPER = SAVE_MODEL_WRAPPER


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")])),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **extra)
    return env


def mpi_command(kind: str, nproc: int, argv: list[str], port: int) -> list[str]:
    """``mpiexec.mpich -n N`` or ``mpirun.openmpi -n N`` running ``python argv`` on this host."""
    if kind == "mpich":
        return [MPICH, "-n", str(nproc), "-genv", "MASTER_PORT", str(port), sys.executable, *argv]
    # root in CI: Open MPI refuses it without --allow-run-as-root; binding would pin each rank to one core
    return [OPENMPI, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", str(nproc),
            sys.executable, *argv]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv, cwd, timeout=180, **env):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=_env(**env))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``ddtrain train --nproc 2`` and examples/minimal.py under torchrun: the parameters every launcher must reach."""
    folder = tmp_path_factory.mktemp("reference")
    (folder / "wrap.py").write_text(WRAPPER)
    result = ddtrain(*TRAIN, "--nproc", "2", "--save", str(folder / "train.pt"), env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
          "wrap.py", "minimal.pt", str(REPO / "examples" / "minimal.py"), "--epochs", "1"], folder)
    return {"train": torch.load(folder / "train.pt"), "minimal": torch.load(folder / "minimal.pt")}


@pytest.mark.parametrize("kind", [pytest.param("mpich", marks=needs_mpich), pytest.param("openmpi", marks=needs_openmpi)])
@pytest.mark.slow  # 7-23 s each here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_mpi_launchers_train_to_the_parameters_of_a_local_launch(kind, reference, tmp_path):
    (tmp_path / "wrap.py").write_text(WRAPPER)
    done = _run(mpi_command(kind, 2, ["wrap.py", "minimal.pt", str(REPO / "examples" / "minimal.py"), "--epochs", "1"],
                            _free_port()), tmp_path)
    assert "(world size 2)" in done.stdout, done.stdout
    assert_same_parameters(reference["minimal"], torch.load(tmp_path / "minimal.pt"), rtol=1e-6)
    done = _run(mpi_command(kind, 2, ["-m", "ddtrain", *TRAIN, "--save", "train.pt", "--out", "run.json"],
                            _free_port()), tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["world_size"] == 2 and record["global_batch_size"] == 32
    assert_same_parameters(reference["train"], torch.load(tmp_path / "train.pt"), rtol=1e-6)


# ---------------------------------------------------------------- issue 17's failures, end to end
SBATCH_SHELL = {"SLURM_JOB_ID": "4711", "SLURM_JOBID": "4711", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n0",
                "SLURM_TASKS_PER_NODE": "1"}


def test_nproc_2_inside_an_sbatch_batch_shell_starts_2_workers(tmp_path):
    # The batch shell of `sbatch --ntasks=1` (no step id): it was taken for srun's rank 0 of 1.
    result = ddtrain(*TRAIN, "--nproc", "2", "--out", str(tmp_path / "run.json"), env=SBATCH_SHELL)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run.json").read_text())["world_size"] == 2
    assert "SLURM_NTASKS=1" in result.stderr and "--nproc 2 starts 2 worker(s)" in result.stderr


def test_a_restart_whose_rank_0_finds_no_checkpoint_that_another_node_sees_refuses(tmp_path):
    # Two "nodes" with node-local checkpoint directories: a relative --checkpoint-dir in a different working
    # directory per rank. The restart put rank 0 where there is none; the old node (rank 1) has ckpt-4.
    port = _free_port()
    procs = []
    for rank in range(2):
        node = tmp_path / f"node{rank}"
        (node / "ck").mkdir(parents=True)
        if rank == 1:
            (node / "ck" / "ckpt-00000004.pt").write_bytes(b"written by the first attempt's rank 0")
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="1", TORCHELASTIC_MAX_RESTARTS="1",
                   DDTRAIN_TIMEOUT_S="60")
        procs.append(subprocess.Popen([sys.executable, "-m", "ddtrain", *TRAIN, "--checkpoint-dir", "ck"], cwd=node,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode != 0 for p in procs), outputs
    err = outputs[0][1]
    assert "Traceback" not in err, err
    assert "finds no checkpoint" in err and "ckpt-00000004.pt" in err and "not shared" in err, err
    assert "starting from step 0" not in outputs[0][0]
