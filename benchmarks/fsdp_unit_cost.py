"""What one FSDP2 unit costs a step, apart from its size: 81 one-layer units against one and against no FSDP.

    PYTHONPATH=src python benchmarks/fsdp_unit_cost.py --out results/sharding/fsdp_unit_cost_cpu.json

A Sequential of 80 Linear(4, 4) and a Linear(4, 1) (161 parameters, ResNet-50's count, all tiny:
the arithmetic is nothing, the overhead is all), one Gloo rank, SGD+momentum with for-each
kernels: a forward, backward, step and zero_grad per step, ``--steps`` timed after 5 warm-up,
the three arms interleaved ``--repeats`` times, medians. ``per_unit_ms`` = (per-layer - root only)
/ 80: what each extra unit adds to a step on this machine; ``optimizer_ms`` the step alone.
The cost is the CPU's (hooks, copies, collectives' launches): on a GPU the same hooks run on the
host while the device waits when they outlast its work (sync/fsdp.py MAX_UNIT_PARAMS).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(80)], torch.nn.Linear(4, 1, bias=False))


def timed(m, steps: int) -> tuple[float, float]:
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, foreach=True)
    x = torch.randn(2, 4)

    def step():
        m(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    for _ in range(5):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    whole = (time.perf_counter() - start) / steps
    m(x).sum().backward()
    start = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return whole * 1e3, (time.perf_counter() - start) / steps * 1e3


def arm(name: str, steps: int) -> tuple[float, float]:
    from ddtrain.sync.fsdp import _fsdp
    fully_shard = _fsdp()[0]
    m = model()
    if name == "per-layer":
        for layer in m:
            fully_shard(layer)
    if name != "plain":
        fully_shard(m)
    return timed(m, steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    runs = {name: [] for name in ("plain", "root-only", "per-layer")}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(arm(name, args.steps))
    dist.destroy_process_group()
    med = {name: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for name, rs in runs.items()}
    per_unit = (med["per-layer"][0] - med["root-only"][0]) / 80
    for name, (whole, opt) in med.items():
        print(f"  {name:<10} step {whole:7.2f} ms   optimizer {opt:6.2f} ms")
    print(f"  per extra unit: {per_unit:.3f} ms a step (median of {args.repeats} interleaved runs)")
    out = {"torch": torch.__version__, "cpus": os.cpu_count(), "steps": args.steps, "repeats": args.repeats,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": os.uname().nodename,
           "median_ms": {k: {"step": v[0], "optimizer": v[1]} for k, v in med.items()}, "per_unit_ms": per_unit,
           "runs_ms": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
