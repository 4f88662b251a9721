"""What an H200 can do with a folder of JPEGs: the parts of an input pipeline timed one by one, then together.

    python benchmarks/gpu_input_probe.py --dir /tmp/jpegs --make 10000 --out probe.json

Measures, in one run on one GPU (issue 30's design questions): the rate of reading the files;
nvjpeg batched decode alone (``torchvision.io.decode_jpeg(..., device="cuda")``), with the CPU
time it takes from the calling thread and whether the hardware JPEG engines are busy
(``nvidia-smi dmon -s u``, column ``jpg``); one batched crop-resize (``roi_align``); ResNet-50 bf16
channels-last compute alone (eager and compiled); decode in a thread overlapped with compiled
compute; and CPU decoding rates (libjpeg-turbo through torchvision, Pillow, Pillow's draft mode).
Every rate is images per second; the JSON holds each figure under its name.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import Pool
from pathlib import Path


def _make_one(args):
    path, seed = args
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    h, w = 375, 500
    yy, xx = np.mgrid[0:h, 0:w]
    img = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        fx, fy, ph = rng.uniform(0.005, 0.05, 2).tolist() + [rng.uniform(0, 6.28)]
        img[..., c] = 128 + 90 * np.sin(fx * xx + fy * yy + ph)
    for _ in range(12):  # a few shapes for edges
        x0, y0 = rng.integers(0, w - 60), rng.integers(0, h - 60)
        img[y0:y0 + rng.integers(20, 120), x0:x0 + rng.integers(20, 160)] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 14, img.shape)
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(path, quality=90)


def make_folder(root: Path, n: int, classes: int = 100) -> None:
    jobs = []
    for i in range(n):
        d = root / f"class{i % classes:03d}"
        d.mkdir(parents=True, exist_ok=True)
        jobs.append((str(d / f"img{i:06d}.jpg"), i))
    with Pool(os.cpu_count()) as pool:
        pool.map(_make_one, jobs, chunksize=64)


def timed(fn, reps):
    import torch
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(reps):
        fn(i)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/jpegs")
    p.add_argument("--make", type=int, default=10000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--out", required=True)
    p.add_argument("--skip-compile", action="store_true")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F
    import torchvision
    from torchvision.io import decode_jpeg
    from torchvision.ops import roi_align
    out = {"torch": torch.__version__, "torchvision": torchvision.__version__, "cpus": os.cpu_count(),
           "gpu": torch.cuda.get_device_name()}
    root = Path(args.dir)

    def save():
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(out), flush=True)

    t = time.perf_counter()
    if not root.exists():
        make_folder(root, args.make)
    out["make_s"] = time.perf_counter() - t
    files = sorted(str(f) for f in root.rglob("*.jpg"))
    t = time.perf_counter()
    with ThreadPoolExecutor(16) as ex:
        blobs = list(ex.map(lambda f: Path(f).read_bytes(), files))
    out["read_images_per_s_warm_16_threads"] = len(files) / (time.perf_counter() - t)
    out["mean_kb"] = sum(map(len, blobs)) / len(blobs) / 1e3
    datas = [torch.frombuffer(b, dtype=torch.uint8) for b in blobs]
    B = args.batch
    batches = [datas[i:i + B] for i in range(0, len(datas) - B + 1, B)]
    print(f"# {len(files)} files, mean {out['mean_kb']:.1f} kB", flush=True)

    # ---- nvjpeg alone, with the CPU time the calling thread spends and the jpg engine use
    decode_jpeg(batches[0], device="cuda")
    dmon = subprocess.Popen(["nvidia-smi", "dmon", "-s", "u", "-d", "1"], stdout=subprocess.PIPE, text=True)
    cpu0 = time.process_time()
    secs = timed(lambda i: decode_jpeg(batches[i % len(batches)], device="cuda"), 30)
    out["nvjpeg_images_per_s"] = 30 * B / secs
    out["nvjpeg_cpu_s_per_batch"] = (time.process_time() - cpu0) / 30
    time.sleep(1.5)
    dmon.terminate()
    out["dmon"] = dmon.communicate()[0].splitlines()[-6:]
    save()

    # ---- decode in 2 and 4 threads at once (does the op release the GIL? does it scale?)
    for threads in (2, 4):
        def work(k):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                for i in range(8):
                    decode_jpeg(batches[(k * 8 + i) % len(batches)], device="cuda")
            s.synchronize()
        t = time.perf_counter()
        ths = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        [th.start() for th in ths]
        [th.join() for th in ths]
        out[f"nvjpeg_{threads}_threads_images_per_s"] = threads * 8 * B / (time.perf_counter() - t)
    save()

    # ---- one batched crop-resize + flip + normalise
    imgs = decode_jpeg(batches[0], device="cuda")
    stack = torch.stack(imgs).float()
    g = torch.Generator().manual_seed(0)
    boxes = torch.zeros(B, 5)
    boxes[:, 0] = torch.arange(B)
    boxes[:, 1:3] = torch.rand(B, 2, generator=g) * 200
    boxes[:, 3:5] = boxes[:, 1:3] + 150
    boxes = boxes.cuda()
    mean = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255

    def augment(batch_imgs):
        x = torch.stack(batch_imgs).float()
        y = roi_align(x, boxes, output_size=224, aligned=True)
        flip = torch.rand(B, device="cuda") < 0.5
        y = torch.where(flip.view(B, 1, 1, 1), y.flip(3), y)
        return ((y - mean) / std).to(memory_format=torch.channels_last, dtype=torch.bfloat16)

    augment(imgs)
    secs = timed(lambda i: augment(imgs), 30)
    out["roi_align_augment_images_per_s"] = 30 * B / secs
    secs = timed(lambda i: augment(decode_jpeg(batches[i % len(batches)], device="cuda")), 30)
    out["nvjpeg_plus_augment_images_per_s"] = 30 * B / secs
    del stack
    save()

    # ---- compute alone: ResNet-50 bf16 channels-last, eager then compiled
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = augment(imgs)
    y = torch.randint(0, 1000, (B,), device="cuda")

    def step(fwd, xb):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(fwd(xb).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step(model, x)
    secs = timed(lambda i: step(model, x), 20)
    out["compute_eager_images_per_s"] = 20 * B / secs
    save()
    fwd = model
    if not args.skip_compile:
        fwd = torch.compile(model)
        t = time.perf_counter()
        step(fwd, x)
        torch.cuda.synchronize()
        out["compile_first_step_s"] = time.perf_counter() - t
        for _ in range(3):
            step(fwd, x)
        secs = timed(lambda i: step(fwd, x), 30)
        out["compute_compiled_images_per_s"] = 30 * B / secs
        save()

    # ---- decode + augment in one thread on a side stream, compute in the main thread
    for depth in (2, 4):
        q: queue.Queue = queue.Queue(maxsize=depth)
        n_steps = 30
        side = torch.cuda.Stream()

        def producer():
            with torch.cuda.stream(side):
                for i in range(n_steps + 3):
                    xb = augment(decode_jpeg(batches[i % len(batches)], device="cuda"))
                    ev = torch.cuda.Event()
                    ev.record(side)
                    q.put((xb, ev))
        th = threading.Thread(target=producer, daemon=True)
        th.start()
        for _ in range(3):
            xb, ev = q.get()
            torch.cuda.current_stream().wait_event(ev)
            step(fwd, xb)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n_steps):
            xb, ev = q.get()
            torch.cuda.current_stream().wait_event(ev)
            xb.record_stream(torch.cuda.current_stream())
            step(fwd, xb)
        torch.cuda.synchronize()
        out[f"overlap_thread_depth{depth}_images_per_s"] = n_steps * B / (time.perf_counter() - t)
        th.join()
        save()

    # ---- CPU decoding rates (one core each; then all cores)
    from PIL import Image
    import io
    torch.set_num_threads(1)
    t = time.perf_counter()
    for d in datas[:300]:
        torchvision.io.decode_jpeg(d)
    out["cpu_turbo_one_core_images_per_s"] = 300 / (time.perf_counter() - t)
    t = time.perf_counter()
    for b in blobs[:300]:
        Image.open(io.BytesIO(b)).convert("RGB").load()
    out["cpu_pillow_one_core_images_per_s"] = 300 / (time.perf_counter() - t)
    t = time.perf_counter()
    for b in blobs[:300]:
        im = Image.open(io.BytesIO(b))
        im.draft("RGB", (250, 188))
        im.convert("RGB").load()
    out["cpu_pillow_draft_half_one_core_images_per_s"] = 300 / (time.perf_counter() - t)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
