"""Who am I: rank, world size, local rank, device and backend, from whichever launcher ran us.

Reads the environment of torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), SLURM ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``), Open MPI (``OMPI_COMM_WORLD_*``) and
MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``). With none of them the process
is a world of one and never touches a process group.
"""
from __future__ import annotations

import datetime
import gc
import os
import re
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import DDTrainError

DEFAULT_TIMEOUT_S = float(os.environ.get("DDTRAIN_TIMEOUT_S", "300"))
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


@dataclass
class _State:
    env: LaunchEnv
    backend: str | None
    device: torch.device
    timeout_s: float
    owns_group: bool


_state: _State | None = None


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


def _choose_backend(env: LaunchEnv, requested: str | None) -> str:
    if requested:
        if requested not in ("nccl", "gloo"):
            raise DDTrainError(f"unknown backend {requested!r}; valid: gloo, nccl")
        if requested == "nccl" and not torch.cuda.is_available():
            raise DDTrainError("backend nccl needs CUDA, and this process sees no GPU")
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= env.local_world_size:
        return "nccl"  # every local rank has a GPU of its own
    return "gloo"


def init(*, backend: str | None = None, timeout_s: float | None = None, device: str | None = None) -> LaunchEnv:
    """Join the job the launcher started (or become a world of one) and pick device and backend.

    Safe to call twice. ``backend`` overrides the choice (NCCL when every local rank has its
    own GPU, Gloo otherwise; also ``DDTRAIN_BACKEND``); ``timeout_s`` bounds every collective
    wait of the process group (``DDTRAIN_TIMEOUT_S``, default 300 s).
    """
    global _state
    if _state is not None:
        return _state.env
    env = detect_env()
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    if timeout_s <= 0:
        raise DDTrainError(f"timeout must be positive, got {timeout_s}")
    chosen = _choose_backend(env, backend or os.environ.get("DDTRAIN_BACKEND"))
    if device is not None:
        dev = torch.device(device)
    elif chosen == "nccl" or (env.launcher == "none" and torch.cuda.is_available()):
        dev = torch.device("cuda", env.local_rank)
    else:
        dev = torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif env.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # Local ranks share the cores; more threads than cores per rank only thrash.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    owns = False
    if env.launcher != "none" and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        kwargs = dict(backend=chosen, rank=env.rank, world_size=env.world_size,
                      timeout=datetime.timedelta(seconds=timeout_s), init_method="env://")
        if chosen == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        owns = True
    _state = _State(env, chosen if env.launcher != "none" or dist.is_initialized() else None,
                    dev, timeout_s, owns)
    return env


AT_SHUTDOWN: list = []   # callables run (last registered first) by shutdown(), before the group goes


def shutdown() -> None:
    """Finish what registered itself (a strategy's last messages), leave the process group (if ours), forget."""
    global _state
    while AT_SHUTDOWN:
        AT_SHUTDOWN.pop()()
    if _state is not None and _state.owns_group and dist.is_initialized():
        gc.collect()  # wrappers left in reference cycles (DDP's reducer) let go of the group first
        dist.destroy_process_group()
    _state = None


def _s() -> _State:
    if _state is None:
        init()
    return _state


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else _s().env.rank


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else _s().env.world_size


def local_rank() -> int:
    return _s().env.local_rank


def local_world_size() -> int:
    return _s().env.local_world_size


def device() -> torch.device:
    return _s().device


def backend() -> str | None:
    return dist.get_backend() if dist.is_initialized() else None


def timeout_s() -> float:
    return _s().timeout_s


def launcher() -> str:
    return _s().env.launcher


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only (flushed, so logs interleave sensibly under launchers)."""
    if rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def rank_prefix() -> str:
    """'[rank R] ' inside a multi-process job, '' otherwise."""
    env = detect_env()
    return f"[rank {env.rank}] " if env.world_size > 1 else ""


def eprint(message: str) -> None:
    """One line to stderr, prefixed with this process's rank in a multi-process job."""
    print(f"{rank_prefix()}{message}", file=sys.stderr, flush=True)
