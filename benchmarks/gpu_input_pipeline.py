"""Issue 30 on the GPU: a plain torchvision loop against ``ddtrain train`` on JPEG files and on a packed set.

On the GPU machine (one H200, 16 cores), from the repository root, about 7-8 minutes:

    PYTHONPATH=src python3 benchmarks/gpu_input_pipeline.py --prepare /tmp/issue30 --out results/gpu_input/run1.json

and, in a second call, the tuned compile cold and warm (about 5 minutes):

    PYTHONPATH=src python3 benchmarks/gpu_input_pipeline.py --prepare /tmp/issue30 \
        --variants compile-tuned-cold,compile-tuned-warm --out results/gpu_input/compile.json

``--prepare DIR`` makes DIR/jpeg (benchmarks/make_jpeg_folder.py: 10,000 JPEGs of ~500x375 in
100 classes, ~85 kB each) and DIR/packed (``ddtrain data pack``, raw, longer side <= 512) when they
are not there yet, timing both. Then every variant runs in its own process (so one that fails
or hangs is reported and the others still run; each has ``--variant-timeout`` seconds), one
after the other, and the script prints images/s per variant and the ratios to the plain loop
of the same mode (eager or compiled), and writes everything to ``--out``:

  plain-eager / plain-compiled   ImageFolder + RandomResizedCrop/flip/ToTensor/Normalize +
                                 DataLoader(batch 256, --workers, shuffle, pin_memory=True,
                                 drop_last), ResNet-50 (ddtrain.models), bf16 autocast,
                                 channels-last, SGD momentum 0.9; compiled: torch.compile(model)
  ddtrain-folder-*               ddtrain train --data imagefolder:DIR (pipeline auto: nvjpeg
                                 and batched augmentation on the GPU)
  ddtrain-folder-cpu-eager       the same with --data-arg pipeline=cpu (Pillow in the loader processes)
  ddtrain-packed-*               ddtrain train --data packed:DIR (raw pixels, augmentation on the GPU)
  bench-folder, bench-packed     ddtrain bench data: the input pipeline alone, no model
  compile-tuned-cold/-warm       ddtrain train --compile --compile-options tuned-graphs on GPU-resident
                                 synthetic data: the first step from an empty inductor cache, then from
                                 the cache the first filled (not in the default run)

images/s: batch x timed steps / their wall time, after ``--warmup`` steps (the plain loop times
between two torch.cuda.synchronize calls; ddtrain's figure is its profile's steady
samples_per_s with --profile-warmup-steps = --warmup). The compiled ddtrain variants run first
and second with a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR under --prepare's DIR, emptied
at the start): the first step of the first is a cold compile, that of the second a warm one
(the same graph: ResNet-50 on 256x3x224x224 bf16 channels-last); both are recorded
(``first_step_s``), with the progress and profile lines of each run (``tail``).

    python3 benchmarks/gpu_input_pipeline.py --quick --out /tmp/q.json   # CPU smoke test (tests/bench)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# in the order they run: the compiled ddtrain variants first (cold, then warm inductor cache)
VARIANTS = ("ddtrain-folder-compiled", "ddtrain-folder-compiled-cpudec25", "ddtrain-folder-compiled-cpudec50",
            "ddtrain-packed-compiled", "ddtrain-packed256-compiled", "plain-compiled", "plain-eager",
            "ddtrain-folder-eager", "ddtrain-folder-cpu-eager", "ddtrain-packed-eager", "bench-folder", "bench-packed",
            "compile-tuned-cold", "compile-tuned-warm", "ddtrain-folder-graphs", "ddtrain-packed-graphs",
            "ddtrain-synthetic-compiled", "ddtrain-folder-compiled-omp1")
# not in the default run (they need ~5 minutes of their own): --compile-options tuned-graphs on GPU-resident
# synthetic data, twice, from an empty inductor cache and then from the cache the first one filled
OPTIONAL = ("compile-tuned-cold", "compile-tuned-warm", "ddtrain-folder-graphs", "ddtrain-packed-graphs",
            # the ceiling: the same ddtrain step on data generated on the GPU (no input pipeline at all)
            "ddtrain-synthetic-compiled",
            # the training process with one intra-op CPU thread (OMP_NUM_THREADS=1): does torch's OpenMP team,
            # woken by the CPU ops of the thread that makes the batches, take cores from the rest?
            "ddtrain-folder-compiled-omp1",
            # the loader processes decoding 25 % / 50 % of each batch (--data-arg cpu_decode), and a set packed
            # at a longer side of 256 (DIR/packed256, made when asked for)
            "ddtrain-folder-compiled-cpudec25", "ddtrain-folder-compiled-cpudec50", "ddtrain-packed256-compiled")


def settings(args) -> dict:
    if args.quick:   # the CPU smoke test: a tiny model on a tiny folder
        return {"model": "simple-cnn", "size": 32, "batch": 8, "steps": 4, "warmup": 2, "workers": 1,
                "amp": "off", "channels_last": False, "images": 48, "classes": 4}
    return {"model": "resnet50", "size": 224, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "workers": args.workers, "amp": "bf16", "channels_last": True, "images": args.images,
            "classes": args.classes}


def _base(variant: str) -> tuple[str, float | None]:
    """(the variant without its ``-cpudecNN`` or ``-omp1`` suffix, NN / 100 or None)."""
    variant = variant.removesuffix("-omp1")
    head, _, tail = variant.rpartition("-cpudec")
    return (head, int(tail) / 100) if head and tail.isdecimal() else (variant, None)


def ddtrain_command(variant: str, data: str, s: dict, out: Path) -> list[str]:
    """The ``ddtrain train`` (or ``bench data``) command line of a ddtrain variant."""
    variant, cpu_decode = _base(variant)
    if variant.startswith("bench-"):
        return [sys.executable, "-m", "ddtrain", "bench", "data", "--data", data, "--data-arg", f"size={s['size']}",
                "--batch-size", str(s["batch"]), "--loader-workers", str(s["workers"]), "--steps", str(s["steps"]),
                "--warmup", str(s["warmup"]), *(["--channels-last"] if s["channels_last"] else []), "--out", str(out)]
    if variant.startswith("compile-tuned"):
        data = "synthetic:imagenet" if s["size"] == 224 else "synthetic:cifar10"
        return [sys.executable, "-m", "ddtrain", "train", "--model", s["model"], "--data", data,
                "--batch-size", str(s["batch"]), "--steps", str(s["warmup"] + s["steps"]), "--val-fraction", "0",
                "--lr", "0.1", "--amp", s["amp"], "--compile", "--compile-options", "tuned-graphs", "--profile",
                "--out", str(out), *(["--channels-last"] if s["channels_last"] else [])]
    if data.startswith("synthetic:"):   # generated on the device, batch by batch: no size, no loader processes
        reads = ["--data-arg", f"samples={s['batch'] * (s['warmup'] + s['steps'] + 1)}", "--data-arg", "lazy=true"]
    else:
        reads = ["--data-arg", f"size={s['size']}", "--loader-workers", str(s["workers"])]
    argv = [sys.executable, "-m", "ddtrain", "train", "--model", s["model"], "--data", data,
            *reads, "--batch-size", str(s["batch"]),
            "--steps", str(s["warmup"] + s["steps"]), "--val-fraction", "0", "--lr", "0.1", "--amp", s["amp"],
            "--profile", "--profile-warmup-steps", str(s["warmup"]), "--out", str(out)]
    if s["channels_last"]:
        argv.append("--channels-last")
    if "-cpu-" in variant:
        argv += ["--data-arg", "pipeline=cpu"]
    if cpu_decode is not None:
        argv += ["--data-arg", f"cpu_decode={cpu_decode}"]
    if variant.endswith("-compiled"):
        argv.append("--compile")
    if variant.endswith("-graphs"):     # CUDA graphs: the step one launch (--compile-options graphs)
        argv += ["--compile", "--compile-options", "graphs"]
    return argv


def figures(variant: str, record: dict) -> dict:
    """images/s and what else the comparison needs, from a variant's JSON."""
    if variant.startswith("bench-"):
        row = record["rows"][0]
        return {"images_per_s": row["images_per_s"], "data_pipeline": row["data_pipeline"]}
    if variant.startswith("plain-"):
        return record
    profile = record["profile"]
    rank = profile["ranks"][0]
    return {"images_per_s": profile["samples_per_s"], "first_step_s": rank.get("first_step_s"),
            "step_time_s": profile["step_time_s"], "split_s": rank["split_s"], "steady": profile.get("steady"),
            "data_pipeline": record.get("data_pipeline"), "data_problems": record.get("data_problems"),
            "compile": record.get("compile")}


