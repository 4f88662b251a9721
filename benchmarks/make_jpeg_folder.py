"""Make a folder of synthetic JPEGs in class folders, shaped like issue 30's data set.

    python benchmarks/make_jpeg_folder.py OUT_DIR --images 10000 --classes 100 --workers 16

Each image is ~500x375 (70 % landscape 4:3 with widths 450-550, 20 % portrait, 10 % square),
a smooth random colour field (a coarse random grid upsampled) with a class tint and Gaussian
noise, saved as a baseline JPEG of quality 90: compressible like a photograph, ~85 kB on
average at the default noise (``--noise``). Image i of the folder depends only on (--seed, i),
so two runs give the same files. Prints the count, the mean file size and the time taken.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): ~500x375 on average, as the issue's photographs."""
    shape = rng.random()
    if shape < 0.7:
        width = int(rng.integers(450, 551))
        return width, round(width * 3 / 4)
    if shape < 0.9:
        height = int(rng.integers(450, 551))
        return round(height * 3 / 4), height
    side = int(rng.integers(380, 461))
    return side, side


def make_image(index: int, label: int, classes: int, seed: int, noise: float) -> np.ndarray:
    rng = np.random.default_rng([seed, index])
    width, height = image_size(rng)
    coarse = rng.random((6, 8, 3)) * 255                        # the smooth field's control points
    field = np.asarray(Image.fromarray(coarse.astype(np.uint8)).resize((width, height), Image.BICUBIC), np.float32)
    hue = np.array([np.sin(2 * np.pi * (label / classes + k / 3)) for k in range(3)], np.float32)
    pixels = field * 0.7 + 40 * hue + 40 + rng.normal(0, noise, (height, width, 3)).astype(np.float32)
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_one(job) -> int:
    index, path, label, classes, seed, noise, quality = job
    Image.fromarray(make_image(index, label, classes, seed, noise)).save(path, format="JPEG", quality=quality)
    return os.path.getsize(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to create (OUT/<class>/<image>.jpg)")
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--noise", type=float, default=16.0, help="std of the Gaussian noise, in grey levels")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        print(f"make_jpeg_folder: {out} is not empty; give a new folder", file=sys.stderr)
        return 2
    jobs = []
    for i in range(args.images):
        label = i % args.classes
        folder = out / f"class_{label:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        jobs.append((i, str(folder / f"img_{i:06d}.jpg"), label, args.classes, args.seed, args.noise, args.quality))
    start = time.perf_counter()
    with ProcessPoolExecutor(args.workers) as pool:
        sizes = list(pool.map(write_one, jobs, chunksize=16))
    took = time.perf_counter() - start
    summary = {"images": len(sizes), "classes": args.classes, "mean_bytes": float(np.mean(sizes)),
               "total_bytes": int(np.sum(sizes)), "seconds": round(took, 1), "noise": args.noise,
               "quality": args.quality, "seed": args.seed}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
