"""Exact global metrics from a training script: ``all_reduce_metric`` and ``gather_for_metrics``.

Both act among the ranks that train (the workers' group of the last ``prepare``; every rank
when nothing was prepared) and return at once in a single process. Evaluation loaders give
every sample to exactly one rank (``prepared_loader``), so a sum of per-rank sums and counts,
or the gathered per-sample values, is the metric of one process over the whole dataset.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


class Placement:
    """Who trains: the process group of the workers (None: every rank) and their number."""

    group = None
    workers: int | None = None      # None: nothing prepared yet (every rank trains)
    worker_rank: int = 0


def _group_and_size():
    if not dist.is_initialized():
        return None, 1
    return Placement.group, dist.get_world_size(Placement.group)


def all_reduce_metric(value, op: str = "sum"):
    """``value`` (a number or tensor) reduced over the training ranks with ``op``: sum, mean, max or min.

    Returns the kind it was given: a Python number for a number, a tensor (on the value's device)
    for a tensor. Sums are taken in float64 (int64 for integers), so they do not depend on R.
    """
    if op not in OPS:
        raise DDTrainError(f"all_reduce_metric(op={op!r}): valid ops are {', '.join(OPS)}")
    group, size = _group_and_size()
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    exact = tensor.to(torch.int64 if not tensor.is_floating_point() and op != "mean" else torch.float64)
    if size > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        exact = exact.to(device)
        dist.all_reduce(exact, op=OPS[op], group=group)
    if op == "mean":
        exact = exact / size
    return exact.to(value.device) if isinstance(value, torch.Tensor) else exact.item()


def gather_for_metrics(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (per-sample rows from an evaluation loader), concatenated in the dataset's order.

    Ranks may hold different numbers of rows. When the counts are those of a prepared evaluation
    loader (rank r holds positions r, r+R, ...), the rows are interleaved back into the order of
    the loader's sampler; otherwise they are concatenated in rank order.
    """
    group, size = _group_and_size()
    if size == 1:
        return tensor
    backend_device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    local = tensor.detach().to(backend_device)
    counts = torch.tensor([local.shape[0]], device=backend_device)
    all_counts = [torch.zeros_like(counts) for _ in range(size)]
    dist.all_gather(all_counts, counts, group=group)
    counts_list = [int(c.item()) for c in all_counts]
    longest = max(counts_list)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=backend_device)
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    pieces = [piece[:count] for piece, count in zip(pieces, counts_list)]
    total = sum(counts_list)
    if counts_list == [len(range(r, total, size)) for r in range(size)]:
        out = torch.empty((total, *local.shape[1:]), dtype=local.dtype, device=backend_device)
        for r, piece in enumerate(pieces):
            out[r::size] = piece
    else:
        out = torch.cat(pieces)
    return out.to(tensor.device)
