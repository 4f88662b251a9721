"""The overhead of ``ddtrain train --strategy ddp`` over a hand-written DDP loop (benchmarks/plain_ddp.py).

    python benchmarks/ddp_overhead.py --nproc 2 --steps 45 --warmup-steps 5 --repeats 7 --json overhead.json

Same model, data, ranks, batch size, learning rate and thread count on both sides. Each repeat
runs ddtrain, the plain loop with a DataLoader and the plain loop slicing tensors, in an order
that rotates every repeat, so drift in the machine's load hits all three alike. Both sides
measure the same steps the same way: after ``--warmup-steps``, the wall time from the end of
one step to the end of the next (ddtrain: ``--profile``; plain: the same clock readings),
giving per run the **median step** (robust to other processes' bursts: the figure compared),
the **fastest step** (the cost with the least interference; over repeats the fastest of all),
the mean step, and the **CPU seconds per step** summed over ranks (the work done, which other
processes' load changes much less than wall time). ratio = median over repeats (ddtrain) /
median over repeats (plain); > 1 means ddtrain is slower. ddtrain's side includes the profiler's own cost (one
hook per parameter, three clock readings per step). docs/PERFORMANCE.md records a run.
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
FIGURES = ("step_median_s", "step_min_s", "step_mean_s", "cpu_per_step_s")
# over repeats: the median of each run's figure, except the fastest step: the fastest over all runs


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _figures(ranks: list[dict]) -> dict:
    return {"step_median_s": max(r["step_time_median_s"] for r in ranks),
            "step_min_s": max(r["step_time_min_s"] for r in ranks),
            "step_mean_s": max(r["step_time_s"] for r in ranks),
            "cpu_per_step_s": sum(r["cpu_per_step_s"] for r in ranks)}


def run_ddtrain(args, tmp: Path) -> dict:
    out = tmp / "ddtrain.json"
    cmd = [sys.executable, "-m", "ddtrain", "train", "--nproc", str(args.nproc), "--model", args.model,
           "--data", args.data, "--strategy", "ddp", "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--lr", str(args.lr), "--val-fraction", "0", "--quiet", "--out", str(out), "--profile",
           "--warmup-steps", str(args.warmup_steps)]
    for item in args.data_arg:
        cmd += ["--data-arg", item]
    subprocess.run(cmd, check=True, env=_env(args), timeout=args.timeout)
    record = json.loads(out.read_text())
    assert sum(e["steps"] for e in record["epochs"]) == args.steps, record["epochs"]
    return _figures(record["profile"]["ranks"])


def run_plain(args, tmp: Path, loader: str) -> dict:
    out = tmp / f"plain-{loader}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
           "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(HERE / "plain_ddp.py"), "--model", args.model, "--data", args.data, "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup_steps), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
           "--loader", loader, "--out", str(out)]
    for item in args.data_arg:
        cmd += ["--data-arg", item]
    subprocess.run(cmd, check=True, env=_env(args), timeout=args.timeout, stdout=subprocess.DEVNULL)
    return _figures(json.loads(out.read_text())["ranks"])


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
    p.add_argument("--steps", type=int, default=45, help="steps per run, warm-up included")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None, help="write every figure and the ratios here")
    args = p.parse_args()
    args.data_arg = args.data_arg if args.data_arg is not None else ["samples=8192"]
    sides = {"ddtrain": lambda tmp: run_ddtrain(args, tmp),
             "plain-dataloader": lambda tmp: run_plain(args, tmp, "dataloader"),
             "plain-tensor": lambda tmp: run_plain(args, tmp, "tensor")}
    names, runs = list(sides), {name: [] for name in sides}
    load = os.getloadavg()[0]
    print(f"# ddp overhead: {args.model} on {args.data} {args.data_arg}, {args.nproc} ranks, batch {args.batch_size}, "
          f"{args.warmup_steps} warm-up + {args.steps - args.warmup_steps} timed steps, {args.repeats} interleaved "
          f"repeats, OMP_NUM_THREADS={_env(args)['OMP_NUM_THREADS']}, load average {load:.1f} at the start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in names[rep % 3:] + names[:rep % 3]:
                runs[name].append(sides[name](Path(tmp)))
            print(f"# repeat {rep + 1}: " + "; ".join(
                f"{n} median step {1e3 * runs[n][-1]['step_median_s']:.1f} ms, cpu {1e3 * runs[n][-1]['cpu_per_step_s']:.1f} ms"
                for n in names), flush=True)
    med = {n: {f: (min if f == "step_min_s" else statistics.median)(r[f] for r in runs[n]) for f in FIGURES}
           for n in names}
    result = {"config": vars(args), "loadavg_1min": [load, os.getloadavg()[0]], "runs": runs, "median": med,
              "ratios": {ref: {f: med["ddtrain"][f] / med[ref][f] for f in FIGURES}
                         for ref in ("plain-dataloader", "plain-tensor")}}
    print("#            reference  median step  fastest step  mean step  cpu/step   (ddtrain / reference)")
    for ref, ratios in result["ratios"].items():
        print(f"  {ref:>19}  {ratios['step_median_s']:11.3f}  {ratios['step_min_s']:12.3f}  {ratios['step_mean_s']:9.3f}"
              f"  {ratios['cpu_per_step_s']:8.3f}")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
