"""One emulated node's agent: torch.distributed.run with its arguments, quietly.

Started by ``run_in_cluster`` inside the node's namespace as
``python -m ddtrain.cluster.node <torch.distributed.run arguments>``. It is torchrun itself
(same parser, same elastic agent) with two differences, as in ``ddtrain.distributed.launch.run_local``:
the agent's own log lines are silenced unless DDTRAIN_DEBUG is set (run.node_env sets
LOGLEVEL and TORCH_CPP_LOG_LEVEL, read before this module runs), and a failed worker is
reported in one line naming the node and rank instead of a traceback.
"""
from __future__ import annotations

import logging
import os
import sys

from ddtrain.distributed.launch import describe_failure


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    if not os.environ.get("DDTRAIN_DEBUG"):
        logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)
    from ddtrain.distributed.launch import _torchrun_parser
    from ddtrain.distributed.launch import _RestartNotice
    from ddtrain.cluster.links import NODE_ENV
    args = _torchrun_parser().parse_args(sys.argv[1:] if argv is None else argv)
    node = os.environ.get(NODE_ENV, args.node_rank)  # with c10d the rendezvous numbers the nodes itself
    if args.max_restarts:  # a restart for a joining node resumes too (elastic membership)
        from ddtrain.distributed.launch import count_reforms
        count_reforms()
    notice = _RestartNotice(args.max_restarts)  # "ddtrain: worker rank R was killed ...; restarting all workers"
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"ddtrain: error: node {node}: {describe_failure(rank, failure.exitcode)}",
              file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # shell style
    finally:
        notice.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
