"""What ``--balance speed`` adds to a step on one worker, measured without the other workers' noise (docs/BALANCE.md).

    PYTHONPATH=src python benchmarks/balance_overhead.py --out results/balance/overhead.json

The balancer's per-step work is a post-accumulate-grad hook per parameter (one clock reading),
two clock readings and a few additions at the step's end; every --balance-every steps one
all_gather of 4 float64 per worker. None of it grows with the model's compute, and on the shared
2-core machine a whole step varies by +-30 %, so the added time is measured where it is not
drowned: steps of a tiny model with simple-cnn's 8 parameter tensors (compute ~nothing), with and
without the balancer's hooks and per-step bookkeeping, arms alternating, medians of many rounds;
plus a 2-rank Gloo all_gather of the balancer's tensor (on 127.0.0.1). The added fraction is
(hooks + all_gather / every) over the median plain step of simple-cnn on 64 MNIST-sized samples.
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
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=300)
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
    cnn_step = statistics.median(steps(model, x, y, optimizer, None, 3) for _ in range(7))
    tiny = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])   # 8 parameter tensors, as simple-cnn
    tx, ty = torch.randn(4, 2), torch.randint(0, 2, (4,))
    tiny_optimizer = torch.optim.SGD(tiny.parameters(), lr=0.01, momentum=0.9)
    plain, hooked = [], []
    for round_ in range(args.rounds):   # arms alternate, the order flipping every round
        for arm in ("plain", "hooked") if round_ % 2 == 0 else ("hooked", "plain"):
            if arm == "hooked":
                balancer.attach(tiny)
                hooked.append(steps(tiny, tx, ty, tiny_optimizer, balancer, args.reps))
                balancer.detach()
            else:
                plain.append(steps(tiny, tx, ty, tiny_optimizer, None, args.reps))
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
    added = (step_hooked - step_plain + gather_s / args.every) / cnn_step
    result = {"command": sys.argv, "simple_cnn_step_s": cnn_step, "tiny_step_plain_s": step_plain,
              "tiny_step_hooked_s": step_hooked,
              "rounds_plain_s": plain, "rounds_hooked_s": hooked, "all_gather_s": gather_s, "every": args.every,
              "added_fraction": added, "machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                                                   "note": "2 cores shared with other jobs"}}
    print(f"# tiny model's step without the balancer {1e6 * step_plain:.1f} us, with {1e6 * step_hooked:.1f} us "
          f"(medians of {args.rounds} rounds x {args.reps} steps); all_gather {1e6 * gather_s:.0f} us every "
          f"{args.every} steps; simple-cnn's step (64 samples) {1e3 * cnn_step:.1f} ms; added: {100 * added:+.3f} % "
          "of its step")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
