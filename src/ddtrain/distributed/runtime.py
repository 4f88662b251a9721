"""This process in the job: join the process group, pick device and backend, and answer rank, world
size and device from then on. The launcher's variables are read by ``ddtrain.distributed.env``."""
from __future__ import annotations

import datetime
import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddtrain.distributed.config import default_timeout_s
from ddtrain.distributed import excepthook, rendezvous
from ddtrain.distributed.env import LaunchEnv, detect_env, local_device, restart_store_warning
from ddtrain.errors import DDTrainError
from ddtrain.distributed.job import default_store



@dataclass
class _State:
    env: LaunchEnv
    backend: str | None
    device: torch.device
    timeout_s: float
    owns_group: bool


_state: _State | None = None


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
    timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
    if timeout_s <= 0:
        raise DDTrainError(f"timeout must be positive, got {timeout_s}")
    # One GPU per task (srun --gpus-per-task=1) is cuda:0; all GPUs per node, cuda:LOCAL_RANK (env.local_device).
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen, index = local_device(env, cuda_count, backend or os.environ.get("DDTRAIN_BACKEND"),
                                 os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device is not None:
        dev = torch.device(device)
    else:
        dev = torch.device("cpu") if index is None else torch.device("cuda", index)
    if env.rank == 0 and restart_store_warning():
        print(f"ddtrain: warning: {restart_store_warning()}", file=sys.stderr, flush=True)
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
                      timeout=datetime.timedelta(seconds=timeout_s + (WATCHDOG_SLACK_S if watchdog_wanted(chosen) else 0)),
                      init_method=rendezvous.init_method(timeout_s))  # bounded on every rank, the cause named
        if chosen == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        owns = True
        if env.world_size > 1:      # one traceback per distinct error, not one per rank
            excepthook.install(env.rank, default_store)
    _state = _State(env, chosen if env.launcher != "none" or dist.is_initialized() else None,
                    dev, timeout_s, owns)
    return env


# NCCL aborts a timed-out collective from its own thread with a generic message; ddtrain's
# progress watchdog (reliability.watchdog) names the step, operation and missing rank at the
# deadline, so the process group's own timeout is set this much later, as the fallback.
WATCHDOG_SLACK_S = 30.0


def watchdog_wanted(backend: str | None) -> bool:
    """Is the progress watchdog on for this backend (on for NCCL; DDTRAIN_WATCHDOG=1/0 overrides)?"""
    forced = os.environ.get("DDTRAIN_WATCHDOG", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return backend == "nccl"


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
    clear_roles()


def _s() -> _State:
    if _state is None:
        init()
    return _state


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# Parameter servers (ps-sync, ps-async) set this: (worker ranks, server ranks, the workers' process group).
_roles: tuple[list[int], list[int], object] | None = None


def clear_roles() -> None:
    global _roles
    _roles = None


def set_roles(workers: list[int], servers: list[int], group) -> None:
    """Called by a strategy with server ranks: from now on ``rank``/``world_size`` count workers only."""
    global _roles
    _roles = (list(workers), list(servers), group)


def process_rank() -> int:
    """This process's rank in the whole job (servers included): what torch.distributed calls its rank."""
    return dist.get_rank() if dist.is_initialized() else _s().env.rank


def total_ranks() -> int:
    """Every process of the job, parameter servers included (``world_size()`` + the servers)."""
    return dist.get_world_size() if dist.is_initialized() else _s().env.world_size


def rank() -> int:
    """This worker's rank among the workers (0..world_size()-1), as Horovod's ``hvd.rank()``.

    Workers are the first ranks, so on a worker this is also its process rank; on a parameter
    server (which runs no user code after ``prepare``) it is the process rank, >= world_size().
    """
    return process_rank()


def world_size() -> int:
    """Ranks that train on data: parameter servers are not counted (``total_ranks()`` counts them)."""
    return len(_roles[0]) if _roles is not None else total_ranks()


def is_server() -> bool:
    """Is this process a parameter server (ps-sync/ps-async with --servers)?"""
    return _roles is not None and process_rank() in _roles[1]


def worker_group():
    """The workers' process group, for collectives among workers: ``dist.all_reduce(t, group=ddtrain.worker_group())``.

    None (torch's default group) when every rank is a worker. With parameter servers the
    default group also holds the servers, which never join a user's collective.
    """
    return _roles[2] if _roles is not None else None


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


def deadline_s() -> float:
    """The deadline of one wait without joining the job: ddtrain.init()'s timeout once it ran, else
    DDTRAIN_TIMEOUT_S, else 300 s (collectives called before ``init`` must not start it)."""
    return _state.timeout_s if _state is not None else default_timeout_s()


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
