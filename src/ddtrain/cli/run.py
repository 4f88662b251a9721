"""``ddtrain run --nproc N [--strategy S] script.py ARGS...``: N local workers for any script, the local counterpart
of ``torchrun``.

The workers start through torchrun's own machinery (``ddtrain.distributed.launch.run_local``, as
``ddtrain train --nproc`` does, so the same failure naming, ``--max-restarts`` and deadlines),
each running ``script.py ARGS`` as its ``__main__`` with the launcher environment torchrun sets
(``ddtrain.init()`` reads it). ``--strategy``, ``--backend`` and ``--timeout`` reach the script
as the defaults of ``ddtrain.prepare`` and ``ddtrain.init`` (``DDTRAIN_STRATEGY``,
``DDTRAIN_BACKEND``, ``DDTRAIN_TIMEOUT_S``); an argument the script passes itself wins.
No root is needed (``ddtrain cluster run`` is the emulated multi-node one).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

from ddtrain.distributed.config import BACKENDS

SCRIPT_MODULE = "ddtrain.cli.run"     # what each worker runs: ``python -m ddtrain.cli.run script.py ARGS``


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="local worker processes to start")
    p.add_argument("--strategy", default=None,
                   help="the default strategy of ddtrain.prepare in the script (DDTRAIN_STRATEGY)")
    p.add_argument("--backend", choices=list(BACKENDS), default=None,
                   help="process group backend (DDTRAIN_BACKEND; default: NCCL when every worker has a GPU)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds any rank waits on another before failing (DDTRAIN_TIMEOUT_S; default 300)")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers up to this many times after a failure")
    p.add_argument("script", help="the Python script every worker runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def main(args) -> int:
    from ddtrain.distributed import launch
    from ddtrain.errors import DDTrainError
    if launch.inside_launcher():
        raise DDTrainError("ddtrain run starts its own workers; inside a launcher run the script directly "
                           f"(python {args.script})")
    if args.nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {args.nproc}")
    if args.max_restarts < 0:
        raise DDTrainError(f"--max-restarts must be >= 0, got {args.max_restarts}")
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
        if not (args.timeout > 0 and math.isfinite(args.timeout)):
            raise DDTrainError(f"--timeout must be a positive number of seconds, got {args.timeout}")
        env["DDTRAIN_TIMEOUT_S"] = repr(args.timeout)
    return launch.run_local(args.nproc, [args.script, *args.script_args], max_restarts=args.max_restarts,
                            env=env, module=SCRIPT_MODULE)


def run_script(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``, as ``python script.py ARGS`` would."""
    import runpy
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # the script's folder first, as python puts it
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    run_script(sys.argv[1:])
