"""``ddtrain run --nproc N|MIN:MAX [--nnodes N|MIN:MAX ...] script.py ARGS...``: workers for any script, the
counterpart of ``torchrun``, with the launch policy of ``ddtrain train``.

The workers start through torchrun's own machinery (``ddtrain.distributed.plan``, as ``ddtrain
train`` starts its workers, so the same checks and one-line messages, the same failure naming,
``--max-restarts``, multi-node and elastic launches), each running ``script.py ARGS`` as its
``__main__`` with the launcher environment torchrun sets (``ddtrain.init()`` reads it).
``--strategy``, ``--backend`` and ``--timeout`` reach the script as the defaults of
``ddtrain.prepare`` and ``ddtrain.init`` (``DDTRAIN_STRATEGY``, ``DDTRAIN_BACKEND``,
``DDTRAIN_TIMEOUT_S``); an argument the script passes itself wins. ``--checkpoint-dir`` and
``--global-batch-size`` reach it as ``DDTRAIN_CHECKPOINT_DIR`` and ``DDTRAIN_GLOBAL_BATCH_SIZE``
(``ddtrain.distributed.job.checkpoint_dir()``, ``global_batch_size()``), and each worker's
torchrun restart count (``RESTART_COUNT_ENV``) is the job's attempt (0, then 1, 2, ... after each restart or
resize: ``ddtrain.distributed.job.restart_attempt()``). The script's state goes through
``ddtrain.save_state``/``load_state`` (their default directory is ``DDTRAIN_CHECKPOINT_DIR``; an
unchanged script gets both from ``prepare``), and ``prepare``'s training loader takes the global
batch; with ``--checkpoint-dir`` a SIGTERM or SIGINT is forwarded to the workers, which save after
the same step (``ddtrain.stop_requested()``), and the launcher exits 75 with one line
(``ddtrain.training.state``, docs/PORTING.md). No root is needed (``ddtrain cluster run`` is the
emulated multi-node one).
"""
from __future__ import annotations

import argparse
import os
import sys

from ddtrain.distributed.config import BACKENDS
from ddtrain.distributed.job import RESTART_COUNT_ENV

