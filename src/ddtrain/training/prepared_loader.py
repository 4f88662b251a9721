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

    def __init__(self, sampler, *, rank: int, world_size: int, seed: int = 0, remainder: str = "pad",
                 multiple: int | None = None):
        self.sampler, self.rank, self.world_size = sampler, rank, world_size
        self.seed, self.remainder = seed, remainder
        # with a global batch G (ddtrain.save_state's resize), n mod G positions are dropped: whole global
        # batches at every world size; without one, ``remainder`` decides (DistributedSampler's rule)
        self.multiple = multiple
        self.epoch, self._next_epoch = 0, 0
        self.skip = 0          # positions of this rank's share the next iteration leaves out (a resumed epoch's)

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
        if self.multiple:
            share = order[: len(order) - len(order) % self.multiple][self.rank::self.world_size]
        else:
            share = rank_share(order, self.rank, self.world_size, self.remainder)
        skip, self.skip = self.skip, 0
        return iter(share[skip:])

    def __len__(self) -> int:
        n = len(self.sampler)
        if self.multiple:
            return (n - n % self.multiple) // self.world_size
        return share_size(n, self.rank, self.world_size, self.remainder)


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
    With ``global_batch`` G (a training loader of a script that states its global batch) each
    rank's batch is G / (``world_size`` x ``grad_accum``) whatever the loader's ``batch_size``, and
    the n mod G samples after the last whole global batch are dropped: optimizer step s of an epoch
    trains positions s*G to (s+1)*G-1 of the epoch's order at every world size (rank r takes every
    R-th of them), as ``ddtrain train --global-batch-size``.

    For ``ddtrain.save_state`` it knows where it is (``position``: the epoch, the batches of it
    yielded) and the RNG states at the start of the epoch (``rng_epoch``); ``resume_at`` makes
    the next iteration of that epoch yield only the batches not yet trained.
    """

    def __init__(self, loader: DataLoader, *, rank: int, world_size: int, device: torch.device, seed: int = 0,
                 training: bool = True, strategy=None, global_batch: int = 0, grad_accum: int = 1,
                 remainder: str = "pad"):
        if not isinstance(loader, DataLoader):
            raise DDTrainError(f"prepare(): loader must be a torch.utils.data.DataLoader, got {type(loader).__name__}")
        check_remainder(remainder, training=training)
        dataset, options = loader.dataset, _loader_options(loader)
        batch_size, drop_last, multiple = loader.batch_size, loader.drop_last, None
        if global_batch and training:
            batch_size, left = divmod(global_batch, world_size * grad_accum)
            if left or not batch_size:
                raise DDTrainError(f"prepare(): a global batch of {global_batch} samples cannot be shared by "
                                   f"{world_size} worker(s) x grad_accum {grad_accum}: it must be a multiple of "
                                   f"{world_size * grad_accum}")
            drop_last, multiple = True, global_batch
            if not isinstance(dataset, IterableDataset) and hasattr(loader.sampler, "__len__") \
                    and len(loader.sampler) < global_batch:
                raise DDTrainError(f"prepare(): a global batch of {global_batch} samples is more than the "
                                   f"{len(loader.sampler)} the training loader's sampler gives")
        if isinstance(dataset, IterableDataset):
            super().__init__(IterableShard(dataset, rank=rank, world_size=world_size,
                                           remainder="drop" if multiple else remainder),
                             batch_size=batch_size, drop_last=drop_last, **options)
        else:
            if loader.batch_size is None:
                raise DDTrainError("prepare(): loader.batch_sampler is a custom batch sampler, which ddtrain cannot "
                                   "shard by rank; give the DataLoader a sampler and a batch_size instead")
            if isinstance(loader.sampler, DistributedSampler):
                raise DDTrainError("prepare(): loader.sampler is a DistributedSampler, already sharded by rank; "
                                   "give the loader the sampler you would use in one process (or shuffle=True)")
            sampler = RankSampler(loader.sampler, rank=rank, world_size=world_size, seed=seed, remainder=remainder,
                                  multiple=multiple)
            if training and hasattr(loader.sampler, "__len__") and len(sampler) == 0:
                raise DDTrainError(f"prepare(): the training loader's sampler gives {len(loader.sampler)} samples, "
                                   f"fewer than the {world_size} ranks that train, and remainder='drop' leaves "
                                   "them none; use remainder='pad'")
            super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **options)
        self.device, self.training, self.strategy, self.remainder = device, training, strategy, remainder
        self.global_batch, self.world_size = global_batch if training else 0, world_size
        self.non_blocking = bool(loader.pin_memory) and device.type == "cuda"
        self.iterations = 0       # completed passes (the epoch number of an iterable dataset)
        # for ddtrain.save_state / load_state (ddtrain.training.state)
        self.position = {"epoch": 0, "batches": 0, "in_epoch": False}   # the epoch, its batches yielded
        self.rng_epoch = None     # the RNG states when this epoch's iteration began (training loaders)
        self.before_iteration = None   # called with (loader, epoch) before an iteration: a load_state deferred to it
        self.after_batch = None        # called with (loader) when the next batch is asked for (or none is left):
        #                                the step's own code has run, a save due at that step happens here
        self.fast_forward_to = None    # iterations of epochs before this one yield nothing (a resumed unmodified script)
        self._resume = None

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

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration will be."""
        return self.sampler._next_epoch if isinstance(self.sampler, RankSampler) else self.iterations

    def resume_at(self, epoch: int, batches: int, rng_epoch=None, rng=None) -> None:
        """The next iteration, of ``epoch``, yields only the batches after the first ``batches``.

        It starts from the RNG states ``rng_epoch`` (those the saved run's epoch began with: the
        loader's own draws come out the same), leaves the trained batches out (in the sampler
        with no loader workers, else drawn and dropped so that the workers' batches stay theirs),
        then sets ``rng`` (the states after the saved step) before yielding the first batch.
        """
        self.set_epoch(epoch)
        if not isinstance(self.sampler, RankSampler):
            self.iterations = epoch
        self.fast_forward_to = None
        self._resume = {"epoch": epoch, "batches": batches, "rng_epoch": rng_epoch, "rng": rng}
        self.position = {"epoch": epoch, "batches": batches, "in_epoch": bool(batches)}

    def __iter__(self):
        from ddtrain.reliability.checkpoint import rng_state, set_rng_state
        epoch = self.upcoming_epoch()
        if self.before_iteration is not None:
            self.before_iteration(self, epoch)
            epoch = self.upcoming_epoch()
        if self.fast_forward_to is not None and epoch < self.fast_forward_to:
            self.set_epoch(epoch + 1)   # an epoch the resumed state has done: nothing to yield
            self.iterations += 1
            self.position = {"epoch": epoch + 1, "batches": 0, "in_epoch": False}
            return
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] != epoch:
            resume = None
        if resume is not None and resume["rng_epoch"] is not None:
            set_rng_state(resume["rng_epoch"])
        self.rng_epoch = rng_state() if self.training else None
        skip = resume["batches"] if resume is not None else 0
        in_sampler = bool(skip) and isinstance(self.sampler, RankSampler) and self.num_workers == 0
        if in_sampler:
            self.sampler.skip = skip * self.batch_size
        total = self._length()          # batches of the whole pass (the skipped ones included)
        record = self._eval_pass()
        if record is not None:
            Placement.eval_pass = record
        batches = super().__iter__()
        if skip and not in_sampler:
            for _ in range(skip):
                next(batches, None)
        if resume is not None and resume["rng"] is not None:
            set_rng_state(resume["rng"])
        self.position = {"epoch": epoch, "batches": skip, "in_epoch": True}
        for index, batch in enumerate(batches, start=skip):
            if record is not None:
                record.rows_before = index * self.batch_size
                record.batch_rows = min(self.batch_size, record.per_rank - record.rows_before)
            if self.training and self.strategy is not None and index + 1 == total:
                self.strategy.last_batch()
            self.position["batches"] += 1
            yield move_to_device(batch, self.device, self.non_blocking)
            if self.after_batch is not None:
                self.after_batch(self)
        if record is not None:
            record.running = False
        self.position = {"epoch": epoch + 1, "batches": 0, "in_epoch": False}
        self.rng_epoch = None
        self.iterations += 1
        if self.training and self.strategy is not None:
            self.strategy.end_epoch(epoch)
