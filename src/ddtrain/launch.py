"""Start N local worker processes through torch.distributed.run (torchrun's own machinery).

``ddtrain <command> --nproc N`` calls ``run_local(N, argv)`` when no launcher environment is
present: torchrun's elastic agent then starts ``python -m ddtrain <argv>`` N times with
RANK/WORLD_SIZE/MASTER_* set, on 127.0.0.1 and a free port, restarting all of them up to
``max_restarts`` times after a failure. The workers report their own errors (one line,
prefixed with their rank); here we only say which worker ended the job and return non-zero.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from .errors import DDTrainError

LAUNCH_ENV_MARKERS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def inside_launcher() -> bool:
    """True when a launcher (torchrun, srun, mpirun) already started this process as a rank."""
    return any(name in os.environ for name in LAUNCH_ENV_MARKERS)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the kernel says is free right now (for the rendezvous store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def strip_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE`` (workers must not launch again)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == name:
            skip = True
        elif not item.startswith(name + "="):
            out.append(item)
    return out


def run_local(nproc: int, argv: list[str], *, max_restarts: int = 0, env: dict | None = None,
              module: str = "ddtrain") -> int:
    """Run ``python -m <module> <argv>`` as ``nproc`` ranks; the job's exit status."""
    if nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {nproc}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    cores = os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    os.environ.update(env or {})
    if not os.environ.get("DDTRAIN_DEBUG"):
        logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    port = free_port()
    args = parse_args(["--nnodes", "1", "--nproc-per-node", str(nproc), "--rdzv-backend", "static",
                       "--master-addr", "127.0.0.1", "--master-port", str(port),
                       "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
                       "--module", module, *argv])
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"ddtrain: error: {describe_failure(rank, failure.exitcode)}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def describe_failure(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker rank {rank} was killed by {name}; the job was stopped"
    return f"worker rank {rank} failed with exit code {exitcode} (its message is above); the job was stopped"
