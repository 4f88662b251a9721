"""The loader ``prepare`` returns: a ``DataLoader`` over this rank's share, batches already on the device.

Built from the user's loader with everything it was given (sampler or ``shuffle``, ``drop_last``,
``collate_fn``, ``pin_memory``, ``num_workers``, worker options), so ``.dataset``, ``.sampler``,
``.batch_size`` and ``len()`` mean what they mean in PyTorch; only which samples this rank sees
changes, and every batch structure (tensors in tuples, lists, dicts, dataclasses) reaches the device.

Sharding rules (docs/PORTING.md):
- map-style datasets: ``RankSampler`` draws the user's sampler's order for the epoch with a
  random seed every rank shares (``seed + epoch``; a sampler with its own generator uses that;
  ``shuffle=True`` gives DistributedSampler's permutation for that seed), and rank r takes positions r, r+R, r+2R,
  ... of it (DistributedSampler's rule, over any sampler).
  A training loader drops the last ``n mod R`` positions, so every rank runs the same number of
  steps and the union of the ranks' step-s batches is the step-s batch of one process with an
  R-times larger batch. An evaluation loader drops nothing: shards differ by at most one sample,
  every sample is seen exactly once, and the prepared model runs no collective without gradients.
- iterable datasets: every rank reads the stream, cut into groups of R consecutive elements;
  rank r keeps element r of each group (with loader workers, worker w of W keeps the groups
  g with g mod W = w). Join rule: a training loader drops a last incomplete group, so the ranks
  see the same number of elements and batches; an evaluation loader keeps it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler,
                              get_worker_info)

from ddtrain.errors import DDTrainError


def _is_plain_shuffle(sampler) -> bool:
    """Is ``sampler`` what ``DataLoader(shuffle=True)`` makes: one permutation from torch's global generator?"""
    return (type(sampler) is RandomSampler and sampler.generator is None and not sampler.replacement
            and sampler.num_samples == len(sampler.data_source))


class RankSampler(Sampler):
    """This rank's positions r, r+R, ... of ``sampler``'s order, drawn with a seed every rank shares.

    ``set_epoch(e)`` picks the epoch (the seed is ``seed + e``) of the next iteration; without it
    each iteration takes the next epoch, so the order changes every epoch either way.
    """

    def __init__(self, sampler, *, rank: int, world_size: int, seed: int = 0, drop_remainder: bool = True):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.seed, self.drop_remainder = seed, drop_remainder
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
        order = self.order()
        if self.drop_remainder:
            order = order[: len(order) - len(order) % self.world_size]
        return iter(order[self.rank::self.world_size])

    def __len__(self) -> int:
        n = len(self.sampler)
        if self.drop_remainder:
            return n // self.world_size
        return len(range(self.rank, n, self.world_size))


class IterableShard(IterableDataset):
    """Element r of every group of R consecutive elements of ``dataset`` (see the module doc)."""

    def __init__(self, dataset, *, rank: int, world_size: int, drop_remainder: bool = True):
        self.dataset, self.rank, self.world_size, self.drop_remainder = dataset, rank, world_size, drop_remainder

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        group, index = [], 0
        for element in self.dataset:
            group.append(element)
            if len(group) == self.world_size:
                if index % workers == worker:
                    yield group[self.rank]
                group, index = [], index + 1
        if group and not self.drop_remainder and index % workers == worker and self.rank < len(group):
            yield group[self.rank]

    def __len__(self) -> int:
        n = len(self.dataset)  # TypeError without one, as for any IterableDataset
        if self.drop_remainder:
            return n // self.world_size
        return len(range(self.rank, n, self.world_size))


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

    A training loader (``training=True``) also ends each epoch of the strategy (``end_epoch``)
    when an iteration is exhausted.
    """

    def __init__(self, loader: DataLoader, *, rank: int, world_size: int, device: torch.device, seed: int = 0,
                 training: bool = True, strategy=None):
        if not isinstance(loader, DataLoader):
            raise DDTrainError(f"prepare(): loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
        dataset, options = loader.dataset, _loader_options(loader)
        if isinstance(dataset, IterableDataset):
            super().__init__(IterableShard(dataset, rank=rank, world_size=world_size, drop_remainder=training),
                             batch_size=loader.batch_size, drop_last=loader.drop_last, **options)
        else:
            if loader.batch_size is None:
                raise DDTrainError("prepare(): loader.batch_sampler is a custom batch sampler, which ddtrain cannot "
                                   "shard by rank; give the DataLoader a sampler and a batch_size instead")
            if isinstance(loader.sampler, DistributedSampler):
                raise DDTrainError("prepare(): loader.sampler is a DistributedSampler, already sharded by rank; "
                                   "give the loader the sampler you would use in one process (or shuffle=True)")
            sampler = RankSampler(loader.sampler, rank=rank, world_size=world_size, seed=seed,
                                  drop_remainder=training)
            if training and hasattr(loader.sampler, "__len__") and len(loader.sampler) < world_size:
                raise DDTrainError(f"prepare(): the training loader's sampler gives {len(loader.sampler)} samples, "
                                   f"fewer than the {world_size} ranks that train: some would have none")
            super().__init__(dataset, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last,
                             **options)
        self.device, self.training, self.strategy = device, training, strategy
        self.non_blocking = bool(loader.pin_memory) and device.type == "cuda"
        self.iterations = 0       # completed passes (the epoch number of an iterable dataset)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration (its shuffle); as ``DistributedSampler.set_epoch``."""
        if isinstance(self.sampler, RankSampler):
            self.sampler.set_epoch(epoch)

    def __iter__(self):
        for batch in super().__iter__():
            yield move_to_device(batch, self.device, self.non_blocking)
        epoch = self.sampler.epoch if isinstance(self.sampler, RankSampler) else self.iterations
        self.iterations += 1
        if self.training and self.strategy is not None:
            self.strategy.end_epoch(epoch)
