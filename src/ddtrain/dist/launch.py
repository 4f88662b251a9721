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

from ddtrain.errors import DDTrainError

LAUNCH_ENV_MARKERS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# A rank that stops because rank 0 reports the problem (once) exits with this status, silently.
PEER_STOPPED_EXIT = 4
LOST_PEER_EXIT = 5       # a rank whose connection to a failed peer broke (cli._report_unexpected)


def inside_launcher() -> bool:
    """True when a launcher (torchrun, srun, mpirun) already started this process as a rank."""
    from ddtrain.dist.env import launched  # an sbatch batch shell has SLURM_PROCID too, but is no task
    return launched()


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
    from torch.distributed.run import run

    cores = os.cpu_count() or 1
    # Our choice is per launch (a demo launches 1, 2, then 4 workers from one process); a value
    # the user set before ddtrain started is theirs and stays.
    if "OMP_NUM_THREADS" not in os.environ or os.environ.get("DDTRAIN_SET_OMP_NUM_THREADS") == "1":
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
        os.environ["DDTRAIN_SET_OMP_NUM_THREADS"] = "1"
    os.environ.update(env or {})
    if not os.environ.get("DDTRAIN_DEBUG"):
        logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    notice = _RestartNotice(max_restarts)
    port = free_port()
    if max_restarts:
        # The static rendezvous keeps one store for every attempt, so a restarted process group
        # finds the dead attempt's addresses there and cannot connect. The c10d rendezvous with
        # its store not shared gives each attempt a fresh store (hosted by the new rank 0).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1"]
    else:
        rendezvous = ["--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    args = _torchrun_parser().parse_args(["--nnodes", "1", "--nproc-per-node", str(nproc), *rendezvous,
                       "--max-restarts", str(max_restarts), "--monitor-interval", "0.2",
                       "--module", module, *argv])
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = cause(exc.failures)
        print(f"ddtrain: error: {describe_failure(rank, failure.exitcode)}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        notice.close()
    return 0


def _priority(exitcode: int) -> int:
    """Which failure caused the others: a signal other than the agent's SIGTERM, then an error status,
    then a rank that failed with an error of its own (1), then one that lost its peers or stopped
    for rank 0's report, then SIGTERM."""
    if exitcode < 0:
        return 4 if -exitcode == signal.SIGTERM else 0
    return {1: 2, LOST_PEER_EXIT: 3, PEER_STOPPED_EXIT: 3}.get(exitcode, 1)


def cause(failures: dict):
    """(rank, failure) that most likely started a failed job (torchrun's timestamps are whole seconds)."""
    order = {r: i for i, r in enumerate(failures)}  # torchrun lists them in the order it saw them fail
    rank = min(failures, key=lambda r: (_priority(failures[r].exitcode), failures[r].timestamp, order[r]))
    return rank, failures[rank]


class _RestartNotice(logging.Handler):
    """Turns torchrun's own log records into one line when it restarts the workers."""

    PROC_LOGGER = "torch.distributed.elastic.multiprocessing.api"
    AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"

    def __init__(self, max_restarts: int):
        super().__init__(logging.INFO)
        self.max_restarts, self.last = max_restarts, None
        self.loggers = [logging.getLogger(name) for name in (self.PROC_LOGGER, self.AGENT_LOGGER)] \
            if max_restarts > 0 and not os.environ.get("DDTRAIN_DEBUG") else []
        self.saved = [(lg.level, lg.propagate) for lg in self.loggers]
        for lg in self.loggers:
            lg.setLevel(logging.INFO)
            lg.propagate = False
            lg.addHandler(self)

    def emit(self, record) -> None:
        msg = str(record.msg)
        if msg.startswith("failed (exitcode"):
            self.last = (record.args[1], record.args[0])  # (local rank, exit code)
        elif "attempts left" in msg:
            left = record.args[2]
            what = describe_failure(*self.last).split(";")[0] if self.last else "a worker failed"
            print(f"ddtrain: {what}; restarting all workers (restart {self.max_restarts - left + 1} of "
                  f"{self.max_restarts})", file=sys.stderr, flush=True)

    def close(self) -> None:
        for lg, (level, propagate) in zip(self.loggers, self.saved):
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.propagate = propagate
        super().close()


def describe_failure(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"worker rank {rank} was killed by {name}; the job was stopped"
    return f"worker rank {rank} failed with exit code {exitcode} (its message is above); the job was stopped"


def _torchrun_parser():
    """torchrun's own parser, told not to read our flags as abbreviations of its own.

    Otherwise a worker flag such as ``--monitor`` would be taken for torchrun's
    ``--monitor-interval`` before it reaches the worker.
    """
    from torch.distributed.run import get_args_parser
    parser = get_args_parser()
    parser.allow_abbrev = False
    return parser