def run_variant(variant: str, paths: dict, s: dict, work: Path, timeout_s: float, env: dict, runner=subprocess.run) -> dict:
    """Run one variant in its own process; a failure or a timeout is recorded, never raised."""
    out = work / f"{variant}.json"
    out.unlink(missing_ok=True)
    if variant.startswith("plain-"):
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--folder", str(paths["folder"]),
                "--child-settings", json.dumps(s), "--out", str(out)]
    else:
        synthetic = "synthetic:imagenet" if s["size"] == 224 else "synthetic:cifar10"
        data = (synthetic if "synthetic" in variant else f"imagefolder:{paths['folder']}" if "folder" in variant else
                f"packed:{paths['packed256']}" if "packed256" in variant else f"packed:{paths['packed']}")
        argv = ddtrain_command(variant, data, s, out)
    start = time.perf_counter()
    try:
        proc = runner(argv, capture_output=True, text=True, timeout=timeout_s,
                      env={**env, "OMP_NUM_THREADS": "1"} if variant.endswith("-omp1") else env)
    except subprocess.TimeoutExpired as exc:
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s", "seconds": time.perf_counter() - start,
                "tail": _tail((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                              else exc.stdout or "")}
    took = time.perf_counter() - start
    text = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0 or not out.exists():
        lines = [line for line in text.splitlines() if line.strip()]
        return {"ok": False, "error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}",
                "seconds": took, "tail": _tail(text), "argv": argv}
    return {"ok": True, "seconds": took, "argv": argv, "tail": _tail(text), **figures(variant, json.loads(out.read_text()))}


