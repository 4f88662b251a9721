"""What ``--balance speed`` adds to a step on one worker, measured without the other workers' noise (docs/BALANCE.md).

    PYTHONPATH=src python benchmarks/balance_overhead.py --out results/balance/overhead.json

The balancer's per-step work is a post-accumulate-grad hook per parameter (one clock reading),
two clock readings and a few additions at the step's end; every --balance-every steps one
all_gather of 4 float64 per worker. This times forward + backward + SGD step of simple-cnn on 64
MNIST-sized samples with and without the balancer's hooks and per-step bookkeeping, arms
alternating, and a 2-rank Gloo all_gather of the balancer's tensor (in this process's group of 2,
on 127.0.0.1), each the median of many; the added fraction of a step is hooks + all_gather / every.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def steps(model, x, y, optimizer, balancer, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        if balancer is not None:
            balancer._t0, balancer._grad_t = time.perf_counter(), None
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if balancer is not None:   # step_end's per-step part (the collective is timed on its own)
            now = time.perf_counter()
            window = balancer._window
            window[0] += (balancer._grad_t or now) - balancer._t0
            window[1] += now - balancer._t0
            window[2] += x.shape[0]
            window[3] += 1
    return (time.perf_counter() - start) / reps


def gather_rank(rank: int, port: int, reps: int, out) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mine, times = torch.zeros(4, dtype=torch.float64), []
    for _ in range(reps):
        everyone = [torch.empty_like(mine) for _ in range(2)]
        start = time.perf_counter()
        dist.all_gather(everyone, mine)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from ddtrain.models import build_model
    from ddtrain.training.balance import Balancer
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(28, 28), dropout=False)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    balancer = Balancer("speed", workers=2, worker_rank=0, global_batch=128, grad_accum=1, every=args.every,
                        group=None, device=torch.device("cpu"), lookahead=0, updates_per_epoch=100)
    steps(model, x, y, optimizer, None, 3)   # warm-up
    plain, hooked = [], []
    for round_ in range(args.rounds):   # arms alternate, the order flipping every round
        for arm in ("plain", "hooked") if round_ % 2 == 0 else ("hooked", "plain"):
            if arm == "hooked":
                balancer.attach(model)
                hooked.append(steps(model, x, y, optimizer, balancer, args.reps))
                balancer.detach()
            else:
                plain.append(steps(model, x, y, optimizer, None, args.reps))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=gather_rank, args=(r, port, 200, queue)) for r in range(2)]
    for p in procs:
        p.start()
    gather_s = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=30)
    step_plain, step_hooked = statistics.median(plain), statistics.median(hooked)
    added = (step_hooked - step_plain + gather_s / args.every) / step_plain
    result = {"command": sys.argv, "step_plain_s": step_plain, "step_hooked_s": step_hooked,
              "rounds_plain_s": plain, "rounds_hooked_s": hooked, "all_gather_s": gather_s, "every": args.every,
              "added_fraction": added, "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                                                   "note": "2 cores shared with other jobs"}}
    print(f"# step without hooks {1e3 * step_plain:.2f} ms, with {1e3 * step_hooked:.2f} ms (medians of "
          f"{args.rounds} rounds x {args.reps} steps); all_gather {1e6 * gather_s:.0f} us every {args.every} steps; "
          f"added: {100 * added:+.2f} % of a step")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
