"""Where fsdp's step goes at world size 1 on one GPU: torch.profiler over a few steps of gpu_sharding's case.

    PYTHONPATH=src:benchmarks python benchmarks/gpu_fsdp_profile.py --arms ddp,fsdp --out results/sharding/profile

For each arm (as gpu_sharding.py: ``fsdp@N`` bounds its units), ``--warmup`` steps, then
``--steps`` steps under torch.profiler (CPU and CUDA activity). Written per arm: the operator table
sorted by self CPU time and by self device time (``<arm>_ops.txt``), and a summary line: wall
ms/step, device-busy ms/step (the sum of kernel times, overlap aside), host ms/step inside FSDP's
hooks and inside optimizer.step (``record_function`` ranges ``FSDP::*`` and ``Optimizer.step*``).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data

from gpu_sharding import CASE, group_of_one
from gpu_single import batches_that_fit, fresh_model, make_data, sync


class Profiled(ddtrain.Callback):
    def __init__(self, warmup, steps, device):
        self.warmup, self.steps, self.device = warmup, steps, device
        self.prof, self.wall = None, None

    def on_step_begin(self, step, state):
        if step == self.warmup:
            sync(self.device)
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
            self.start = time.perf_counter()

    def on_train_end(self, record, state):
        sync(self.device)
        self.wall = time.perf_counter() - self.start
        self.prof.__exit__(None, None, None)


def run(arm, case, data, warmup, steps, device):
    from ddtrain.sync import fsdp as fsdp_module
    strategy, _, bound = arm.partition("@")
    default = fsdp_module.MAX_UNIT_PARAMS
    fsdp_module.MAX_UNIT_PARAMS = int(bound) if bound else default
    _, name, shape, classes, batch, amp, cl, compiled = case
    try:
        model = fresh_model(name, shape, classes, cl, device)
        config = TrainConfig.from_flat(model=name, data="synthetic", strategy=strategy, epochs=0, steps=warmup + steps,
                                       batch_size=batch, lr=0.01, momentum=0.9, val_fraction=0.0, amp=amp,
                                       channels_last=cl, compile=compiled, data_on_device="yes", quiet=True)
        cb = Profiled(warmup, steps, device)
        fit(model, Data("synthetic", data, None, classes, shape, "classification"), config, callbacks=[cb])
    finally:
        fsdp_module.MAX_UNIT_PARAMS = default
    return cb


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="ddp,fsdp")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True, help="a folder")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    group_of_one(device)
    ddtrain.init()
    case = CASE if not args.quick else ("resnet18 quick", "resnet18", (3, 32, 32), 10, 8, "bf16", True, False)
    if args.quick:
        args.warmup, args.steps = 2, 2
    shape, classes, batch = case[2], case[3], case[4]
    data = make_data(shape, classes, batch * batches_that_fit(shape, batch, args.warmup + args.steps + 1, device),
                     device, channels_last=case[6])
    os.makedirs(args.out, exist_ok=True)
    summary = {}
    for arm in args.arms.split(","):
        cb = run(arm, case, data, args.warmup, args.steps, device)
        events = cb.prof.key_averages()
        dev_attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        busy = sum(getattr(e, dev_attr, 0) for e in events) / 1e3 / args.steps
        ranges = lambda prefix: sum(e.cpu_time_total for e in events if e.key.startswith(prefix)) / 1e3 / args.steps  # noqa: E731
        line = {"wall_ms_per_step": cb.wall * 1e3 / args.steps, "device_busy_ms_per_step": busy,
                "fsdp_host_ms_per_step": ranges("FSDP::"), "optimizer_host_ms_per_step": ranges("Optimizer.step")}
        summary[arm] = line
        print(arm, json.dumps({k: round(v, 2) for k, v in line.items()}), flush=True)
        with open(os.path.join(args.out, f"{arm.replace('@', '_')}_ops.txt"), "w") as f:
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n")
            f.write(events.table(sort_by=dev_attr, row_limit=25))
        fsdp_ranges = sorted(((e.key, e.cpu_time_total / 1e3 / args.steps) for e in events if e.key.startswith("FSDP::")),
                             key=lambda kv: -kv[1])[:12]
        print("   ", "; ".join(f"{k} {v:.2f}" for k, v in fsdp_ranges), flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                   "torch": torch.__version__, "case": case[0], "steps": args.steps, "summary": summary}, f, indent=1)
    ddtrain.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
