"""Global metrics from a training script: ``all_reduce_metric`` and ``gather_for_metrics``.

Both act among the ranks that train (the workers' group of the last ``prepare``; every rank
when nothing was prepared) and return at once in a single process. An evaluation loader
prepared with ``remainder="pad"`` (the default, DistributedSampler's) gives the first n mod R
samples twice, as a plain-DDP script's loader does: sums of per-rank sums count them twice
(the twin's numbers), while ``gather_for_metrics`` leaves the repeats out, so the gathered
per-sample values are those of one process over the whole dataset (accelerate's rule). With
``remainder="uneven"`` every sample is on exactly one rank and both are exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.sync.ps.guard import before_collective

OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


@dataclass
class EvalPass:
    """Where this rank is in a pass over a padded evaluation loader: what ``gather_for_metrics`` needs to unpad."""

    positions: int           # the loader's samples in the epoch, before padding
    world_size: int
    per_rank: int            # rows each rank takes in the pass
    rows_before: int = 0     # this rank's rows given before the current batch
    batch_rows: int = 0      # rows of the current batch
    running: bool = True


class Placement:
    """Who trains: the process group of the workers (None: every rank) and their number."""

    group = None
    workers: int | None = None      # None: nothing prepared yet (every rank trains)
    worker_rank: int = 0
    eval_pass: EvalPass | None = None   # the padded evaluation pass running, or the last one


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
    if size > 1:
        before_collective("ddtrain.all_reduce_metric")
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value)
    exact = tensor.to(torch.int64 if not tensor.is_floating_point() and op != "mean" else torch.float64)
    if size > 1:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        exact = exact.to(device)
        dist.all_reduce(exact, op=OPS[op], group=group)
    if op == "mean":
        exact = exact / size
    return exact.to(value.device) if isinstance(value, torch.Tensor) else exact.item()


def gather_for_metrics(data):
    """Every rank's per-sample rows (from an evaluation loader), concatenated in the dataset's order.

    ``data``: a tensor, or a tuple, list or dict of them (predictions and labels gathered in one
    call, as accelerate's). Ranks may hold different numbers of rows. When the counts are those
    of a prepared evaluation loader (rank r holds positions r, r+R, ...), the rows are
    interleaved back into the order of the loader's sampler, and the samples its padding
    repeated are left out: called once per batch or once over the whole pass, the rows of a
    pass add up to the dataset's, each sample once. Otherwise rows are concatenated in rank order.
    """
    if isinstance(data, (list, tuple)):
        return type(data)(gather_for_metrics(item) for item in data)
    if isinstance(data, dict):
        return {key: gather_for_metrics(value) for key, value in data.items()}
    if not isinstance(data, torch.Tensor):
        raise DDTrainError(f"gather_for_metrics(): expected a tensor (or a tuple, list or dict of them), "
                           f"got {type(data).__name__}")
    group, size = _group_and_size()
    if size == 1:
        return data
    before_collective("ddtrain.gather_for_metrics")
    tensor = data if data.dim() else data.reshape(1)
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
        out = out[:_unpadded_rows(counts_list, size)]
    else:
        out = torch.cat(pieces)
    return out.to(tensor.device)


def _unpadded_rows(counts: list[int], size: int) -> int:
    """How many of the interleaved rows to keep: all but those a padded evaluation pass repeated.

    The rows of batch k of every rank, interleaved, are positions R*rows_before ... of the
    padded order, whose last ``R*per_rank - positions`` positions are the repeats.
    """
    record, total = Placement.eval_pass, sum(counts)
    if record is None or record.world_size != size or len(set(counts)) != 1:
        return total
    if record.running and counts[0] == record.batch_rows:
        start = size * record.rows_before            # this batch's first position in the padded order
    elif counts[0] == record.per_rank:
        start = 0                                    # the whole pass at once
    else:
        return total
    return max(0, min(total, record.positions - start))
