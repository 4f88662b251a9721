"""Who am I: rank, world size, local rank, device and backend, from whichever launcher ran us.

Reads the environment of torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), SLURM ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, only in a job step: an ``sbatch`` batch
shell is not a task), Open MPI (``OMPI_COMM_WORLD_*``) and MPICH/Hydra
(``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``). With none of them the process is a world of
one and never touches a process group. docs/CLUSTERS.md says what each variable does.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ddtrain.errors import DDTrainError

DEFAULT_PORT = 29500
# A job's port is PORT_BASE + job id % PORT_SPAN: two jobs sharing a node get different ports
# (unless their ids are PORT_SPAN apart), and every port stays below Linux's ephemeral range
# (32768-60999), where the kernel hands out client ports that could already hold it.
PORT_BASE, PORT_SPAN = 10000, 20000
# SLURM's step ids of the batch shell (SLURM_BATCH_SCRIPT) and of the extern step: not srun tasks.
SLURM_BATCH_STEP, SLURM_EXTERN_STEP = 4294967294, 4294967295


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
    job_id: str = ""       # the scheduler's job id (SLURM_JOB_ID, Open MPI's jobid), "" if none


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


def slurm_task(env) -> bool:
    """True in a task that ``srun`` started (a job step), False in an ``sbatch`` batch shell or outside SLURM.

    The batch shell has SLURM_PROCID=0 and SLURM_NTASKS of the whole allocation too, but it is
    one process on the first node, not rank 0 of a started world: its step id is the batch
    step (or absent), an srun task's is 0, 1, ...
    """
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return False
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
    if not step.isdigit():
        return False
    return int(step) not in (SLURM_BATCH_STEP, SLURM_EXTERN_STEP)


def launched(env=None) -> bool:
    """True when a launcher (torchrun, srun, mpirun, mpiexec) started this process as a rank (never raises)."""
    env = os.environ if env is None else env
    return ("RANK" in env and "WORLD_SIZE" in env) or slurm_task(env) or "OMPI_COMM_WORLD_RANK" in env \
        or ("PMI_RANK" in env and "PMI_SIZE" in env)


def job_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``: distinct for concurrent jobs on one node."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + int(digits) % PORT_SPAN if digits else DEFAULT_PORT


def detect_env(env=None) -> LaunchEnv:
    """Read the launcher's variables; a plain process gives a world of one.

    MASTER_PORT wins; otherwise the port comes from the job id (SLURM, Open MPI), so two jobs
    on one node do not both take 29500; without a job id (MPICH, a plain process) it is 29500.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        return LaunchEnv("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK", 0),
                         _int(env, "LOCAL_WORLD_SIZE", world),
                         env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", DEFAULT_PORT),
                         env.get("TORCHELASTIC_RUN_ID", ""))
    if slurm_task(env):
        world = _int(env, "SLURM_NTASKS")
        job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", 0) or _slurm_tasks_on_node(env, world)
        return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0),
                         local_world, addr, _int(env, "MASTER_PORT", job_port(job)), job)
    if "OMPI_COMM_WORLD_RANK" in env:
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        job = env.get("OMPI_MCA_ess_base_jobid", "")
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
        return LaunchEnv("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"), world,
                         _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0), local_world,
                         _mpi_master(env, world, local_world), _int(env, "MASTER_PORT", job_port(job)), job)
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        world = _int(env, "PMI_SIZE")
        local_world = _int(env, "MPI_LOCALNRANKS", world)
        # Hydra puts no job id in the environment: pass -genv MASTER_PORT to run two jobs on one node.
        return LaunchEnv("mpich", _int(env, "PMI_RANK"), world, _int(env, "MPI_LOCALRANKID", 0),
                         local_world, _mpi_master(env, world, local_world),
                         _int(env, "MASTER_PORT", DEFAULT_PORT))
    return LaunchEnv("none", 0, 1, 0, 1, "127.0.0.1", _int(env, "MASTER_PORT", DEFAULT_PORT))


def check_nproc(nproc: int, env=None) -> str | None:
    """Refuse (DDTrainError) or warn (the message returned) when ``--nproc`` disagrees with the launcher.

    Inside a started world (srun task, torchrun worker, MPI rank) the launcher decides the
    world size, so an ``--nproc`` other than 1 or that size is refused. In an ``sbatch`` batch
    shell ``--nproc N`` starts N workers here; a warning says so when SLURM gave the job a
    different number of tasks (``SLURM_NTASKS``), since the rest of the allocation then idles
    or is oversubscribed.
    """
    env = os.environ if env is None else env
    launched = detect_env(env)
    if launched.launcher != "none":
        if nproc not in (1, launched.world_size):
            names = {"slurm": "srun (SLURM_NTASKS)", "torchrun": "torchrun (WORLD_SIZE)",
                     "openmpi": "mpirun (OMPI_COMM_WORLD_SIZE)", "mpich": "mpiexec (PMI_SIZE)"}
            raise DDTrainError(f"--nproc {nproc}: this process is already rank {launched.rank} of "
                               f"{launched.world_size} started by {names[launched.launcher]}, which decides "
                               f"the number of workers; drop --nproc, or start {nproc} tasks with the launcher")
        return None
    if "SLURM_JOB_ID" in env and env.get("SLURM_NTASKS", "").isdigit():
        tasks, nodes = int(env["SLURM_NTASKS"]), _int(env, "SLURM_JOB_NUM_NODES", 1)
        if tasks != nproc:
            where = f" on {nodes} nodes" if nodes > 1 else ""
            return (f"SLURM gave job {env['SLURM_JOB_ID']} {tasks} task(s){where} (SLURM_NTASKS={tasks}), "
                    f"but --nproc {nproc} starts {nproc} worker(s) in this batch shell, on this node only; "
                    f"to run one rank per task use 'srun ddtrain train ...' without --nproc")
    return None


