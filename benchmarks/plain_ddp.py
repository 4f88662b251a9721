"""A minimal hand-written PyTorch DDP training loop: the reference ``ddtrain train --strategy ddp`` is timed against.

    torchrun --nproc-per-node 2 benchmarks/plain_ddp.py --steps 40 --out plain.json
    python benchmarks/ddp_overhead.py            # both, interleaved, and the ratio

Only plain torch in the loop: init_process_group, DistributedDataParallel, DistributedSampler +
DataLoader (``--loader dataloader``, what one writes by hand) or slicing the in-memory tensors by
the sampler's indices (``--loader tensor``, which is how ddtrain batches in-memory data), SGD,
cross-entropy. The model and the data come from ddtrain's builders only so that both sides
train the very same network on the very same samples. Rank 0 writes ``loop_s`` (seconds from the
loop's start to the end of the last step: the span of ddtrain's epoch ``time_s``) and, over the
steps after ``--warmup-steps``, per rank: the mean and median wall time of a step (from the end
of one step to the end of the next, as ddtrain's profile measures it) and the process's CPU
seconds per step -- the figures ``ddtrain train --profile`` reports for the same steps.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddtrain.data import load_dataset
from ddtrain.models import build_model


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="simple-cnn")
    p.add_argument("--data", default="synthetic:mnist")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--steps", type=int, default=40, help="steps in all, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader", choices=["dataloader", "tensor"], default="dataloader")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not 1 <= args.warmup_steps < args.steps:
        raise SystemExit(f"need 1 <= --warmup-steps < --steps, got {args.warmup_steps} and {args.steps}")

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    options = dict(item.split("=", 1) for item in args.data_arg)
    data = load_dataset(args.data, val_fraction=0.0, seed=args.seed, **options)
    x, y = data.train.x, data.train.y
    torch.manual_seed(args.seed)
    model = build_model(args.model, num_classes=data.num_classes, in_channels=x.shape[1], input_size=tuple(x.shape[2:]))
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    if args.loader == "dataloader":
        batches = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler, drop_last=True)
    else:
        order = torch.tensor(list(sampler))
        batches = [(x[i], y[i]) for i in order[: len(order) // args.batch_size * args.batch_size]
                   .view(-1, args.batch_size)]
    if args.steps > len(batches):
        raise SystemExit(f"--steps {args.steps} is more than one epoch ({len(batches)} steps); add samples")
    model.train()
    start = time.perf_counter()
    ends, cpu = [], []
    for step, (xb, yb) in enumerate(batches):
        if step == args.steps:
            break
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ends.append(time.perf_counter())
        cpu.append(time.process_time())
    loop_s = time.perf_counter() - start
    w = args.warmup_steps
    steps = [b - a for a, b in zip(ends[w - 1:], ends[w:])]
    mine = torch.tensor([statistics.fmean(steps), statistics.median(steps), (cpu[-1] - cpu[w - 1]) / len(steps),
                         min(steps)], dtype=torch.float64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        result = {"loop_s": loop_s, "steps": args.steps, "world_size": world, "loss": loss.item(),
                  "samples_per_s": args.steps * args.batch_size * world / loop_s, "loader": args.loader,
                  "warmup_steps": w, "ranks": [{"step_time_s": t[0].item(), "step_time_median_s": t[1].item(),
                                                "cpu_per_step_s": t[2].item(), "step_time_min_s": t[3].item()}
                                               for t in everyone]}
        print(json.dumps(result))
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f)
            os.replace(args.out + ".tmp", args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