def _tail(text: str, lines: int = 12) -> list[str]:
    return [line[:400] for line in text.splitlines()[-lines:]]


def ratios(results: dict) -> dict:
    """Each variant's images/s over the plain loop's of the same mode (eager or compiled; bench: to plain-eager)."""
    out = {}
    for name, r in results.items():
        if name.startswith("compile-"):      # compile times, on synthetic data: nothing to compare with
            continue
        compiled = _base(name)[0].endswith(("-compiled", "-graphs"))
        base = results.get("plain-compiled" if compiled else "plain-eager", {})
        if r.get("ok") and base.get("ok") and base.get("images_per_s"):
            out[name] = r["images_per_s"] / base["images_per_s"]
    return out


# ---------------------------------------------------------------------------- the plain loop (a child process)

def plain_loop(folder: str, s: dict, compiled: bool) -> dict:
    import torch
    import torch.nn.functional as F
    import torchvision
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    from ddtrain.models import build_model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dataset = torchvision.datasets.ImageFolder(folder, T.Compose([
        T.RandomResizedCrop(s["size"]), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]))
    loader = DataLoader(dataset, batch_size=s["batch"], shuffle=True, num_workers=s["workers"], pin_memory=True,
                        drop_last=True)
    torch.manual_seed(0)
    model = build_model(s["model"], num_classes=len(dataset.classes), in_channels=3,
                        input_size=(s["size"], s["size"])).to(device)
    layout = torch.channels_last if s["channels_last"] else torch.contiguous_format
    model = model.to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_model = torch.compile(model) if compiled else model
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=s["amp"] == "bf16")
    done, start, first_step_s, begin = 0, None, None, time.perf_counter()
    while done < s["warmup"] + s["steps"]:
        for x, y in loader:
            x = x.to(device, non_blocking=True).contiguous(memory_format=layout)
            y = y.to(device, non_blocking=True)
            with amp:
                loss = F.cross_entropy(step_model(x).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                first_step_s = time.perf_counter() - begin
            if done == s["warmup"]:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            if done == s["warmup"] + s["steps"]:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - start
    return {"images_per_s": s["steps"] * s["batch"] / took, "first_step_s": first_step_s, "timed_s": took,
            "torchvision": torchvision.__version__}


# ---------------------------------------------------------------------------- preparing the data

def prepare(root: Path, s: dict, workers: int, env: dict, packed256: bool = False) -> dict:
    """DIR/jpeg and DIR/packed (and DIR/packed256, longer side 256, if asked), made if missing (timed)."""
    folder, packed = root / "jpeg", root / "packed"
    info = {"folder": folder, "packed": packed, "packed256": root / "packed256"}
    if not folder.exists():
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / "make_jpeg_folder.py"), str(folder), "--images",
                               str(s["images"]), "--classes", str(s["classes"]), "--workers", str(workers)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"make_jpeg_folder failed: {proc.stderr[-2000:]}")
        info["made_folder"] = {"seconds": time.perf_counter() - start, **json.loads(proc.stdout.splitlines()[-1])}
        print(f"# made {folder}: {info['made_folder']}", flush=True)
    if not (packed / "manifest.json").exists():
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ddtrain", "data", "pack", str(folder), str(packed),
                               "--workers", str(workers)], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"ddtrain data pack failed: {proc.stderr[-2000:]}")
        info["packed_seconds"] = time.perf_counter() - start
        print(f"# packed {packed} in {info['packed_seconds']:.1f} s: {proc.stdout.splitlines()[0]}", flush=True)
    if packed256 and not (root / "packed256" / "manifest.json").exists():
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "ddtrain", "data", "pack", str(folder), str(root / "packed256"),
                               "--workers", str(workers), "--max-side", "256"], capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"ddtrain data pack --max-side 256 failed: {proc.stderr[-2000:]}")
        info["packed256_seconds"] = time.perf_counter() - start
        print(f"# packed {root / 'packed256'} in {info['packed256_seconds']:.1f} s: {proc.stdout.splitlines()[0]}",
              flush=True)
    return info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prepare", metavar="DIR", help="make (if missing) DIR/jpeg and DIR/packed and use them")
    p.add_argument("--folder", help="the JPEG class folder (instead of --prepare)")
    p.add_argument("--packed", help="its packed set (instead of --prepare)")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in OPTIONAL),
                   help=f"comma-separated, run in this order: {', '.join(VARIANTS)}")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", type=int, default=15, help="loader processes (the issue used 15 of 16 cores)")
    p.add_argument("--images", type=int, default=10000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--variant-timeout", type=float, default=180.0)
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all variants; the rest are skipped")
    p.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, tiny folder")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = plain_loop(args.folder, json.loads(args.child_settings), args.child.endswith("-compiled"))
        Path(args.out).write_text(json.dumps(result))
        return 0
    s = settings(args)
    root = Path(args.prepare or Path(args.out).with_suffix("")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent / "src"),
                                                                     os.environ.get("PYTHONPATH")]))}
    cache = root / "inductor_cache"
    shutil.rmtree(cache, ignore_errors=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)        # cold for the first compiled variant, warm after
    if args.quick and not args.folder:
        args.prepare = str(root)
    if args.prepare:
        paths = prepare(root, s, args.workers if not args.quick else 1, env,
                        packed256=any("packed256" in v for v in args.variants.split(",")))
    else:
        if not (args.folder and args.packed):
            p.error("give --prepare DIR, or --folder and --packed")
        paths = {"folder": Path(args.folder), "packed": Path(args.packed), "packed256": Path(args.packed)}
    work = root / "runs"
    work.mkdir(exist_ok=True)
    import torch
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "cpus": os.cpu_count(), "settings": s, "data": {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in paths.items()}, "variants": {}}
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    started = time.perf_counter()
    for variant in [v for v in VARIANTS if v in chosen]:
        spent = time.perf_counter() - started
        if spent > args.budget:
            info["variants"][variant] = {"ok": False, "error": f"skipped: the {args.budget:.0f} s budget was spent"}
            print(f"# {variant}: skipped (budget)", flush=True)
            continue
        print(f"# {variant}: running ({spent:.0f} s of the {args.budget:.0f} s budget used)", flush=True)
        result = run_variant(variant, paths, s, work, min(args.variant_timeout, max(30.0, args.budget - spent + 60)), env)
        info["variants"][variant] = result
        shown = f"{result['images_per_s']:.0f} images/s" if result.get("ok") else f"FAILED: {result['error']}"
        print(f"# {variant}: {shown} ({result.get('seconds', 0):.0f} s)", flush=True)
        _write(args.out, info)                         # after every variant: a killed run keeps what it has
    info["ratio_to_plain"] = ratios(info["variants"])
    _write(args.out, info)
    print(f"\n# {info['device']}, torch {info['torch']}, {info['cpus']} CPUs: {s['model']} batch {s['batch']}, "
          f"{s['workers']} loader workers, {s['warmup']} warm-up + {s['steps']} timed steps")
    print(f"# {'variant':<26} {'images/s':>9} {'ratio':>7} {'first step (s)':>15}")
    for name, r in info["variants"].items():
        rate = f"{r['images_per_s']:9.0f}" if r.get("ok") else f"{'failed':>9}"
        ratio = info["ratio_to_plain"].get(name)
        first = r.get("first_step_s")
        print(f"  {name:<26} {rate} {(f'{ratio:.3f}' if ratio else 'n/a'):>7} "
              f"{(f'{first:.1f}' if first else ''):>15}")
    print(f"# wrote {args.out}")
    return 0


def _write(path, info) -> None:
    tmp = Path(str(path) + ".partial")
    tmp.write_text(json.dumps(info, indent=1, default=str))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
