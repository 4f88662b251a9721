"""The overhead of ``ddtrain train --strategy ddp`` over a hand-written DDP loop (benchmarks/plain_ddp.py).

    python benchmarks/ddp_overhead.py --nproc 2 --steps 40 --repeats 5 --json overhead.json

Same model, data, ranks, batch size, learning rate and thread count on both sides; each
repeat runs ddtrain, the plain loop with DataLoader and the plain loop slicing tensors, in an
order that rotates every repeat (so drift in the machine's load hits all three alike). Both
sides time the same span: the training loop of ``--steps`` steps (ddtrain's epoch ``time_s``,
the plain loop's ``loop_s``), not the start-up. Printed: every time, the median of each, and
ratio = median(ddtrain) / median(plain) (> 1: ddtrain is slower), plus the median of the
per-repeat ratios. docs/PERFORMANCE.md ("Overhead against plain DDP") records a run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddtrain(args, tmp: Path) -> float:
    out = tmp / "ddtrain.json"
    cmd = [sys.executable, "-m", "ddtrain", "train", "--nproc", str(args.nproc), "--model", args.model,
           "--data", args.data, "--strategy", "ddp", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--val-fraction", "0", "--quiet", "--out", str(out)]
    for item in args.data_arg:
        cmd += ["--data-arg", item]
    subprocess.run(cmd, check=True, env=_env(args), timeout=args.timeout)
    record = json.loads(out.read_text())
    assert sum(e["steps"] for e in record["epochs"]) == args.steps, record["epochs"]
    return sum(e["time_s"] for e in record["epochs"])


def run_plain(args, tmp: Path, loader: str) -> float:
    out = tmp / f"plain-{loader}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
           "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(HERE / "plain_ddp.py"), "--model", args.model, "--data", args.data, "--steps", str(args.steps),
           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--loader", loader, "--out", str(out)]
    for item in args.data_arg:
        cmd += ["--data-arg", item]
    subprocess.run(cmd, check=True, env=_env(args), timeout=args.timeout, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["loop_s"]


def _env(args) -> dict:
    # the thread count ddtrain's launcher would pick, given to both sides explicitly
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="simple-cnn")
    p.add_argument("--data", default="synthetic:mnist")
    p.add_argument("--data-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="data option (default: samples=8192, so start-up stays short)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write every time and the ratios here")
    args = p.parse_args()
    args.data_arg = args.data_arg if args.data_arg is not None else ["samples=8192"]
    sides = {"ddtrain": lambda tmp: run_ddtrain(args, tmp),
             "plain-dataloader": lambda tmp: run_plain(args, tmp, "dataloader"),
             "plain-tensor": lambda tmp: run_plain(args, tmp, "tensor")}
    names, times = list(sides), {name: [] for name in sides}
    print(f"# ddp overhead: {args.model} on {args.data} {args.data_arg}, {args.nproc} ranks, batch {args.batch_size}, "
          f"{args.steps} steps, {args.repeats} interleaved repeats, OMP_NUM_THREADS={_env(args)['OMP_NUM_THREADS']}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = names[rep % 3:] + names[:rep % 3]
            for name in order:
                times[name].append(sides[name](Path(tmp)))
            print(f"# repeat {rep + 1}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in names), flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    result = {"config": vars(args), "times_s": times, "median_s": med, "ratios": {}}
    for ref in ("plain-dataloader", "plain-tensor"):
        per_repeat = [a / b for a, b in zip(times["ddtrain"], times[ref])]
        result["ratios"][ref] = {"ratio_of_medians": med["ddtrain"] / med[ref],
                                 "median_of_ratios": statistics.median(per_repeat), "per_repeat": per_repeat}
        print(f"ddtrain / {ref}: ratio of medians {med['ddtrain'] / med[ref]:.3f}, median of per-repeat ratios "
              f"{statistics.median(per_repeat):.3f} (medians {med['ddtrain']:.3f} s vs {med[ref]:.3f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
