"""``ddtrain bench data``: its flags; the timing itself is ``ddtrain.bench.data``."""
from __future__ import annotations

from ddtrain.bench.data import DataBenchConfig, run, table
from ddtrain.config import parse_kv


def add_arguments(p) -> None:
    p.add_argument("--data", action="append", required=True, metavar="SPEC",
                   help="data spec, as for ddtrain train (imagefolder:DIR, packed:DIR, ...); give it again to compare "
                        "several in one run (interleaved, ratios to the first)")
    p.add_argument("--data-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="data option for every spec, e.g. size=224 or pipeline=cpu")
    p.add_argument("--batch-size", type=int, default=256, help="images per batch")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="DataLoader processes (the CPU path), or read threads (the GPU path; 0: up to 16)")
    p.add_argument("--device", default="auto", help="where batches go: auto (CUDA if there is one), cpu, cuda[:N]")
    p.add_argument("--steps", type=int, default=50, help="timed batches per round")
    p.add_argument("--warmup", type=int, default=5, help="batches first, not timed (loader start, caches)")
    p.add_argument("--repeats", type=int, default=1, help="rounds (specs interleaved); each figure is their median")
    p.add_argument("--channels-last", action="store_true", help="NHWC batches, as --channels-last training gets")
    p.add_argument("--uint8", action="store_true",
                   help="stop the CPU path at the uint8 batch it hands to a GPU (the float conversion runs there): "
                        "what the CPU does for a GPU run, measured on a machine without one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="FILE.json", default=None, help="write the result (images_per_s, settings, runs)")


def main(args) -> int:
    from ddtrain.errors import DDTrainError
    if args.out and not args.out.endswith(".json"):
        raise DDTrainError(f"--out {args.out!r} should name a .json file")
    config = DataBenchConfig(data=args.data, data_args=parse_kv(args.data_arg, "--data-arg"),
                             batch_size=args.batch_size, loader_workers=args.loader_workers, device=args.device,
                             steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                             channels_last=args.channels_last, uint8=args.uint8, seed=args.seed)
    if args.out:
        from ddtrain.observe.files import check_writable
        check_writable(args.out, "--out")
    result = run(config, progress=lambda line: print(line, flush=True))
    print("\n".join(table(result)))
    if args.out:
        from ddtrain.observe.files import write_json
        write_json(args.out, result)
        print(f"# wrote {args.out}")
    return 0
