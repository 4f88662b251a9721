"""What the preemption check costs a step: ``Preemption.should_stop()`` through the store, on R local Gloo ranks.

    PYTHONPATH=src python3 benchmarks/preempt_check.py --ranks 3 --checks 2000 --out results/preemption/check_cost.json

Every rank calls ``should_stop()`` ``--checks`` times back to back with ``check_every_s=0`` (so that every call
is a check of all ranks; in training checks come about every 0.2 s) and no signal (the common case), then
all-reduces one int over the Gloo group as many times (the alternative the module's docstring weighs). Per
rank: microseconds per call, wall. Correctness: every answer was False, and after a real SIGTERM to the
last rank every rank's next answer is True (``wrong`` lists any rank that disagrees).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, port: int, checks: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ddtrain.reliability.preemption import Preemption
    with Preemption(participants=world, timeout_s=60, check_every_s=0) as stop:
        answers = []
        stop.should_stop()                       # warm up the store connection
        began = time.perf_counter()
        for _ in range(checks):
            answers.append(stop.should_stop())
        store_us = (time.perf_counter() - began) / checks * 1e6
        flag = torch.zeros(1, dtype=torch.int64)
        dist.all_reduce(flag)
        began = time.perf_counter()
        for _ in range(checks):
            dist.all_reduce(flag)
        gloo_us = (time.perf_counter() - began) / checks * 1e6
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGTERM)
        after = stop.should_stop()
    dist.destroy_process_group()
    queue.put({"rank": rank, "store_check_us": round(store_us, 1), "gloo_allreduce_us": round(gloo_us, 1),
               "all_false_before": not any(answers), "true_after_a_signal_to_the_last_rank": after})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--checks", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args.checks, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    ranks = sorted((queue.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=60)
    wrong = [f"rank {r['rank']}" for r in ranks if not (r["all_false_before"] and r["true_after_a_signal_to_the_last_rank"])]
    result = {"what": "one preemption check of all ranks (Preemption.should_stop with check_every_s=0: the store "
                      "counter) against an all-reduce of one int over Gloo",
              "command": "PYTHONPATH=src python3 benchmarks/preempt_check.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if v is not None),
              "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
                          "python": platform.python_version(), "torch": torch.__version__},
              "ranks": ranks,
              "median_store_check_us": statistics.median(r["store_check_us"] for r in ranks),
              "median_gloo_allreduce_us": statistics.median(r["gloo_allreduce_us"] for r in ranks),
              "wrong": wrong}
    print(json.dumps(result, indent=1))
    print(f"#wrong {len(wrong)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
