"""torch.compile's modes and options on the one-GPU ResNet-50 step, each in a hand-written loop (issue 20).

    PYTHONPATH=src python experiments/gpu_compile_modes.py --out results/gpu1_issue20/modes.json

Same case as gpu_defaults.py (ResNet-50, batch 256, bf16, channels-last, GPU-resident batches);
one fresh model per variant, compiled with that variant's mode/options; prints the first step's
seconds (compilation) and images/s over the timed steps, so a default is chosen by measurement.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# gpu_single.py (the one-GPU benchmark these variants build on) lives in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_single import fresh_model, make_data, sync

VARIANTS = {
    "default": dict(),
    "cdt": dict(options={"coordinate_descent_tuning": True}),
    "max-autotune-no-cudagraphs": dict(mode="max-autotune-no-cudagraphs"),
    "reduce-overhead": dict(mode="reduce-overhead"),
}


def run(variant, data, warmup, steps, device, fused):
    model = fresh_model("resnet50", (3, 224, 224), 1000, True, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=fused or None)
    step_model = torch.compile(model, **VARIANTS[variant])
    batch = 256
    pool = len(data) // batch
    xs = [data.x[i * batch:(i + 1) * batch] for i in range(pool)]
    ys = [data.y[i * batch:(i + 1) * batch] for i in range(pool)]
    first = None
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == 1:
            sync(device)
            first = time.perf_counter() - t0
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = step_model(xs[i % pool])
            loss = F.cross_entropy(out.float(), ys[i % pool])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return steps * batch / (time.perf_counter() - start), first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    data = make_data((3, 224, 224), 1000, 256 * (args.warmup + args.steps + 1), device, channels_last=True)
    variants = args.variants.split(",")
    runs = {v: [] for v in variants}
    compile_s = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            try:
                rate, first = run(v, data, args.warmup, args.steps, device, fused=False)
            except Exception as exc:  # a mode that fails here is a finding, not the end of the run
                print(f"  {v}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
                rate, first = float("nan"), float("nan")
            runs[v].append(rate)
            compile_s[v].append(first)
            print(f"  round {r + 1} {v:<28} {rate:>8.0f} images/s  first step {first:.1f} s", flush=True)
    med = {v: statistics.median(x) for v, x in runs.items()}
    base = med.get("default")
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}: median of {args.repeats}")
    for v, x in med.items():
        print(f"  {v:<28} {x:>8.0f} images/s  {x / base if base else float('nan'):.3f}x default")
    if args.out:
        import json
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "warmup": args.warmup,
                       "steps": args.steps, "repeats": args.repeats, "images_per_s": med, "all_runs": runs,
                       "first_step_s": compile_s}, f, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
