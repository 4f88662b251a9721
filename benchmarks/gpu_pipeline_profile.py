"""Where a batch of the GPU image path spends its time: each stage of ``BatchPipeline.make`` timed, then cProfile.

    python benchmarks/gpu_pipeline_profile.py --folder /tmp/jpeg --out profile.txt

Batches are read first (``read_batch``, as a loader process would), so what is timed is the
training process's share: sniffing, nvjpeg, the crop plan and the batched augmentation. Each
stage is bracketed by ``torch.cuda.synchronize()`` (so its GPU work counts where it is queued);
then whole ``make`` calls run under cProfile without the synchronisations.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--folder", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--kernels", action="store_true",
                   help="also the GPU kernels of nvjpeg and the augmentation (torch.profiler), by CUDA time")
    args = p.parse_args()
    import torch

    from ddtrain.data import augment
    from ddtrain.data.decode import split_for_gpu
    from ddtrain.data.imagefolder import load_imagefolder
    from ddtrain.data.pipeline import read_batch
    device = torch.device("cuda")
    ds = load_imagefolder(args.folder, size=224, augment=True, pipeline="gpu")
    pipe = ds.batch_pipeline(device, 15)
    b = args.batch
    idx = [list(range(i * b, (i + 1) * b)) for i in range(args.batches)]
    t = time.perf_counter()
    reads = [read_batch(ds, i) for i in idx]
    lines = [f"# read_batch in this process: {1e3 * (time.perf_counter() - t) / len(reads):.1f} ms/batch"]
    pool = ThreadPoolExecutor(4)
    for i, r in zip(idx[:2], reads[:2]):
        pipe.make(i, pool, r)
    torch.cuda.synchronize()
    stages: dict[str, float] = {}

    def mark(name, start):
        torch.cuda.synchronize()
        stages[name] = stages.get(name, 0.0) + time.perf_counter() - start
        return time.perf_counter()

    timed = list(zip(idx[2:], reads[2:]))
    for i, r in timed:
        t = time.perf_counter()
        items = r.items(ds)
        t = mark("items", t)
        on_gpu, _ = split_for_gpu(items)
        t = mark("sniff", t)
        images = pipe._decode_gpu([items[k] for k in on_gpu], [i[k] for k in on_gpu])
        t = mark("nvjpeg", t)
        heights = torch.tensor([x.shape[1] for x in images])
        widths = torch.tensor([x.shape[2] for x in images])
        plan = augment.plan(heights, widths, ds.size, True, pipe.generator)
        t = mark("plan", t)
        augment.apply(images, plan, ds.size)
        t = mark("augment", t)
    n = len(timed)
    lines += [f"# {name}: {1e3 * s / n:.1f} ms/batch" for name, s in stages.items()]
    lines.append(f"# sum of stages: {1e3 * sum(stages.values()) / n:.1f} ms/batch ({n} batches of {b})")
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for i, r in timed:
        pipe.make(i, pool, r)
    torch.cuda.synchronize()
    prof.disable()
    lines.append(f"# make(), unsynchronised, under cProfile: {1e3 * (time.perf_counter() - t) / n:.1f} ms/batch")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    lines.append(text.getvalue())
    if args.kernels:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kernels:
            for i, r in timed:
                pipe.make(i, pool, r)
            torch.cuda.synchronize()
        lines.append(f"# GPU kernels of make() over {n} batches (torch.profiler), by CUDA time")
        lines.append(kernels.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    out = "\n".join(lines)
    print(out)
    with open(args.out, "w") as f:
        f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
