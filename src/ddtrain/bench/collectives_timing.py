"""Timing one (size, algorithm) cell of ``ddtrain bench collectives``: the test pattern and its
exact reference, and the warmed-up, adaptively many timed calls checked against it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .collectives import BenchConfig


def pattern(rank, count, dtype, ranks, op, device):
    """This rank's input and the exact expected result, built on ``device``.

    Rank r holds ((i + 3r) mod 9) − 4 at index i: small integers, so every sum, average and
    extremum is exact in every dtype and any order of reduction gives the same bits. The
    reference combines all ranks' patterns in one process, in integers, before the cast.
    """
    index = torch.arange(count, dtype=torch.int32 if count < 2**31 - 64 else torch.int64, device=device)

    def of(r):
        return (index + 3 * r) % 9 - 4

    mine = of(rank).to(dtype)
    acc = of(0)
    for r in range(1, ranks):
        other = of(r)
        acc = acc + other if op in ("sum", "avg") else (torch.maximum(acc, other) if op == "max"
                                                        else torch.minimum(acc, other))
    del index
    expected = acc.to(dtype)
    if op == "avg":
        expected = expected / ranks
    return mine, expected


@dataclass
class Timing:
    """One (size, algorithm) cell: what ``time_calls`` measured."""

    seconds: float        # median over timed calls of the slowest rank's time
    iters: int            # timed calls
    wrong: int            # elements differing from the reference, summed over ranks
    cpu_cores: float      # median over calls of (CPU seconds of all ranks) / (call time)
    samples_s: list       # every timed call's time (slowest rank), in order


def time_calls(call, inputs, expected, config: BenchConfig, group, device) -> Timing:
    """Warm up, time adaptively many calls, check the last result against ``expected``."""
    work = torch.empty_like(inputs)

    def once() -> tuple[float, float]:
        work.copy_(inputs)
        _sync(device)
        if dist.is_initialized():
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()   # process time: all threads, user + system
        call(work)
        _sync(device)
        return time.perf_counter() - t0, time.process_time() - c0

    first = once()
    probe = _reduce([first[0]], group, device, "max")[0]   # the first call: untimed unless --warmup 0
    timed = [] if config.warmup else [first]
    for _ in range(min(config.warmup - 1, int(config.budget_s / 4 / max(probe, 1e-9)))):
        once()
    iters = int(max(config.min_iters, min(config.iters, config.budget_s / max(probe, 1e-9))))
    timed += [once() for _ in range(iters - len(timed))]
    walls = _reduce([w for w, _ in timed], group, device, "max")   # per call, the slowest rank
    cpus = _reduce([c for _, c in timed], group, device, "sum")    # per call, all ranks together
    wrong = _reduce([float((work != expected).sum())], group, device, "sum")[0]
    return Timing(seconds=statistics.median(walls), iters=iters, wrong=int(wrong),
                  cpu_cores=statistics.median(c / w for c, w in zip(cpus, walls) if w > 0), samples_s=walls)


def _reduce(values, group, device, op: str) -> list[float]:
    """Element-wise max or sum over the group's ranks (identity in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device(group, device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t.tolist()


def _collective_device(group, device):
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
