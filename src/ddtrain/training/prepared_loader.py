"""The loader ``prepare`` returns: a ``DataLoader`` over this rank's share, batches already on the device.

Built from the user's loader with everything it was given (sampler or ``shuffle``, ``drop_last``,
``collate_fn``, ``pin_memory``, ``num_workers``, worker options), so ``.dataset``, ``.sampler``,
``.batch_size`` and ``len()`` mean what they mean in PyTorch; only which samples this rank sees
changes, and every batch structure (tensors in tuples, lists, dicts, dataclasses) reaches the device.

Sharding rules (docs/PORTING.md):
- map-style datasets: ``RankSampler`` draws the user's sampler's order for the epoch with a
  random seed every rank shares (``seed + epoch``; a sampler with its own generator uses that;
  ``shuffle=True`` gives DistributedSampler's permutation for that seed), and rank r takes positions r, r+R, r+2R,
  ... of it (DistributedSampler's rule, over any sampler). The ``n mod R`` positions left over
  are, as ``remainder`` says (``ddtrain.data.sharding.rank_share``): ``pad`` (the default, as
  DistributedSampler: the order is extended by its first positions, so every rank takes the
  same number of samples and batches, training and evaluation alike), ``drop``
  (``DistributedSampler(drop_last=True)``) or, for evaluation loaders, ``uneven`` (every
  sample once, shards differing by one). With ``pad`` or ``drop`` the union of the ranks'
  step-s batches is the step-s batch of one process with an R-times larger batch.
  ``ddtrain.gather_for_metrics`` leaves out the samples an evaluation loader's padding repeated.
- iterable datasets: every rank reads the stream, cut into groups of R consecutive elements;
  rank r keeps element r of each group (with loader workers, worker w of W keeps the groups
  g with g mod W = w). A last incomplete group is padded with the stream's first elements
  (``pad``), dropped (``drop``) or shared as it is (``uneven``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              get_worker_info)

from ddtrain.data.sharding import check_remainder, rank_share, share_size
from ddtrain.errors import DDTrainError
from ddtrain.training.metrics import EvalPass, Placement


def _is_plain_shuffle(sampler) -> bool:
    """Is ``sampler`` what ``DataLoader(shuffle=True)`` makes: one permutation from torch's global generator?"""
    return (type(sampler) is RandomSampler and sampler.generator is None and not sampler.replacement
            and sampler.num_samples == len(sampler.data_source))


class RankSampler(Sampler):
    """This rank's positions r, r+R, ... of ``sampler``'s order, drawn with a seed every rank shares.

    ``set_epoch(e)`` picks the epoch (the seed is ``seed + e``) of the next iteration; without it
    each iteration takes the next epoch, so the order changes every epoch either way.
    ``remainder``: what happens to the ``n mod R`` positions left over (``rank_share``).
    """

    def __init__(self, sampler, *, rank: int, world_size: int, seed: int = 0, remainder: str = "pad"):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.seed, self.remainder = seed, remainder
        self.epoch, self._next_epoch = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self._next_epoch = epoch

    def order(self) -> list:
        """The user's sampler's order for the current epoch (the same on every rank)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        if _is_plain_shuffle(self.sampler):
            # shuffle=True: DistributedSampler(shuffle=True, seed=seed)'s own permutation, so a ported
            # script sees exactly the samples of its plain-DDP twin, step for step
            n = len(self.sampler.data_source)
            return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        # RandomSampler, WeightedRandomSampler, SubsetRandomSampler... draw from torch's global
        # generator when given none, and the ranks' global generators differ (per-rank seeds)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            return list(self.sampler)

    def __iter__(self):
        self.epoch = self._next_epoch
        self._next_epoch = self.epoch + 1
        return iter(rank_share(self.order(), self.rank, self.world_size, self.remainder))

    def __len__(self) -> int:
        return share_size(len(self.sampler), self.rank, self.world_size, self.remainder)


class IterableShard(IterableDataset):
    """Element r of every group of R consecutive elements of ``dataset`` (see the module doc)."""

    def __init__(self, dataset, *, rank: int, world_size: int, remainder: str = "pad"):
        self.dataset, self.rank, self.world_size, self.remainder = dataset, rank, world_size, remainder

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        group, first, index = [], [], 0
        for element in self.dataset:
            group.append(element)
            if len(first) < self.world_size:
                first.append(element)      # the stream's start, which pads a last incomplete group
            if len(group) == self.world_size:
                if index % workers == worker:
                    yield group[self.rank]
                group, index = [], index + 1
        if not group or index % workers != worker or self.remainder == "drop":
            return
        if self.remainder == "pad":
            group = group + (first * self.world_size)[: self.world_size - len(group)]
        if self.rank < len(group):
            yield group[self.rank]

    def __len__(self) -> int:
        n = len(self.dataset)  # TypeError without one, as for any IterableDataset
        return share_size(n, self.rank, self.world_size, self.remainder)


def move_to_device(batch, device: torch.device, non_blocking: bool = False):
    """``batch`` with every tensor on ``device``: through tuples, named tuples, lists, mappings, dataclasses."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):          # named tuple
        return type(batch)(*(move_to_device(item, device, non_blocking) for item in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(item, device, non_blocking) for item in batch)
    if isinstance(batch, Mapping):
        moved = {key: move_to_device(value, device, non_blocking) for key, value in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: move_to_device(getattr(batch, f.name), device, non_blocking)
                                              for f in dataclasses.fields(batch) if f.init})
    return batch


