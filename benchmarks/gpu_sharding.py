"""ddp against zero2 and fsdp at world size 1 on one GPU, interleaved in one run: images/s and peak memory.

    PYTHONPATH=src:benchmarks python benchmarks/gpu_sharding.py --out results/sharding/gpu_h200.json   # the GPU
    PYTHONPATH=src:benchmarks python benchmarks/gpu_sharding.py --quick --out /tmp/s.json             # CPU smoke

The case is gpu_single.py's compiled path: ResNet-50, 224x224, batch 256, bf16 autocast, channels-last,
``--compile``, SGD+momentum, the data resident on the GPU, through ``ddtrain.fit`` (the loop ``ddtrain
train`` runs). The script makes a process group of one (as ``torchrun --nproc-per-node 1`` would), so
zero2 and fsdp run their own machinery with one shard (``ddtrain.sync.wrap``): zero2's flat gradient,
shard step and parameter copy-back; fsdp's ``fully_shard`` units and their all-gathers (no-ops at one
rank) with ``--fsdp-param-dtype`` (default fp32: autocast does the bf16 compute, as ddp's arm). ddp at
world size 1 is the bare model. The arms are interleaved (ddp, zero2, fsdp, then again) ``--repeats``
times; each arm's images/s is timed between two synchronised steps after ``--warmup`` steps and the
median is taken; the ratio is each arm's median over ddp's. Peak memory: torch.cuda.max_memory_allocated
over the arm's run (reset before it), and the run record's per-rank bytes (ddtrain.sync.memory).
Correctness (``#wrong`` as nccl-tests has it): each arm's loss after the run must be finite.
An arm that fails is recorded with its error and the others go on.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data

from gpu_single import StepTimer, batches_that_fit, fresh_model, make_data

CASE = ("resnet50 bf16 cl compile", "resnet50", (3, 224, 224), 1000, 256, "bf16", True, True)


def group_of_one(device: torch.device) -> None:
    """A process group of one rank (what torchrun --nproc-per-node 1 gives), so the sharded strategies are built."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))


def run_arm(case, data, warmup, steps, device, arm, param_dtype) -> dict:
    """One arm: a strategy, or ``fsdp@N`` (fsdp with units of at most N parameters, sync.fsdp.MAX_UNIT_PARAMS)."""
    from ddtrain.sync import fsdp as fsdp_module
    strategy, _, bound = arm.partition("@")
    default = fsdp_module.MAX_UNIT_PARAMS
    fsdp_module.MAX_UNIT_PARAMS = int(bound) if bound else default
    try:
        return _run_arm(case, data, warmup, steps, device, strategy, param_dtype)
    finally:
        fsdp_module.MAX_UNIT_PARAMS = default


def _run_arm(case, data, warmup, steps, device, strategy, param_dtype) -> dict:
    _, name, shape, classes, batch, amp, cl, compiled = case
    model = fresh_model(name, shape, classes, cl, device)
    extra = {"fsdp_param_dtype": param_dtype} if strategy == "fsdp" else {}
    config = TrainConfig.from_flat(model=name, data="synthetic", strategy=strategy, epochs=0, steps=warmup + steps,
                                   batch_size=batch, lr=0.01, momentum=0.9, val_fraction=0.0, amp=amp,
                                   channels_last=cl, compile=compiled, data_on_device="yes", quiet=True, **extra)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = StepTimer(warmup, device)
    record = fit(model, Data("synthetic", data, None, classes, shape, "classification" if classes else "regression"),
                 config, callbacks=[timer])
    loss = record["epochs"][-1]["train_loss"] if record["epochs"] else float("nan")
    return {"images_per_s": steps * batch / timer.elapsed, "train_loss": loss, "wrong": int(not math.isfinite(loss)),
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "memory": (record.get("comm") or [{}])[0].get("memory"),
            "fsdp_units": (record.get("comm") or [{}])[0].get("fsdp_units")}


def write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--strategies", default="ddp,zero2,fsdp",
                   help="arms, comma-separated; fsdp@N: fsdp with units of at most N parameters")
    p.add_argument("--fsdp-param-dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--quick", action="store_true", help="a tiny ResNet-18 without compile, few steps (CPU smoke test)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group_of_one(device)
    ddtrain.init()
    case = CASE
    if args.quick:
        case = ("resnet18 bf16 cl (quick)", "resnet18", (3, 32, 32), 10, 4, "bf16", True, False)
        args.warmup, args.steps, args.repeats = 1, 3, 2
    _, mname, shape, classes, batch = case[:5]
    data = make_data(shape, classes, batch * batches_that_fit(shape, batch, args.warmup + args.steps + 1, device),
                     device, channels_last=case[6])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# device: {name}; torch {torch.__version__}; case {case[0]}, batch {batch}; {args.repeats} interleaved "
          f"repeats of {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    strategies = args.strategies.split(",")
    runs: dict[str, list] = {s: [] for s in strategies}
    for repeat in range(args.repeats):
        for strategy in strategies:
            try:
                result = run_arm(case, data, args.warmup, args.steps, device, strategy, args.fsdp_param_dtype)
            except Exception as exc:   # recorded; the other arms go on
                result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
            runs[strategy].append(result)
            write(args.out, {"partial": True, "case": case[0], "runs": runs})   # a run cut short keeps what it had
            print(f"# repeat {repeat} {strategy}: " + (f"{result['images_per_s']:.1f} img/s" if "images_per_s" in result
                                                        else result["error"][:200]), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary = {}
    base = [r["images_per_s"] for r in runs.get("ddp", []) if "images_per_s" in r]
    print("# strategy  images/s(median)  ratio_vs_ddp  cuda_peak_MB  param_MB  grad_MB  optstate_MB  #wrong")
    for strategy, results in runs.items():
        ok = [r for r in results if "images_per_s" in r]
        if not ok:
            summary[strategy] = {"error": results[0].get("error")}
            print(f"  {strategy:<9} failed: {results[0].get('error', '')[:150]}")
            continue
        median = statistics.median(r["images_per_s"] for r in ok)
        ratio = median / statistics.median(base) if base else None
        peak = max((r["cuda_max_allocated_bytes"] or 0) for r in ok)
        memory = ok[-1]["memory"] or {}
        summary[strategy] = {"images_per_s_median": median, "ratio_vs_ddp": ratio, "cuda_max_allocated_bytes": peak,
                             "memory": memory, "wrong": sum(r["wrong"] for r in ok), "runs": len(ok)}
        mb = lambda v: f"{v / 1e6:9.1f}" if v else "        -"   # noqa: E731
        print(f"  {strategy:<9} {median:16.1f}  {ratio if ratio is not None else float('nan'):12.3f}  {mb(peak)}  "
              f"{mb(memory.get('parameter_bytes'))}  {mb(memory.get('gradient_bytes'))}  "
              f"{mb(memory.get('optimizer_state_bytes'))}  {summary[strategy]['wrong']:6d}")
    out = {"device": name, "torch": torch.__version__, "case": case[0], "batch": batch, "warmup": args.warmup,
           "steps": args.steps, "repeats": args.repeats, "fsdp_param_dtype": args.fsdp_param_dtype,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
           "summary": summary, "runs": runs}
    write(args.out, out)
    print(f"# wrote {args.out}")
    ddtrain.shutdown()
    return 0 if all("error" not in v and not v["wrong"] for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
