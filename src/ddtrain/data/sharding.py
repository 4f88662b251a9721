"""Which samples each rank sees in an epoch. Pure index arithmetic, no communication.

``balanced`` (default): one permutation per epoch from a seed every rank shares; rank r
takes every R-th index starting at r, so the union of the ranks' step-s batches is exactly
the step-s batch of one process with an R-times larger batch (the equivalence tests rely
on this). The n mod R samples left over are dropped (different ones each epoch) or, with
``pad``, filled by repeating the start of the permutation. With ``global_batch`` G (the
run's ``--global-batch-size``) the order is a function of (seed, epoch, global step) only:
step s of an epoch trains ``perm[s*G:(s+1)*G]`` whatever the world size R and the gradient
accumulation K, rank r taking every R-th index of it (micro-batch k the k-th run of those),
and the n mod G samples after the last whole global batch are dropped (per global batch, not
per rank), so a run resumed on another number of ranks sees the same samples at every step.
Without G today's rule stands (drop n mod R; the last, shorter batch is trained).

``contiguous``: document 000 Tables 6.1/6.2 — ranks 0..R-2 get floor(n/R) consecutive
samples, the last rank the rest. Every rank still runs the same number of steps (that of
the largest shard); shorter shards wrap around to their own first samples ("pad").
"""
from __future__ import annotations

import math
import typing

import torch
from torch.utils.data import Sampler

from ddtrain.errors import DDTrainError

Sharding = typing.Literal["balanced", "contiguous"]   # the policies (--sharding's choices)
POLICIES = typing.get_args(Sharding)


def contiguous_sizes(n: int, world: int) -> list[int]:
    """Document 000's chunk sizes: floor(n/R) for ranks 0..R-2, the remainder for the last."""
    base = n // world
    return [base] * (world - 1) + [n - base * (world - 1)]


class ShardSampler(Sampler):
    """Indices of this rank's shard for the current epoch; call ``set_epoch`` every epoch."""

    def __init__(self, n: int, *, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                 policy: str = "balanced", remainder: str = "drop", global_batch: int = 0):
        if policy not in POLICIES:
            raise DDTrainError(f"unknown sharding policy {policy!r}; valid: {', '.join(POLICIES)}")
        if remainder not in ("drop", "pad"):
            raise DDTrainError(f"unknown remainder policy {remainder!r}; valid: drop, pad")
        if n < world_size:
            raise DDTrainError(f"{n} samples cannot be shared among {world_size} ranks")
        self.n, self.rank, self.world = n, rank, world_size
        self.shuffle, self.seed, self.policy, self.remainder = shuffle, seed, policy, remainder
        self.epoch, self.global_batch = 0, global_batch if policy == "balanced" else 0
        if self.global_batch:
            if global_batch % world_size:
                raise DDTrainError(f"a global batch of {global_batch} samples does not divide among {world_size} ranks")
            if n < global_batch:
                raise DDTrainError(f"a global batch of {global_batch} samples is more than the {n} training samples")
            batches = math.ceil(n / global_batch) if remainder == "pad" else n // global_batch
            self.per_rank = batches * global_batch // world_size
        elif policy == "balanced":
            self.per_rank = math.ceil(n / world_size) if remainder == "pad" else n // world_size
        else:
            self.per_rank = max(contiguous_sizes(n, world_size))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def indices(self) -> torch.Tensor:
        order = self._order()
        if self.policy == "balanced":
            total = self.per_rank * self.world  # whole global batches only when global_batch is set
            if total > self.n:
                order = torch.cat([order, order[: total - self.n]])
            return order[self.rank:total:self.world]
        sizes = contiguous_sizes(self.n, self.world)
        start = sum(sizes[: self.rank])
        mine = torch.arange(start, start + sizes[self.rank])
        if self.shuffle:  # shuffle within the chunk, the chunk itself stays the document's
            mine = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(self.seed + self.epoch))]
        if len(mine) < self.per_rank:
            mine = mine.repeat(math.ceil(self.per_rank / len(mine)))[: self.per_rank]
        return mine

    def step_positions(self, order: torch.Tensor, step: int, start: int, count: int) -> torch.Tensor:
        """Positions ``start .. start+count`` of step ``step``'s global batch in ``order`` (``order()``'s, per epoch).

        Unequal shares (``ddtrain.data.balance``): a rank's contiguous run of the same global batch
        ``indices`` deals out every R-th sample of, so the step trains the same samples either way.
        """
        if not self.global_batch:
            raise DDTrainError("unequal shares need a global batch (--global-batch-size)")
        first = step * self.global_batch + start
        return order[first:first + count]

    def order(self) -> torch.Tensor:
        """This epoch's order of the sample indices (a function of the seed and the epoch only)."""
        return self._order()

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.per_rank

    def describe(self) -> dict:
        """What the results record says about the policy."""
        if self.policy == "balanced":
            left = self.n - self.per_rank * self.world
            rule = f"dropped {left} samples per epoch" if left >= 0 else f"padded {-left} repeated samples per epoch"
            if self.global_batch:
                rule += f" (whole global batches of {self.global_batch}: the order does not depend on the world size)"
        else:
            rule = "shorter shards repeat their first samples to match the largest"
        return {"policy": self.policy, "samples_per_rank": self.per_rank, "remainder": rule}


REMAINDERS = ("pad", "drop", "uneven")   # what a prepared loader does with the n mod R positions left over


def check_remainder(remainder: str, *, training: bool) -> None:
    """Refuse a remainder policy that is unknown, or ``uneven`` for a training loader (unequal step counts hang)."""
    if remainder not in REMAINDERS:
        raise DDTrainError(f"unknown remainder policy {remainder!r}; valid: {', '.join(REMAINDERS)}")
    if training and remainder == "uneven":
        raise DDTrainError("remainder='uneven' is for evaluation loaders only: a training loader whose ranks take "
                           "different numbers of steps would leave some rank waiting in a collective; use 'pad' "
                           "(DistributedSampler's default) or 'drop'")


def share_size(n: int, rank: int, world_size: int, remainder: str = "pad") -> int:
    """How many of ``n`` positions rank ``rank`` takes under ``remainder`` (see ``rank_share``)."""
    if remainder == "pad":
        return math.ceil(n / world_size)
    if remainder == "drop":
        return n // world_size
    return len(range(rank, n, world_size))


def rank_share(order: list, rank: int, world_size: int, remainder: str = "pad") -> list:
    """Rank ``rank``'s positions r, r+R, ... of ``order``, DistributedSampler's rule over any order.

    ``pad`` (DistributedSampler's default): the order is extended by its own first positions to a
    multiple of R, so every rank takes ceil(n/R) and n mod R positions are seen twice; ``drop``
    (``DistributedSampler(drop_last=True)``): the last n mod R positions are left out; ``uneven``
    (evaluation only): every position exactly once, shards differing by at most one.
    """
    n = len(order)
    if remainder == "pad" and n % world_size:
        padding = math.ceil(n / world_size) * world_size - n
        order = list(order) + (list(order) * math.ceil(padding / n))[:padding]
    elif remainder == "drop":
        order = order[: n - n % world_size]
    return list(order[rank::world_size])