def _loader_options(loader: DataLoader) -> dict:
    """What the user gave ``loader`` besides dataset, sampler and batching (torch-version tolerant)."""
    options = {"num_workers": loader.num_workers, "collate_fn": loader.collate_fn, "pin_memory": loader.pin_memory,
               "timeout": loader.timeout, "worker_init_fn": loader.worker_init_fn,
               "multiprocessing_context": loader.multiprocessing_context, "generator": loader.generator,
               "persistent_workers": loader.persistent_workers}
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    for name in ("pin_memory_device", "in_order"):      # newer torch versions
        if hasattr(loader, name):
            options[name] = getattr(loader, name)
    return options


class PreparedLoader(DataLoader):
    """A DataLoader over this rank's share of the user's loader; iterating yields batches on ``device``.

    A training loader (``training=True``) tells the strategy when it gives the last batch of a
    pass (``last_batch``: the step after it ends the pass) and ends each epoch of the strategy
    (``end_epoch``) when an iteration is exhausted. An evaluation loader that pads records where
    it is (``metrics.EvalPass``), so that ``gather_for_metrics`` can leave the repeated samples out.
    """

    def __init__(self, loader: DataLoader, *, rank: int, world_size: int, device: torch.device, seed: int = 0,
                 training: bool = True, strategy=None, remainder: str = "pad"):
        if not isinstance(loader, DataLoader):
            raise DDTrainError(f"prepare(): loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
        check_remainder(remainder, training=training)
        dataset, options = loader.dataset, _loader_options(loader)
        if isinstance(dataset, IterableDataset):
            super().__init__(IterableShard(dataset, rank=rank, world_size=world_size, remainder=remainder),
                             batch_size=loader.batch_size, drop_last=loader.drop_last, **options)
        else:
            if loader.batch_size is None:
                raise DDTrainError("prepare(): loader.batch_sampler is a custom batch sampler, which ddtrain cannot "
                                   "shard by rank; give the DataLoader a sampler and a batch_size instead")
            if isinstance(loader.sampler, DistributedSampler):
                raise DDTrainError("prepare(): loader.sampler is a DistributedSampler, already sharded by rank; "
                                   "give the loader the sampler you would use in one process (or shuffle=True)")
            sampler = RankSampler(loader.sampler, rank=rank, world_size=world_size, seed=seed, remainder=remainder)
            if training and hasattr(loader.sampler, "__len__") and len(sampler) == 0:
                raise DDTrainError(f"prepare(): the training loader's sampler gives {len(loader.sampler)} samples, "
                                   f"fewer than the {world_size} ranks that train, and remainder='drop' leaves "
                                   "them none; use remainder='pad'")
            super().__init__(dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last,
                             **options)
        self.device, self.training, self.strategy, self.remainder = device, training, strategy, remainder
        self.world_size = world_size
        self.non_blocking = bool(loader.pin_memory) and device.type == "cuda"
        self.iterations = 0       # completed passes (the epoch number of an iterable dataset)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration (its shuffle); as ``DistributedSampler.set_epoch``."""
        if isinstance(self.sampler, RankSampler):
            self.sampler.set_epoch(epoch)

    def _length(self) -> int | None:
        try:
            return len(self)
        except TypeError:         # an iterable dataset without len()
            return None

    def _eval_pass(self) -> EvalPass | None:
        """This pass's record for ``gather_for_metrics`` (padded evaluation loaders of known size only)."""
        if self.training or self.remainder != "pad" or self.world_size == 1 or self.batch_size is None:
            return None
        try:
            positions = len(self.sampler.sampler) if isinstance(self.sampler, RankSampler) else len(self.dataset.dataset)
        except TypeError:
            return None
        per_rank = share_size(positions, 0, self.world_size, "pad")
        if self.drop_last:
            per_rank -= per_rank % self.batch_size
        return EvalPass(positions=positions, world_size=self.world_size, per_rank=per_rank)

    def __iter__(self):
        batches = self._length()
        record = self._eval_pass()
        if record is not None:
            Placement.eval_pass = record
        for index, batch in enumerate(super().__iter__()):
            if record is not None:
                record.rows_before = index * self.batch_size
                record.batch_rows = min(self.batch_size, record.per_rank - record.rows_before)
            if self.training and self.strategy is not None and index + 1 == batches:
                self.strategy.last_batch()
            yield move_to_device(batch, self.device, self.non_blocking)
        if record is not None:
            record.running = False
        epoch = self.sampler.epoch if isinstance(self.sampler, RankSampler) else self.iterations
        self.iterations += 1
        if self.training and self.strategy is not None:
            self.strategy.end_epoch(epoch)
