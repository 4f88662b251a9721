"""``ddtrain data pack SRC OUT``: its flags and progress bar; the packing is ``ddtrain.data.packed.pack``."""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("source", metavar="SRC", help="an image folder (DIR/<class>/<image>, or imagefolder:DIR)")
    p.add_argument("out", metavar="OUT", help="the packed folder to write (new or empty; or an interrupted packing "
                   "of the same SRC with the same options, which resumes)")
    p.add_argument("--max-side", type=int, default=512,
                   help="scale images down so that their longer side is at most this (0: keep sizes)")
    p.add_argument("--encode", choices=("raw", "jpeg"), default="raw",
                   help="raw: uint8 pixels (no decode when training, H*W*3 bytes each); jpeg: JPEG files (smaller, "
                        "decoded by nvjpeg on the GPU; a source JPEG that needs no resize is kept as it is)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality of re-encoded images (--encode jpeg)")
    p.add_argument("--shard-mb", type=int, default=512, help="start a new shard after this many MiB")
    p.add_argument("--split", default="auto", help="auto (SRC/train if it exists, else SRC), train, val, or a sub-folder")
    p.add_argument("--workers", type=int, default=0, help="decoding processes (0: one per CPU)")


def main(args) -> int:
    import sys
    from ddtrain.data.packed import PackOptions, pack
    from ddtrain.training.progress import ProgressBar
    options = PackOptions(max_side=args.max_side, encoding=args.encode, quality=args.quality,
                          shard_bytes=args.shard_mb << 20)
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = ProgressBar(total, "Packing", unit="image")
            if done:
                print(f"ddtrain data pack: resuming after {done} of {total} images", file=sys.stderr, flush=True)
        bar.update(done)

    def report(problem) -> None:
        print(f"data pack: {problem.line()}", file=sys.stderr, flush=True)

    try:
        manifest = pack(args.source, args.out, options, split=args.split, workers=args.workers,
                        progress=progress, report=report)
    finally:
        if bar is not None:
            bar.close()
    size = sum(s["bytes"] for s in manifest["shards"])
    print(f"packed {manifest['samples']} images of {len(manifest['classes'])} classes into "
          f"{len(manifest['shards'])} shard(s), {size / 2**20:.1f} MiB ({manifest['encoding']}, longer side <= "
          f"{manifest['max_side'] or 'as is'}) in {args.out}; {len(manifest['skipped'])} file(s) skipped"
          + (" (listed in manifest.json)" if manifest["skipped"] else ""))
    print(f"train from it with: ddtrain train --data packed:{args.out} ...")
    return 0
