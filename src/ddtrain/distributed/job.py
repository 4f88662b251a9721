"""The job's facts every package asks about: which attempt of the job this is, the store all ranks share, and
where the job keeps its state with the global batch it keeps at every size (what ``ddtrain run`` tells a script).

These are the only reads of ``TORCHELASTIC_RESTART_COUNT`` and the only use of torch's private
accessor of the default group's store; everything else in ddtrain calls ``restart_attempt()`` and
``default_store()``. The launchers' own variables are in ``ddtrain.distributed.env.LAUNCHERS``.
"""
from __future__ import annotations

import os

from ddtrain.errors import DDTrainError

# torchrun's count of the restarts of this job's workers. ddtrain's agents and elastic launcher
# raise it to count every re-formation (ddtrain.distributed.rendezvous.add_attempt_base), and the
# ranks of a multi-node attempt agree on the largest (rendezvous._agree_attempt), so that every
# per-attempt key (stall, watchdog, doctor, parameter servers) names the same attempt on all ranks.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_attempt(environ=None) -> int:
    """0 for the first attempt of the job, then 1, 2, ... after each restart of its workers."""
    env = os.environ if environ is None else environ
    value = str(env.get(RESTART_COUNT_ENV, "0")).strip()
    return int(value) if value.isdigit() else 0


def set_restart_attempt(attempt: int) -> None:
    """Record that this process is attempt ``attempt`` (for itself and the processes it starts)."""
    os.environ[RESTART_COUNT_ENV] = str(int(attempt))


def default_store():
    """The key-value store of the default process group (None when there is no group).

    torch keeps it behind a private accessor; this is the one place that calls it, so a change
    of torch's name breaks one line.
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


# What `ddtrain run` tells the script it starts (read by the script, or by ddtrain's state API for it):
# where the job's state lives and the global batch every world size of an elastic job keeps.
CHECKPOINT_DIR_ENV = "DDTRAIN_CHECKPOINT_DIR"
GLOBAL_BATCH_SIZE_ENV = "DDTRAIN_GLOBAL_BATCH_SIZE"


def checkpoint_dir(environ=None) -> str | None:
    """The job's checkpoint directory (``ddtrain run --checkpoint-dir``, ``DDTRAIN_CHECKPOINT_DIR``), or None."""
    env = os.environ if environ is None else environ
    return env.get(CHECKPOINT_DIR_ENV) or None


def global_batch_size(environ=None) -> int:
    """The job's global batch (``ddtrain run --global-batch-size``, ``DDTRAIN_GLOBAL_BATCH_SIZE``), 0 if not stated."""
    env = os.environ if environ is None else environ
    raw = str(env.get(GLOBAL_BATCH_SIZE_ENV, "")).strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) < 1:
        raise DDTrainError(f"environment variable {GLOBAL_BATCH_SIZE_ENV}={raw!r} must be a positive whole number "
                           f"(samples per optimizer update over all workers)")
    return int(raw)


# SLURM's facts about a batch job that can be requeued (sbatch --requeue; scontrol requeue):
# the same job id in every run of it, and how many times it was requeued (0 in its first run).
SLURM_JOB_ID_ENV, SLURM_RESTART_COUNT_ENV = "SLURM_JOB_ID", "SLURM_RESTART_COUNT"
REQUEUE_TIMEOUT_S = 60.0


def slurm_job_id(environ=None) -> str | None:
    """The SLURM job this process belongs to, or None outside SLURM."""
    env = os.environ if environ is None else environ
    return str(env.get(SLURM_JOB_ID_ENV, "")).strip() or None


def requeue_count(environ=None) -> int:
    """0 in a SLURM job's first run, then 1, 2, ... in each run after a requeue (``SLURM_RESTART_COUNT``)."""
    env = os.environ if environ is None else environ
    value = str(env.get(SLURM_RESTART_COUNT_ENV, "0")).strip()
    return int(value) if value.isdigit() else 0


def requeue_slurm_job(job_id: str) -> str | None:
    """``scontrol requeue JOB``: None when SLURM took it, else why not (one line). SLURM then stops this run."""
    import subprocess
    try:
        done = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True,
                              timeout=REQUEUE_TIMEOUT_S)
    except FileNotFoundError:
        return "scontrol is not on PATH"
    except subprocess.TimeoutExpired:
        return f"scontrol requeue {job_id} did not answer within {REQUEUE_TIMEOUT_S:g} s"
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return f"scontrol requeue {job_id} failed: {said[-1] if said else f'exit status {done.returncode}'}"
    return None
