"""ddtrain's training loop against a hand-written PyTorch loop on one GPU, in one run.

    PYTHONPATH=src python benchmarks/gpu_single.py --out results/gpu_single.json      # on the GPU machine
    PYTHONPATH=src python benchmarks/gpu_single.py --quick                            # smoke test, CPU

For each case (model, input, batch, precision, channels-last, compile) it times
  plain   a minimal loop: a fixed pool of batches resident on the GPU, autocast, SGD+momentum;
  ddtrain ``ddtrain.fit`` (the loop ``ddtrain train`` runs) with strategy ddp and strategy ring at
          world size 1, the same model definition (ddtrain.models) and the same data resident on
          the GPU (``--data-on-device``), timed between two synchronised steps after warm-up;
and prints images/s, the ratio ddtrain/plain, and model FLOPs utilisation: counted forward FLOPs
x 3 (forward + backward) x images/s over a bf16 8192^3 matrix-product rate measured in this run.
Cases are interleaved (plain, ddp, ring, then again) and the median of ``--repeats`` is taken.
Each case holds ``warmup + steps`` distinct batches on the GPU (fewer only where they would take
more than a quarter of its free memory), so a ddtrain run is one epoch: an epoch end (metrics,
replica check) every few steps would be a cost of this benchmark, not of training.

The data-path cases run ResNet-18 three ways: GPU-resident; from host memory (a thread gathers
into pinned memory, copies run one batch ahead on a side stream); and through a DataLoader with
worker processes. Each reports images/s and its data wait: the GPU time between CUDA events
around every batch hand-over, as a share of the timed window (``gpu_probe.DataWait``).
``--profile CASE`` adds a torch.profiler kernel breakdown of ddtrain's ddp run of that case.
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import ddtrain
from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from ddtrain.models.flops import count_flops

from gpu_probe import DataWait, KernelProfile, print_profile

CASES = [  # name, model, (C, H, W), classes, batch, amp, channels_last, compile
    ("resnet50 fp32", "resnet50", (3, 224, 224), 1000, 256, "off", False, False),
    ("resnet50 bf16 cl", "resnet50", (3, 224, 224), 1000, 256, "bf16", True, False),
    ("resnet50 bf16 cl compile", "resnet50", (3, 224, 224), 1000, 256, "bf16", True, True),
    ("resnet18 bf16 cl", "resnet18", (3, 224, 224), 1000, 256, "bf16", True, False),
    ("unet 97ch 192 bf16", "unet", (97, 192, 192), None, 32, "bf16", True, False),
]


def matmul_tflops(device, n=8192, reps=10) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_data(shape, classes, samples, device, seed=0, channels_last=False):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(samples, *shape, device=device, generator=g)
    if channels_last:  # made in the layout the case trains in, so no copy is ever needed
        x = x.contiguous(memory_format=torch.channels_last)
    if classes:
        y = torch.randint(0, classes, (samples,), device=device, generator=g)
        return ArrayDataset(x, y, num_classes=classes)
    return ArrayDataset(x, torch.randn(samples, 1, *shape[1:], device=device, generator=g), num_classes=None)


def fresh_model(name, shape, classes, channels_last, device):
    torch.manual_seed(0)
    model = build_model(name, num_classes=classes or 1, in_channels=shape[0], input_size=shape[1:]).to(device)
    return model.to(memory_format=torch.channels_last) if channels_last else model


def time_plain(case, data, warmup, steps, device) -> float:
    _, name, shape, classes, batch, amp, cl, compiled = case
    model = fresh_model(name, shape, classes, cl, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_model = torch.compile(model) if compiled else model
    loss_fn = F.cross_entropy if classes else F.mse_loss
    pool = len(data) // batch
    xs = [data.x[i * batch:(i + 1) * batch] for i in range(pool)]
    ys = [data.y[i * batch:(i + 1) * batch] for i in range(pool)]
    if cl:
        xs = [x.contiguous(memory_format=torch.channels_last) for x in xs]
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if amp == "bf16" else None
    for i in range(warmup + steps):
        if i == warmup:
            sync(device)
            start = time.perf_counter()
        x, y = xs[i % pool], ys[i % pool]
        if ctx:
            with ctx():
                out = step_model(x)
                loss = loss_fn(out.float(), y)
        else:
            out = step_model(x)
            loss = loss_fn(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync(device)
    return steps * batch / (time.perf_counter() - start)


class StepTimer(ddtrain.Callback):
    """Synchronises twice: at the end of warm-up and at the end of the run."""

    def __init__(self, warmup, device):
        self.warmup, self.device, self.start, self.steps = warmup, device, None, 0

    def on_step_begin(self, step, state):
        if step == self.warmup:
            sync(self.device)
            self.start = time.perf_counter()

    def on_step_end(self, step, logs, state):
        self.steps = step

    def on_train_end(self, record, state):
        sync(self.device)
        self.elapsed = time.perf_counter() - self.start


def time_ddtrain(case, data, warmup, steps, device, strategy, *, data_on_device="yes", loader_workers=0,
                 extra_callbacks=(), timer_out=None) -> float:
    _, name, shape, classes, batch, amp, cl, compiled = case
    model = fresh_model(name, shape, classes, cl, device)
    config = TrainConfig.from_flat(model=name, data="synthetic", strategy=strategy, epochs=0, steps=warmup + steps,
                         batch_size=batch, lr=0.01, momentum=0.9, val_fraction=0.0, amp=amp, channels_last=cl,
                         compile=compiled, data_on_device=data_on_device, loader_workers=loader_workers, quiet=True)
    timer = StepTimer(warmup, device)
    fit(model, Data("synthetic", data, None, classes, shape, "classification" if classes else "regression"),
        config, callbacks=[timer, *extra_callbacks])
    if timer_out is not None:
        timer_out.append(timer.elapsed)
    return steps * batch / timer.elapsed


def batches_that_fit(shape, batch, wanted, device) -> int:
    """``wanted`` batches, or as many as take a quarter of the GPU's free memory (at least 4)."""
    if device.type != "cuda":
        return wanted
    per_batch = batch * math.prod(shape) * 4
    return max(4, min(wanted, int(0.25 * torch.cuda.mem_get_info(device)[0] // per_batch)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cases", default="all", help="comma-separated case names or 'all'")
    p.add_argument("--quick", action="store_true", help="tiny inputs and few steps (a smoke test on the CPU)")
    p.add_argument("--strategies", default="ddp,ring", help="ddtrain strategies to time (world size 1)")
    p.add_argument("--loader-workers", type=int, default=6, help="DataLoader processes of the loader data path")
    p.add_argument("--profile", default=None, metavar="CASE", help="kernel profile of ddtrain's ddp run of CASE")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ddtrain.init()
    device = ddtrain.device()
    cases = [c for c in CASES if args.cases == "all" or c[0] in args.cases.split(",")]
    if args.quick:
        cases = [(n, m, (s[0], 32, 32), k, 4, "bf16" if a != "off" else "off", cl, False)
                 for n, m, s, k, b, a, cl, comp in cases if not comp]
        args.warmup, args.steps, args.repeats = 1, 2, 1
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    ceiling = matmul_tflops(device, n=8192 if device.type == "cuda" else 512, reps=10 if device.type == "cuda" else 2)
    print(f"# device: {name}; torch {torch.__version__}; bf16 matmul ceiling {ceiling:.0f} TFLOP/s", flush=True)
    rows = []
    for case in cases:
        label, mname, shape, classes, batch = case[:5]
        data = make_data(shape, classes, batch * batches_that_fit(shape, batch, args.warmup + args.steps + 1, device),
                         device, channels_last=case[6])
        flops = 3 * count_flops(build_model(mname, num_classes=classes or 1, in_channels=shape[0],
                                            input_size=shape[1:]), shape)
        strategies = args.strategies.split(",")
        runs = {"plain": [], **{s: [] for s in strategies}}
        for _ in range(args.repeats):
            runs["plain"].append(time_plain(case, data, args.warmup, args.steps, device))
            for strategy in strategies:
                runs[strategy].append(time_ddtrain(case, data, args.warmup, args.steps, device, strategy))
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
        med = {k: statistics.median(v) for k, v in runs.items()}
        row = {"case": label, "batch": batch, "images_per_s": med, "all_runs": runs,
               "ratio": {s: med[s] / med["plain"] for s in strategies},
               "mfu": {k: flops * v / (ceiling * 1e12) for k, v in med.items()}, "train_flops_per_sample": flops}
        rows.append(row)
        print("  " + _row(label, row, strategies), flush=True)
        if args.profile == label and device.type == "cuda":
            prof = KernelProfile(args.warmup, min(10, args.steps - 1))
            time_ddtrain(case, data, args.warmup, args.steps, device, "ddp", extra_callbacks=[prof])
            row["profile"] = prof.summary()
            print_profile(label, row["profile"])
        del data
    data_rows = data_paths(cases, args, device)
    strategies = args.strategies.split(",")
    print()
    print(f"# {name}: images/s (median of {args.repeats}), ratio to the plain loop in the same run")
    print("# " + f"{'case':<26} {'plain':>8} {'MFU':>6}" + "".join(f" {s:>8} {'ratio':>6} {'MFU':>6}" for s in strategies))
    for r in rows:
        print("  " + _row(r["case"], r, strategies))
    for r in data_rows:
        print(f"  data path {r['path']:<44} {r['images_per_s']:>8.0f} images/s  {r['ratio_to_device']:.3f} of "
              f"GPU-resident  data wait {r['data_wait_share']:.2%} of step time" if r.get("images_per_s") else
              f"  data path {r['path']:<44} failed: {r.get('error')}")
    if args.out:
        from ddtrain.observe.files import write_json
        write_json(args.out, {"device": name, "torch": torch.__version__, "matmul_tflops": ceiling,
                              "warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
                              "cases": rows, "data_paths": data_rows})
    return 0


def _row(label, row, strategies) -> str:
    m, mfu = row["images_per_s"], row["mfu"]
    return (f"{label:<26} {m['plain']:>8.0f} {mfu['plain']:>6.1%}"
            + "".join(f" {m[s]:>8.0f} {row['ratio'][s]:>6.3f} {mfu[s]:>6.1%}" for s in strategies))


def data_paths(cases, args, device) -> list[dict]:
    """ResNet-18 fed three ways, each with its images/s and its data wait (CUDA events, gpu_probe)."""
    case = next((c for c in cases if c[1] == "resnet18"), None)
    if case is None or device.type != "cuda":
        return []
    _, _, shape, classes, batch = case[:5]
    on_gpu = make_data(shape, classes, batch * batches_that_fit(shape, batch, args.warmup + args.steps + 1, device),
                       device, channels_last=case[6])
    on_host = ArrayDataset(on_gpu.x.cpu(), on_gpu.y.cpu(), num_classes=classes)
    paths = [("GPU-resident (--data-on-device yes)", on_gpu, "yes", 0, args.steps),
             ("host memory, pinned, copied ahead", on_host, "no", 0, args.steps),
             (f"DataLoader, {args.loader_workers} worker processes", on_host, "no", args.loader_workers,
              min(args.steps, 15))]
    out, rate_device = [], None
    for label, data, on_device, workers, steps in paths:
        rates, shares = [], []
        try:
            for _ in range(args.repeats):
                elapsed = []
                with DataWait() as probe:
                    rates.append(time_ddtrain(case, data, args.warmup, steps, device, "ddp", data_on_device=on_device,
                                              loader_workers=workers, timer_out=elapsed))
                # the timed window holds the fetches of steps warmup+1 .. warmup+steps (the last ends the run)
                shares.append(probe.seconds(args.warmup + 1, steps) / elapsed[0])
        except Exception as exc:  # one path failing (e.g. shared memory for loader processes) is reported
            out.append({"path": label, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        rate = statistics.median(rates)
        rate_device = rate_device or rate
        out.append({"path": label, "images_per_s": rate, "ratio_to_device": rate / rate_device,
                    "data_wait_share": statistics.median(shares), "all_runs": rates, "all_shares": shares,
                    "steps": steps, "loader_workers": workers})
        print(f"  data path {label}: {rate:.0f} images/s, data wait {statistics.median(shares):.2%}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
