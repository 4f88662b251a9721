"""Which GPU defaults a library that owns the loop should apply: each measured on and off, in one run,
against an independent hand-written loop (issue 20, point 3).

    PYTHONPATH=src python experiments/gpu_defaults.py --out results/gpu1_issue20/defaults5.json

One case: ResNet-50, batch 256, bf16 autocast, channels-last, torch.compile, GPU-resident synthetic
data (the case of docs/PERFORMANCE.md "One GPU"). Variants of ``ddtrain.fit`` (strategy ddp at world
size 1), interleaved with the plain loop of ``gpu_single.time_plain`` (what a careful user writes:
compile, autocast, channels-last, SGD with momentum, ``zero_grad(set_to_none=True)``), ``--repeats``
rounds, median images/s per variant:

  plain        the hand-written loop (cudnn.benchmark off, PyTorch's default for-each SGD)
  untuned      fit with the loop's SGD given (for-each) and --compile-options default
  tuned        ... with --compile-options tuned (inductor's coordinate-descent kernel tuning)
  +fused       ... and SGD(fused=True): one kernel for the whole update instead of for-each launches
  +graphs      ... and --compile-options tuned-graphs (CUDA graphs of the compiled step)
  +cudnn       tuned+fused with torch.backends.cudnn.benchmark = True (per-shape algorithm search)
  ddtrain      fit as ``ddtrain train --compile`` runs a long run: its own optimizer (fused on CUDA)
               and what --compile-options auto picks for >= 100,000 steps in one process (tuned-graphs)

Earlier variants (inductor options patched around fit, which did not reach the compiler) are in
results/gpu1_issue20/defaults*.json; torch.compile's modes in a hand-written loop are
experiments/gpu_compile_modes.py.
Compiled graphs are shared through inductor's cache, so only the first variant pays compilation.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data
# gpu_single.py (the one-GPU benchmark these variants build on) lives in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_single import StepTimer, batches_that_fit, fresh_model, make_data, time_plain

CASE = ("resnet50 bf16 cl compile", "resnet50", (3, 224, 224), 1000, 256, "bf16", True, True)
VARIANTS = {  # cudnn.benchmark, optimizer (for-each, fused, or None: the one fit builds), compile options
    "untuned": (False, "foreach", "default"), "tuned": (False, "foreach", "tuned"),
    "+fused": (False, "fused", "tuned"), "+graphs": (False, "fused", "tuned-graphs"),
    # ddtrain: what --compile-options auto picks for a long run (>= 100,000 steps, training/compiled.py); this
    # benchmark's 55 steps would get torch.compile's defaults from auto, so the choice is named
    "+cudnn": (True, "fused", "tuned"), "ddtrain": (False, None, "tuned-graphs")}


def time_variant(data, warmup, steps, device, cudnn_benchmark, optimizer_kind, compile_options) -> float:
    _, name, shape, classes, batch, amp, cl, compiled = CASE
    torch.backends.cudnn.benchmark = cudnn_benchmark
    model = fresh_model(name, shape, classes, cl, device)
    optimizer = None if optimizer_kind is None else \
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=(optimizer_kind == "fused") or None)
    config = TrainConfig.from_flat(model=name, data="synthetic", strategy="ddp", epochs=0, steps=warmup + steps,
                                   batch_size=batch, lr=0.01, momentum=0.9, val_fraction=0.0, amp=amp,
                                   channels_last=cl, compile=compiled, compile_options=compile_options,
                                   data_on_device="yes", quiet=True)
    timer = StepTimer(warmup, device)
    fit(model, Data("synthetic", data, None, classes, shape, "classification"), config, optimizer=optimizer,
        callbacks=[timer])
    torch.backends.cudnn.benchmark = False
    return steps * batch / timer.elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", default="untuned,tuned,+fused,+graphs,ddtrain")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ddtrain.init()
    device = ddtrain.device()
    if device.type != "cuda":
        print("gpu_defaults.py needs a CUDA GPU", file=sys.stderr)
        return 2
    _, _, shape, classes, batch = CASE[:5]
    data = make_data(shape, classes, batch * batches_that_fit(shape, batch, args.warmup + args.steps + 1, device),
                     device, channels_last=True)
    variants = args.variants.split(",")
    runs = {"plain": [], **{v: [] for v in variants}}
    started = time.time()
    for r in range(args.repeats):
        torch.backends.cudnn.benchmark = False
        runs["plain"].append(time_plain(CASE, data, args.warmup, args.steps, device))
        for v in variants:
            runs[v].append(time_variant(data, args.warmup, args.steps, device, *VARIANTS[v]))
        print(f"# round {r + 1}/{args.repeats} ({time.time() - started:.0f} s): "
              + ", ".join(f"{k} {vals[-1]:.0f}" for k, vals in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    name = torch.cuda.get_device_name(device)
    print(f"# {name}, torch {torch.__version__}: {CASE[0]}, batch {batch}, images/s (median of {args.repeats} rounds)")
    for k, v in med.items():
        print(f"  {k:<10} {v:>8.0f}  {v / med['plain']:.3f}x plain")
    if args.out:
        from ddtrain.observe.files import write_json
        write_json(args.out, {"device": name, "torch": torch.__version__, "case": CASE[0], "batch": batch,
                              "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                              "images_per_s": med, "all_runs": runs,
                              "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
