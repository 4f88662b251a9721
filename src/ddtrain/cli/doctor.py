"""``ddtrain doctor``: compare Python, torch, CUDA, NCCL, driver, GPU, interface and data across the ranks, probe every link.

    ddtrain doctor --nproc 2                                   # this machine
    ddtrain cluster run --nodes 2 --link 200mbit -- ddtrain doctor --data digits
    srun -N 2 ddtrain doctor                                   # under any launcher: one rank per task

Exits 1 when a field that must agree (Python, torch, CUDA, NCCL, data) differs, after printing
the table and one line per difference naming the node and the field.
"""
from __future__ import annotations

import argparse
import hashlib
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="local ranks to start (ignored under a launcher)")
    p.add_argument("--data", default=None, help="a dataset whose fingerprint every rank computes and compares")
    p.add_argument("--no-probe", action="store_true", help="skip the link probe (round trip and bandwidth)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank's facts")


def data_fingerprint(name: str | None) -> str:
    """sha256 (12 hex digits) of the dataset's sample count and its first 64 training samples."""
    if not name:
        return "-"
    import torch
    from ddtrain.data import load_dataset
    data = load_dataset(name, val_fraction=0.0)
    digest = hashlib.sha256(str(len(data.train)).encode())
    for i in range(min(64, len(data.train))):
        x, y = data.train[i]
        digest.update(torch.as_tensor(x).float().numpy().tobytes())
        digest.update(str(int(y)).encode())
    return digest.hexdigest()[:12]


def main(args) -> int:
    from ddtrain.distributed import launch
    from ddtrain.distributed.env import check_nproc
    if not launch.inside_launcher():
        argv = ["doctor", *(["--data", args.data] if args.data else []), *(["--no-probe"] if args.no_probe else []),
                "--timeout", str(args.timeout)]
        return launch.run_local(args.nproc, argv)
    check_nproc(args.nproc)
    return _as_rank(args)


def _as_rank(args) -> int:
    import datetime
    import os

    import torch.distributed as dist

    from ddtrain.distributed import doctor
    from ddtrain.distributed.env import detect_env
    env = detect_env()
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    # torch's own env:// rendezvous: the agent's store under torchrun, a new one hosted by rank 0 elsewhere
    store, rank, world = next(dist.rendezvous("env://", env.rank, env.world_size,
                                              timeout=datetime.timedelta(seconds=args.timeout)))
    facts = doctor.exchange(store, rank, world, doctor.local_facts(env.master_addr, data_fingerprint(args.data)),
                            args.timeout)
    links = None
    if not args.no_probe and world > 1:
        dist.init_process_group("gloo", store=dist.PrefixStore("doctor-pg", store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        links = doctor.probe_links(rank, world)
        dist.destroy_process_group()
    if rank != 0:
        return 0
    print(doctor.table(facts, links), flush=True)
    found = doctor.differences(facts)
    for line in found:
        print(f"# {line}", flush=True)
    bad = [line for line in found if line.split(" ", 1)[0] in doctor.MUST_AGREE]
    if bad:
        print(f"ddtrain: error: the ranks disagree: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""),
              file=sys.stderr, flush=True)
        return 1
    print(f"# {world} rank(s) agree on {', '.join(doctor.MUST_AGREE)}", flush=True)
    return 0