SCRIPT_MODULE = "ddtrain.cli.run"     # what each worker runs: ``python -m ddtrain.cli.run script.py ARGS``
# said after the workers stopped on a signal with their state saved (ddtrain.save_state, prepare(checkpoint_dir=...))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", default="1",
                   help="local worker processes to start, or MIN:MAX: start MAX and go on with fewer (down to MIN) "
                        "when workers are lost: the script is restarted at the new size, WORLD_SIZE the new size and "
                        f"{RESTART_COUNT_ENV} the job's attempt, 1, 2, ... (needs --checkpoint-dir and "
                        "--global-batch-size; docs/ELASTIC.md)")
    p.add_argument("--nnodes", default="1",
                   help="nodes of a multi-node launch (run the same command on each), or MIN:MAX for a job that "
                        "goes on with MIN..MAX nodes (needs --max-restarts, --checkpoint-dir, --global-batch-size)")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's index, 0..nnodes-1 (with --max-restarts the rendezvous assigns it)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", default=None,
                   help="HOST:PORT of node 0 for a multi-node launch (every node passes the same)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to this many times after a failure")
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None,
                   help="where the script keeps its state, exported to the workers as DDTRAIN_CHECKPOINT_DIR (None: "
                        "that variable's value if set): the default directory of ddtrain.save_state/load_state, and "
                        "prepare() saves there on a stop signal and loads from there at the start; needed to change "
                        "size")
    p.add_argument("--preempt-signal", metavar="SIG", default="",
                   help="with --checkpoint-dir: a signal besides SIGTERM and SIGINT that the launcher passes on to the "
                        "workers to stop and save (e.g. USR1 for sbatch --signal=USR1@120), told to the script as "
                        "DDTRAIN_PREEMPT_SIGNAL (docs/RELIABILITY.md, 'Preemption')")
    p.add_argument("--preempt-grace-s", metavar="S", type=float, default=120.0,
                   help="with --checkpoint-dir: after a stop signal, the seconds the workers get to save before the "
                        "launcher kills them (default 120)")
    p.add_argument("--requeue", action="store_true",
                   help="with --checkpoint-dir, under SLURM: when the workers stopped on a signal with their state "
                        "saved, requeue the job (scontrol requeue)")
    p.add_argument("--global-batch-size", metavar="G", type=int, default=None,
                   help="the script's samples per optimizer update over all workers, kept at every size, exported "
                        "to the workers as DDTRAIN_GLOBAL_BATCH_SIZE (None: that variable's value if set): a "
                        "script states its global batch with this flag or that variable, and each worker takes "
                        "G / WORLD_SIZE; only sizes dividing G are run (with MIN:MAX the others are skipped)")
    p.add_argument("--strategy", default=None,
                   help="the default strategy of ddtrain.prepare in the script (DDTRAIN_STRATEGY)")
    p.add_argument("--backend", choices=list(BACKENDS), default=None,
                   help="process group backend (DDTRAIN_BACKEND; default: NCCL when every worker has a GPU)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any rank waits on another before failing (DDTRAIN_TIMEOUT_S; default 300)")
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def main(args) -> int:
    from ddtrain.distributed import job, launch
    from ddtrain.distributed.config import DistConfig, size_range
    from ddtrain.distributed.plan import LaunchSpec, plan_launch
    from ddtrain.errors import DDTrainError
    if launch.inside_launcher():
        raise DDTrainError("ddtrain run starts its own workers; inside a launcher run the script directly "
                           f"(python {args.script})")
    min_nproc, nproc = size_range(args.nproc, "nproc")
    timeout = {} if args.timeout is None else {"timeout": args.timeout}
    dist = DistConfig(backend=args.backend, nnodes=args.nnodes, node_rank=args.node_rank,
                      rdzv_endpoint=args.rdzv_endpoint, **timeout)
    checkpoint_dir = args.checkpoint_dir or job.checkpoint_dir()
    global_batch = args.global_batch_size if args.global_batch_size is not None else job.global_batch_size()
    if (args.preempt_signal or args.requeue) and not checkpoint_dir:
        raise DDTrainError(f"{'--preempt-signal' if args.preempt_signal else '--requeue'} needs --checkpoint-dir DIR "
                           "(where the script saves its state when stopped)")
    if not args.preempt_grace_s > 0:
        raise DDTrainError(f"--preempt-grace-s must be a positive number of seconds, got {args.preempt_grace_s}")
    from ddtrain.reliability.preemption import parse_signals
    spec = LaunchSpec(nproc=nproc, min_nproc=min_nproc, dist=dist, max_restarts=args.max_restarts,
                      checkpoint_dir=checkpoint_dir, global_batch_size=global_batch,
                      worker_batch="each worker's batch", preempt_signals=parse_signals(args.preempt_signal),
                      preempt_grace_s=args.preempt_grace_s, requeue=args.requeue,
                      resume_hint="run the same command again: the script continues from its state in "
                                  f"{checkpoint_dir}")
    if not os.path.isfile(args.script):
        raise DDTrainError(f"{args.script}: no such script")
    env = {}
    if args.strategy is not None:
        from ddtrain.sync import strategy_spec
        strategy_spec(args.strategy)        # an unknown name lists the valid ones, before any worker starts
        env["DDTRAIN_STRATEGY"] = args.strategy
    if args.backend is not None:
        env["DDTRAIN_BACKEND"] = args.backend
    if args.timeout is not None:
        env["DDTRAIN_TIMEOUT_S"] = repr(args.timeout)
    if checkpoint_dir:
        env[job.CHECKPOINT_DIR_ENV] = os.path.abspath(checkpoint_dir)
    if global_batch:
        env[job.GLOBAL_BATCH_SIZE_ENV] = str(global_batch)
    plan = plan_launch(spec)
    return plan.start([args.script, *args.script_args], module=SCRIPT_MODULE, env=env)


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``, as ``python script.py ARGS`` would."""
    import runpy
    from ddtrain.distributed.launch import die_with_launcher
    from ddtrain.distributed.rendezvous import add_attempt_base
    die_with_launcher()     # no worker outlives its launcher, however the launcher ends
    add_attempt_base()      # the restart count counts the elastic launcher's earlier sizes too
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # the script's folder first, as python puts it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
