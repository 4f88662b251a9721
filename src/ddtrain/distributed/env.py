"""Who am I: rank, world size, local rank, device and backend, from whichever launcher ran us.

Reads the environment of torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), SLURM ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``, only in a job step: an ``sbatch`` batch
shell is not a task), Open MPI (``OMPI_COMM_WORLD_*``) and MPICH/Hydra
(``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``). With none of them the process is a world of
one and never touches a process group. docs/LAUNCHERS.md says what each variable does.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from collections.abc import Callable

from ddtrain.distributed.job import RESTART_COUNT_ENV
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

    launcher: str          # a key of LAUNCHERS ("torchrun", "slurm", "openmpi", "mpich"), or "none"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    job_id: str = ""       # the scheduler's job id (SLURM_JOB_ID, Open MPI's jobid), "" if none


@dataclass(frozen=True, kw_only=True)
class Launcher:
    """One launcher, as everything else sees it: the variables it sets in each rank and how to read them.

    Adding a launcher is one ``Launcher(...)`` in ``LAUNCHERS``: environment detection
    (``detect_env``, ``launched``), ``check_nproc``'s message and the emulated cluster's scrubbing
    of a surrounding job's variables (``launcher_variables``) all read this table.
    """

    name: str                          # LaunchEnv.launcher
    command: str                       # how users start it, for messages: "srun (SLURM_NTASKS)"
    rank: str                          # the variable holding this process's global rank
    world_size: str                    # ... the number of ranks
    local_rank: str                    # ... the rank on this node (0 if absent)
    local_world_size: tuple[str, ...] = ()   # ... ranks on this node: the first variable set (else local_world)
    job_id: tuple[str, ...] = ()       # the scheduler's job id: the first variable set ("" if none)
    also_sets: tuple[str, ...] = ()    # its other per-rank variables (scrubbed where a job must not inherit them)
    is_rank: Callable[[Mapping], bool] | None = None    # besides rank and world size being set (None: nothing else)
    local_world: Callable[[Mapping, int], int] | None = None   # when no local_world_size variable is set
    master: Callable[[Mapping, int, int], str] | None = None    # (env, world, local world) -> rank 0's host

    def started(self, env: Mapping) -> bool:
        """Did this launcher start the process as a rank?"""
        return self.rank in env and self.world_size in env and (self.is_rank is None or self.is_rank(env))

    def read(self, env: Mapping) -> LaunchEnv:
        world = _int(env, self.world_size)
        local_world = next((_int(env, v) for v in self.local_world_size if env.get(v)), 0) or \
            (self.local_world(env, world) if self.local_world else world)
        job = next((env[v] for v in self.job_id if env.get(v)), "")
        master = self.master(env, world, local_world) if self.master else env.get("MASTER_ADDR", "127.0.0.1")
        return LaunchEnv(self.name, _int(env, self.rank), world, _int(env, self.local_rank, 0), local_world,
                         master, _int(env, "MASTER_PORT", job_port(job)), job)


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


def expand_slurm_hostlist(nodelist: str) -> list[str]:
    """Every host of a SLURM host list, in order, as ``scontrol show hostnames`` prints them.

    Items are separated by commas outside brackets; each bracket holds numbers and ranges
    (``[001-004,9]``, zero padding kept), and an item with several brackets is their product
    (``rack[1-2]-n[01-02]`` -> rack1-n01, rack1-n02, rack2-n01, rack2-n02).
    """
    items, depth, current = [], 0, ""
    for ch in nodelist.strip():
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise DDTrainError(f"cannot parse SLURM host list {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise DDTrainError(f"cannot parse SLURM host list {nodelist!r}: unbalanced brackets")
    items.append(current)
    hosts = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = _expand_ranges(ranges, nodelist) if ranges else [""]
            expanded = [head + literal + tail for head in expanded for tail in choices]
        hosts.extend(expanded)
    if not hosts:
        raise DDTrainError(f"cannot parse SLURM host list {nodelist!r}: no host in it")
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise DDTrainError(f"cannot parse SLURM host list {nodelist!r}: {part!r} is not a number or range")
        hi = int(high) if sep else int(low)
        out.extend(str(n).zfill(len(low)) for n in range(int(low), hi + 1))
    return out


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM host list: ``scontrol show hostnames`` where it answers, else our parser.

    ``gpu[03-05,9],cpu1`` -> gpu03; ``node-[001-004]-ib`` -> node-001-ib; ``rack[1-2]-n[01-04]`` -> rack1-n01.
    scontrol needs the cluster's configuration, so outside a configured node it fails and the
    parser (tests/distributed/test_env.py, every documented form) answers instead.
    """
    import shutil
    import subprocess
    if shutil.which("scontrol"):
        try:
            done = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                  timeout=10)
            first = done.stdout.split()
            if done.returncode == 0 and first:
                return first[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_slurm_hostlist(nodelist)[0]


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


def _slurm_master(env, world: int, local_world: int) -> str:
    return env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1"))


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


# In the order detection tries them. MASTER_PORT wins everywhere; otherwise the port comes from
# the job id (SLURM, Open MPI), so two jobs on one node do not both take 29500; without a job id
# (MPICH, a plain process) it is 29500: Hydra puts no job id in the environment, so pass
# -genv MASTER_PORT to run two MPICH jobs on one node.
LAUNCHERS: dict[str, Launcher] = {launcher.name: launcher for launcher in (
    Launcher(name="torchrun", command="torchrun (WORLD_SIZE)", rank="RANK", world_size="WORLD_SIZE",
             local_rank="LOCAL_RANK", local_world_size=("LOCAL_WORLD_SIZE",), job_id=("TORCHELASTIC_RUN_ID",),
             also_sets=("GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                        RESTART_COUNT_ENV, "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                        "MASTER_PORT")),
    Launcher(name="slurm", command="srun (SLURM_NTASKS)", rank="SLURM_PROCID", world_size="SLURM_NTASKS",
             local_rank="SLURM_LOCALID", local_world_size=("SLURM_NTASKS_PER_NODE",),
             job_id=("SLURM_JOB_ID", "SLURM_JOBID"), also_sets=("SLURM_STEP_ID", "SLURM_STEPID"),
             is_rank=slurm_task, local_world=_slurm_tasks_on_node, master=_slurm_master),
    Launcher(name="openmpi", command="mpirun (OMPI_COMM_WORLD_SIZE)", rank="OMPI_COMM_WORLD_RANK",
             world_size="OMPI_COMM_WORLD_SIZE", local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
             local_world_size=("OMPI_COMM_WORLD_LOCAL_SIZE",), job_id=("OMPI_MCA_ess_base_jobid",),
             master=_mpi_master),
    Launcher(name="mpich", command="mpiexec (PMI_SIZE)", rank="PMI_RANK", world_size="PMI_SIZE",
             local_rank="MPI_LOCALRANKID", local_world_size=("MPI_LOCALNRANKS",), master=_mpi_master),
)}


def launcher_variables() -> tuple[str, ...]:
    """Every per-rank variable of every launcher (what a process that starts a new job must not pass on)."""
    names = []
    for launcher in LAUNCHERS.values():
        names += [launcher.rank, launcher.world_size, launcher.local_rank, *launcher.local_world_size,
                  *launcher.also_sets]
    return tuple(dict.fromkeys(names))


def check_variables(env=None) -> None:
    """Refuse (DDTrainError naming the variable) launcher variables that are not numbers in range.

    Checked for every launcher of ``LAUNCHERS`` whose variables are present, before anything starts.
    """
    env = os.environ if env is None else env
    bounds = [("MASTER_PORT", 1, 65535)]
    for launcher in LAUNCHERS.values():
        bounds += [(launcher.rank, 0, None), (launcher.world_size, 1, None), (launcher.local_rank, 0, None),
                   *((name, 1, None) for name in launcher.local_world_size)]
    for name, low, high in bounds:
        raw = env.get(name, "")
        if raw == "":
            continue
        value = _int(env, name)
        if value < low or (high is not None and value > high):
            limits = f"from {low} to {high}" if high is not None else f">= {low}"
            raise DDTrainError(f"environment variable {name}={raw!r} must be {limits}")
    for launcher in LAUNCHERS.values():
        rank, world = env.get(launcher.rank, ""), env.get(launcher.world_size, "")
        if rank != "" and world != "" and int(rank) >= int(world):
            raise DDTrainError(f"environment variables {launcher.rank}={rank} and {launcher.world_size}={world}: "
                               f"the rank must be below the world size")


def launched(env=None) -> bool:
    """True when a launcher (torchrun, srun, mpirun, mpiexec) started this process as a rank (never raises)."""
    env = os.environ if env is None else env
    return any(launcher.started(env) for launcher in LAUNCHERS.values())


def job_port(job_id: str) -> int:
    """The rendezvous port of job ``job_id``: distinct for concurrent jobs on one node."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + int(digits) % PORT_SPAN if digits else DEFAULT_PORT


def detect_env(env=None) -> LaunchEnv:
    """Read the variables of the launcher that started this process (``LAUNCHERS``); a plain process is a world of one."""
    env = os.environ if env is None else env
    for launcher in LAUNCHERS.values():
        if launcher.started(env):
            return launcher.read(env)
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
            raise DDTrainError(f"--nproc {nproc}: this process is already rank {launched.rank} of "
                               f"{launched.world_size} started by {LAUNCHERS[launched.launcher].command}, which decides "
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
