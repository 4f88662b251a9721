"""Is the step split right on a GPU? Two cases whose truth is known, through ``fit`` with ``--profile``.

    PYTHONPATH=src python experiments/gpu_split_check.py --out results/gpu1_issue20/split.json

  resident  ResNet-50, batch 256, bf16, channels-last, synthetic data already on the GPU: the GPU
            never waits for data, so the data wait must be near 0 (issue 20: < 2 % of the step);
  slowed    ResNet-18, batch 64, the same kind of data kept on the host behind a dataset whose
            every sample costs ``--sleep-ms`` of host time: the GPU idles for the batch, so the
            data wait must dominate (> 50 %).

Each prints the split as the GPU lived it (CUDA events, ``split_s``) next to the host's clock
readings (``host_split_s``) and the share of each part in the GPU step. One GPU: "every rank
alike" is the one rank here; a multi-GPU machine runs the same script under ``ddtrain run``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.observe import profiler
# gpu_single.py (the one-GPU benchmark these variants build on) lives in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from gpu_single import batches_that_fit, fresh_model, make_data


class SlowSamples(Dataset):
    """Host-resident samples, each taking ``sleep_s`` to produce (a deliberately slow loader)."""

    def __init__(self, inner: ArrayDataset, sleep_s: float):
        self.inner, self.sleep_s = inner, sleep_s

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return self.inner[i]


def run(name, model_name, shape, batch, dataset, data_on_device, steps, warmup, device) -> dict:
    model = fresh_model(model_name, shape, 1000, True, device)
    config = TrainConfig.from_flat(model=model_name, data="synthetic", strategy="ddp", epochs=0, steps=steps,
                                   batch_size=batch, lr=0.01, momentum=0.9, val_fraction=0.0, amp="bf16",
                                   channels_last=True, data_on_device=data_on_device, quiet=True, profile=True,
                                   warmup_steps=warmup)
    record = fit(model, Data("synthetic", dataset, None, 1000, shape, "classification"), config,
                 callbacks=profiler.callbacks(config.profile))
    out = {"case": name, "model": model_name, "batch": batch, "steps": steps, "warmup_steps": warmup, "ranks": []}
    for r in record["profile"]["ranks"]:
        gpu, host = r["split_s"], r.get("host_split_s") or {}
        total = sum(gpu.values())
        out["ranks"].append({"rank": r["rank"], "clock": r.get("split_clock", "host"), "gpu_split_s": gpu,
                             "host_split_s": host, "gpu_step_s": r.get("gpu_step_time_s"),
                             "host_step_s": r["step_time_s"],
                             "share": {k: v / total for k, v in gpu.items()} if total else None})
        share = out["ranks"][-1]["share"] or {}
        print(f"  {name:<9} rank {r['rank']}: GPU step {1e3 * (r.get('gpu_step_time_s') or 0):.1f} ms, "
              + ", ".join(f"{k[:-2]} {1e3 * v:.1f} ms ({share.get(k, 0):.1%})" for k, v in gpu.items())
              + " | host: " + ", ".join(f"{k[:-2]} {1e3 * v:.1f} ms" for k, v in host.items()), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--sleep-ms", type=float, default=1.0, help="host time per sample of the slowed loader")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ddtrain.init()
    device = ddtrain.device()
    if device.type != "cuda":
        print("gpu_split_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    shape = (3, 224, 224)
    resident = make_data(shape, 1000, 256 * batches_that_fit(shape, 256, args.steps + 1, device), device,
                         channels_last=True)
    cases = [run("resident", "resnet50", shape, 256, resident, "yes", args.steps, args.warmup, device)]
    del resident
    small = make_data(shape, 1000, 64 * (args.steps + 1), torch.device("cpu"))
    slowed = SlowSamples(ArrayDataset(small.x, small.y, num_classes=1000), args.sleep_ms / 1e3)
    cases.append(run("slowed", "resnet18", shape, 64, slowed, "no", args.steps, args.warmup, device))
    if args.out:
        from ddtrain.observe.files import write_json
        write_json(args.out, {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "sleep_ms_per_sample": args.sleep_ms, "cases": cases})
    return 0


if __name__ == "__main__":
    sys.exit(main())