def local_device(env: LaunchEnv, cuda_count: int, requested: str | None = None,
                 visible: str | None = None) -> tuple[str, int | None]:
    """(backend, CUDA device index or None for the CPU) for this rank.

    ``cuda_count`` GPUs are visible to this process. With at least one per local rank, local
    rank i takes GPU i (one launcher per node, all GPUs visible). With exactly one visible
    while several ranks share the node, the launcher gave each task its own
    (``srun --gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per task): it is device 0.
    ``visible`` is CUDA_VISIBLE_DEVICES; when it names one GPU, that GPU is this task's.
    NCCL is chosen when every rank has a GPU of its own, Gloo otherwise (or ``requested``).
    """
    if cuda_count >= env.local_world_size and env.local_rank < cuda_count:
        index = env.local_rank
    elif cuda_count == 1 and (env.local_world_size == 1 or _one_device(visible)):
        index = 0
    else:
        index = None
    if requested:
        if requested not in ("nccl", "gloo"):
            raise DDTrainError(f"unknown backend {requested!r}; valid: gloo, nccl")
        if requested == "nccl":
            if cuda_count == 0:
                raise DDTrainError("backend nccl needs CUDA, and this process sees no GPU")
            if index is None:
                raise DDTrainError(f"backend nccl needs a GPU per rank: local rank {env.local_rank} of "
                                   f"{env.local_world_size} on this node sees {cuda_count} GPU(s) "
                                   f"(CUDA_VISIBLE_DEVICES={visible!r}); give each task its own GPU "
                                   f"(srun --gpus-per-task=1) or every rank all of them")
        return requested, index if requested == "nccl" else (index if env.launcher == "none" else None)
    if index is not None and env.launcher != "none":
        return "nccl", index
    return "gloo", index if env.launcher == "none" else None


def _one_device(visible: str | None) -> bool:
    return visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1


def node_rendezvous(nnodes: int, node_rank: int, endpoint: str, *, max_restarts: int = 0) -> list[str]:
    """torchrun's rendezvous arguments for one node of a multi-node ``ddtrain train --nnodes``.

    Without restarts: static, node ranks as given, master = the endpoint (deterministic ranks,
    as torchrun --node-rank). With restarts: c10d at the endpoint (the node that owns the
    endpoint's address hosts it) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so every attempt
    gets a fresh store and a restarted group can connect; the rendezvous then numbers the nodes.
    The address this node is reached at is the one its route to the endpoint leaves from.
    """
    host, _, port = endpoint.rpartition(":")
    local = local_address_to(host)
    common = ["--nnodes", str(nnodes), "--local-addr", local]
    if not max_restarts:
        return [*common, "--node-rank", str(node_rank), "--rdzv-backend", "static", "--master-addr", host,
                "--master-port", port]
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # The node that owns the endpoint's address hosts the store. torch guesses it from the hostname,
    # which misses an address on a second interface (and every emulated node): say it.
    import socket
    is_host = local == socket.gethostbyname(host)
    return [*common, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", os.environ.get("SLURM_JOB_ID", f"ddtrain-{port}"),
            "--rdzv-conf", f"is_host={str(is_host).lower()}"]


def share_run_id(endpoint: str) -> str:
    """One run id for the launchers of every node of a multi-node launch (DDTRAIN_RUN_ID, unless set).

    reliability.ownership lets only one run hold a checkpoint directory; the nodes' launchers
    are one run, so they derive the same id from what they share: the endpoint and the job id.
    """
    job = os.environ.get("SLURM_JOB_ID", "")
    os.environ.setdefault("DDTRAIN_RUN_ID", f"nodes-{endpoint}" + (f"-job{job}" if job else ""))
    return os.environ["DDTRAIN_RUN_ID"]


def local_address_to(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends nothing)."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise DDTrainError(f"--rdzv-endpoint {host}: cannot reach it from this node ({exc})") from None


def restart_store_warning(env=None) -> str | None:
    """A warning for a torchrun worker whose restarts cannot reconnect, or None.

    With ``--max-restarts`` and the c10d rendezvous, torchrun's agents share their rendezvous
    store with the workers unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is in torchrun's own
    environment; a restarted process group then finds the dead attempt's addresses there and
    fails after minutes ("Gloo connectFullMesh failed ... Connect timeout"). ddtrain's own
    launches set it; under a plain torchrun only the user can (ranks start too late).
    """
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if (restarts.isdigit() and int(restarts) > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"):
        return (f"torchrun --max-restarts {restarts} shares its rendezvous store with the workers, so a restart "
                f"will not reconnect: use --rdzv-backend c10d with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                f"torchrun's environment (on every node), or launch with 'ddtrain train --nnodes ...', which sets it")
    return None


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
