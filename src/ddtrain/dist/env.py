"""Who am I: rank, world size, local rank, device and backend, from whichever launcher ran us.

Reads the environment of torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), SLURM ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``), Open MPI (``OMPI_COMM_WORLD_*``) and
MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``). With none of them the process
is a world of one and never touches a process group.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""

    launcher: str          # "torchrun", "slurm", "openmpi", "mpich" or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def _int(env, name, default=None):
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise DDTrainError(f"environment variable {name} is missing")
        return default
    try:
        return int(value)
    except ValueError:
        raise DDTrainError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list such as ``gpu[03-05,9],cpu1`` (-> ``gpu03``)."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise DDTrainError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_env(env=None) -> LaunchEnv:
    """Read the launcher's variables; a plain process gives a world of one."""
    env = os.environ if env is None else env
    port = _int(env, "MASTER_PORT", DEFAULT_PORT)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return LaunchEnv("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK", 0),
                         _int(env, "LOCAL_WORLD_SIZE", world),
                         env.get("MASTER_ADDR", "127.0.0.1"), port)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", 0) or _slurm_tasks_on_node(env, world)
        return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0),
                         local_world, addr, port)
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
        return LaunchEnv("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), world,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), local_world,
                         _mpi_master(env, world, local_world), port)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        world = _int(env, "PMI_SIZE")
        local_world = _int(env, "MPI_LOCALNRANKS", world)
        return LaunchEnv("mpich", _int(env, "PMI_RANK"), world, _int(env, "MPI_LOCALRANKID", 0),
                         local_world, _mpi_master(env, world, local_world), port)
    return LaunchEnv("none", 0, 1, 0, 1, "127.0.0.1", port)


def _slurm_tasks_on_node(env, world: int) -> int:
    tasks = env.get("SLURM_TASKS_PER_NODE", "")  # e.g. "4(x2)" or "2,1"
    match = re.match(r"(\d+)", tasks)
    return int(match.group(1)) if match else world


def _mpi_master(env, world: int, local_world: int) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if local_world == world:
        return "127.0.0.1"  # every rank on this host
    raise DDTrainError("an MPI launch across several hosts needs MASTER_ADDR (the host of rank 0), "
                       "e.g. mpirun -x MASTER_ADDR=node01 ...")
