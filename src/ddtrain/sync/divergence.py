"""Replica divergence: the largest parameter difference between any rank and rank 0.

Document 000 claims its periodic broadcast keeps replicas identical; local SGD lets them
drift apart between averagings. This module measures that, for every strategy, with a
comparison that is cheap when the replicas agree (the usual case for synchronous methods):

1. every rank hashes its parameters' bits into two int64 numbers (a plain and a
   position-weighted sum of the bit patterns) and one all-reduce of ``[h, -h]`` with MAX
   tells every rank whether all hashes are equal: 32 bytes per rank. Equal hashes mean
   bitwise-identical replicas (up to a hash collision), so the divergence is exactly 0.
2. only when they differ, rank 0 broadcasts its parameters (one flat buffer per dtype), every
   rank computes ``max |p - p0|`` and an all-reduce of that scalar with MAX gives the answer.

These collectives are torch.distributed's own and are not counted as the strategy's traffic
(they are measurement); ``stats.extra`` says how many checks ran and how many needed step 2.
The record is ``stats.extra["divergence"]``: one ``{"step", "epoch", "divergence",
"after_sync"}`` per check, where ``after_sync`` says the check ran right after the strategy
synchronised the parameters (a broadcast or an averaging), and ``divergence_max``.
``spread_terms``/``relative_spread`` are local SGD's cheap spread of the replicas around their
mean, measured at every averaging (``ddtrain.sync.local_sgd``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.reliability.replicas import checksums


def fingerprint(tensors) -> torch.Tensor:
    """Two int64 hashes of the bits of ``tensors`` (wrap-around sums), on their device.

    Built from the replica check's per-tensor checksums (one hash in the code base): the plain
    sums added, the weighted ones weighted again by the tensor's position.
    """
    if not tensors:
        return torch.zeros(2, dtype=torch.int64)
    rows = checksums(tensors)
    order = torch.arange(1, len(rows) + 1, device=rows.device, dtype=torch.int64)
    return torch.stack([rows[:, 0].sum(), (rows[:, 1] * order).sum()])


def _by_dtype(tensors) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1))
    return {dtype: torch.cat(ts) for dtype, ts in groups.items()}


def replica_divergence(tensors, group=None) -> tuple[float, bool]:
    """(max |x - x_rank0| over all ranks of ``group`` and elements, whether step 2 ran). Collective."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not tensors:
        return 0.0, False
    h = fingerprint(tensors)
    both = torch.cat([h, -h])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(both[:2], -both[2:]):
        return 0.0, False
    root = dist.get_global_rank(group, 0) if group is not None else 0
    worst = torch.zeros((), dtype=torch.float64, device=h.device)
    for flat in _by_dtype(tensors).values():
        ref = flat.clone()
        dist.broadcast(ref, src=root, group=group)
        worst = torch.maximum(worst, (flat.double() - ref.double()).abs().max())
    worst = worst.reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return float(worst.item()), True


def spread_terms(replica, mean) -> torch.Tensor:
    """``[||x - m||^2, ||m||^2]`` summed over the matching tensors ``replica`` and ``mean`` (float64, on their device).

    This rank's share of ``relative_spread``: summed over the ranks (one all-reduce of a few
    numbers, which local SGD's averaging does anyway) it costs nothing like step 2 above, because
    each rank already holds both its own replica and the mean right after an averaging.
    """
    if not replica:
        return torch.zeros(2, dtype=torch.float64)
    terms = [torch.stack([(x.double() - m.double()).pow(2).sum(), m.double().pow(2).sum()])
             for x, m in zip(replica, mean)]
    return torch.stack(terms).sum(0)


def relative_spread(summed_terms, ranks: int) -> float:
    """``sqrt(mean over ranks of ||x_r - m||^2) / ||m||`` from ``spread_terms`` summed over ``ranks`` ranks.

    Scale-free (a fraction of the parameters' norm), so one bound fits every model; the largest
    difference from rank 0 that ``replica_divergence`` measures is at most twice the largest
    ``|x_r - m|``.
    """
    spread_sq, norm_sq = (float(v) / ranks for v in summed_terms[:2])
    return (spread_sq ** 0.5) / (norm_sq ** 0.5) if norm_sq > 0 else 0.0


class DivergenceMonitor:
    """Checks every ``check_every`` steps (0: never per step) and at every epoch end; see the module doc."""

    def __init__(self, module, stats, group=None, check_every: int = 0):
        self.module, self.stats, self.group, self.check_every = module, stats, group, check_every
        self.steps = 0                     # steps completed on this rank
        self.last_checked = None
        stats.extra.setdefault("divergence", [])
        stats.extra.setdefault("divergence_max", 0.0)
        stats.extra.setdefault("divergence_checks", 0)
        stats.extra.setdefault("divergence_full_compares", 0)

    def check_due(self) -> bool:
        """Will the next ``after_step`` run a check (a collective over the group)?"""
        return bool(self.check_every) and (self.steps + 1) % self.check_every == 0

    def after_step(self, after_sync: bool = False) -> None:
        self.steps += 1
        if self.check_every and self.steps % self.check_every == 0:
            self.check(after_sync=after_sync)

    def end_epoch(self, epoch: int, after_sync: bool = False) -> None:
        if self.last_checked == self.steps and not after_sync:
            self.stats.extra["divergence"][-1]["epoch"] = epoch   # already measured at this step
            return
        self.check(epoch=epoch, after_sync=after_sync)

    def check(self, *, epoch: int | None = None, after_sync: bool = False) -> float:
        params = list(self.module.parameters())
        value, full = replica_divergence(params, self.group)
        extra = self.stats.extra
        extra["divergence"].append({"step": self.steps, "epoch": epoch, "divergence": value,
                                    "after_sync": after_sync})
        extra["divergence_max"] = max(extra["divergence_max"], value)
        extra["divergence_checks"] += 1
        extra["divergence_full_compares"] += int(full)
        self.last_checked = self.steps
        return value
