"""Batches of one rank's shard, already on the training device.

In-memory ``ArrayDataset``s are gathered a whole batch at a time (optionally from a copy
resident on the GPU, so a step never waits on the host); image datasets take their batched
pipeline on the GPU (``ImageDataset.batch_pipeline``: decode and augmentation on the device,
one batch ahead) or travel as uint8 and are normalised on the device; other datasets go
through a ``torch.utils.data.DataLoader`` with worker processes, pinned memory and prefetch.
Image files that cannot be decoded are reported once and counted in ``ShardLoader.problems``.

The GPU-resident path copies an in-memory dataset to the GPU once, and computes a synthetic
(lazy) dataset there once when it takes at most ``DEVICE_SHARE`` of the GPU's free memory
(otherwise its batches are computed on the GPU step by step). From host memory, a thread
gathers each batch straight into pinned memory and the copy to the GPU runs on a side stream
one batch ahead, so it overlaps the previous step's compute instead of preceding it.
"""
from __future__ import annotations

import math
import queue
import threading

import torch
from torch.utils.data import DataLoader, Dataset

from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.images import ImageDataset, ProblemLog
from ddtrain.data.balance import micro_sizes, rank_span
from ddtrain.data.sharding import ShardSampler

DEVICE_SHARE = 0.4      # a lazy dataset is materialised on the GPU up to this share of free memory


def steps_per_epoch(samples_per_rank: int, batch_size: int) -> int:
    """Every rank runs this many steps; a trailing batch of one sample is dropped (batch norm)."""
    steps = math.ceil(samples_per_rank / batch_size)
    if steps > 1 and samples_per_rank % batch_size == 1:
        steps -= 1
    return steps


class ShardLoader:
    """Iterate this rank's batches for the current epoch (``set_epoch`` reshuffles)."""

    def __init__(self, dataset: Dataset, sampler: ShardSampler, batch_size: int, device: torch.device, *,
                 workers: int = 0, on_device: bool = False, channels_last: bool = False, collate_fn=None,
                 problems: ProblemLog | None = None, uint8: bool = False):
        if batch_size < 1:
            raise DDTrainError(f"batch size must be at least 1, got {batch_size}")
        if batch_size > len(sampler):
            raise ConfigError("batch_size", f"{batch_size} is larger than a rank's shard ({len(sampler)} samples on each "
                                            f"of {sampler.world} ranks); use a smaller batch_size or fewer ranks")
        self.dataset, self.sampler, self.batch_size, self.device = dataset, sampler, batch_size, device
        self.channels_last = channels_last
        self.steps = steps_per_epoch(len(sampler), batch_size)
        # Datasets that gather (ArrayDataset) or compute (synthetic BatchDataset) a whole batch at
        # once skip the DataLoader's per-sample path when no loader processes are asked for.
        self.fast = hasattr(dataset, "batch") and hasattr(dataset, "to") and workers == 0
        if self.fast and on_device and device.type != "cpu":
            self.dataset = to_device(dataset, device, channels_last)
        self.pin = device.type == "cuda"
        self.workers, self.collate_fn = workers, collate_fn
        self.problems = problems if problems is not None else ProblemLog()
        self.images = isinstance(dataset, ImageDataset) and collate_fn is None
        self.pipeline = dataset.batch_pipeline(device, workers) if self.images else None
        # uint8: the CPU path's batches as they reach the device, not yet made float (ddtrain bench data --uint8:
        # what the CPU does for a GPU run, measured on a machine without one)
        self.uint8 = uint8 and self.images and self.pipeline is None
        # unequal shares of each global batch (--balance speed): set by ``share_by``
        self.schedule, self.rank, self.grad_accum = None, 0, 1
        self.first_step = 0   # the global step of this epoch's first step (the loop sets it every epoch)

    def share_by(self, schedule, rank: int, grad_accum: int) -> None:
        """Draw each step's batches from this rank's share in ``schedule`` (a ``data.balance.ShareSchedule``)."""
        if not self.sampler.global_batch:
            raise DDTrainError("unequal shares need a global batch (--global-batch-size)")
        self.schedule, self.rank, self.grad_accum = schedule, rank, grad_accum

    def lookahead(self) -> int | None:
        """Micro-batches this loader may draw ahead of the one being trained (None: a whole epoch at once).

        Shares agreed for a step must be in place before its batches are drawn: the balancer makes
        a change take effect that many steps later (``training.balance``).
        """
        if self.pipeline is not None:
            return None if getattr(self.pipeline, "readers", 0) else getattr(self.pipeline, "depth", 2) + 2
        if self.images or not self.fast:   # a DataLoader: prefetch_factor (4) batches per loader process
            return 4 * self.workers + 1 if self.workers else 0
        if self.pin:   # _prefetched: its queue (3), the batch being put, and the copy one batch ahead
            return 3 + 3
        return 0

    def describe(self) -> dict:
        """How batches are made (the results record's ``data_pipeline``)."""
        if self.pipeline is not None:
            return self.pipeline.describe()
        if self.images:
            return {**self.dataset.describe(torch.device("cpu"), self.workers), "loader_workers": self.workers}
        how = "gathered a batch at a time" if self.fast else "DataLoader"
        return {"pipeline": how, "loader_workers": self.workers}

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps

    def _batches(self, device=None):
        if self.schedule is not None:
            yield from self._shared_batches(device)
            return
        idx = self.sampler.indices()
        if device is not None and device.type != "cpu":
            # One copy per epoch: a per-step copy from pageable memory would make the host wait
            # for the GPU to drain its queue every step.
            idx = idx.to(device)
        for s in range(self.steps):
            yield idx[s * self.batch_size:(s + 1) * self.batch_size]

    def _shared_batches(self, device=None):
        """This rank's micro-batches under unequal shares: its run of each step's global batch, cut in grad_accum."""
        order = self.sampler.order()
        if device is not None and device.type != "cpu":
            order = order.to(device)
        for step in range(self.steps // self.grad_accum):
            start, count = rank_span(self.schedule.shares_for(self.first_step + step), self.rank)
            for size in micro_sizes(count, self.grad_accum):
                yield self.sampler.step_positions(order, step, start, size)
                start += size

    def _index_lists(self):
        """The DataLoader's batch sampler: drawn as it goes under unequal shares (the shares change during an epoch)."""
        return _IndexLists(self) if self.schedule is not None else [b.tolist() for b in self._batches()]

    def _prefetched(self, on, depth: int = 3, pin: bool = True):
        """Host data for a GPU: a thread gathers and pins the next batches while the GPU trains.

        Gathering and pinning release the GIL, so they overlap the training step; the copy to
        the GPU is then a non-blocking DMA from pinned memory.
        """
        ready: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()

        def produce():
            try:
                for b in self._batches(on):
                    item = gather(self.dataset, b, pin)
                    while not stop.is_set():
                        try:
                            ready.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            pass
                    if stop.is_set():
                        return
                ready.put(None)
            except BaseException as exc:  # handed to the training thread, raised there
                ready.put(exc)

        worker = threading.Thread(target=produce, name="ddtrain-prefetch", daemon=True)
        worker.start()
        ahead = _CopyAhead(self) if self.device.type == "cuda" else None
        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                if ahead is None:
                    yield self._place(*item)
                elif (previous := ahead.push(item)) is not None:
                    yield previous
            if ahead is not None and (last := ahead.drain()) is not None:
                yield last
        finally:
            stop.set()

    def _place(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4 and not x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def __iter__(self):
        if self.pipeline is not None:
            for x, y, problems in self.pipeline.batches(self._batches()):
                self.problems.add(problems)
                yield self._place(x, y)
            return
        if self.images:   # uint8 samples to the device, made float there (on the CPU: in the loader processes)
            on_cpu = self.device.type == "cpu" and not self.uint8
            collate = _Collate(self.dataset, on_cpu, self.channels_last)
            loader = DataLoader(_Samples(self.dataset), batch_sampler=self._index_lists(),
                                num_workers=self.workers, pin_memory=self.pin, collate_fn=collate,
                                persistent_workers=False, prefetch_factor=4 if self.workers else None)
            for x, y, problems in loader:
                self.problems.add(problems)
                x, y = self._place(x, y)
                yield (x if on_cpu or self.uint8 else self.dataset.finish(x, self.channels_last)), y
            return
        if self.fast:
            on = self.dataset.x.device if isinstance(self.dataset, ArrayDataset) else self.dataset.device
            if self.pin and on.type == "cpu":
                yield from self._prefetched(on)
                return
            for b in self._batches(on):
                yield self._place(*self.dataset.batch(b))
            return
        loader = DataLoader(self.dataset, batch_sampler=self._index_lists(),
                            num_workers=self.workers, pin_memory=self.pin, collate_fn=self.collate_fn,
                            persistent_workers=False, prefetch_factor=4 if self.workers else None)
        for x, y in loader:
            yield self._place(x, y)


class _IndexLists:
    """A loader's index batches as lists, drawn one by one as the DataLoader asks (it has a length)."""

    def __init__(self, loader: ShardLoader):
        self.loader = loader

    def __iter__(self):
        return (b.tolist() for b in self.loader._batches())

    def __len__(self) -> int:
        return self.loader.steps


class _Samples(Dataset):
    """An image dataset's CPU-path samples (uint8, or a ``Problem`` in place of a bad file)."""

    def __init__(self, dataset: ImageDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset.sample(i)


class _Collate:
    """The image dataset's collate, picklable for loader processes started by spawn or forkserver."""

    def __init__(self, dataset: ImageDataset, finish: bool, channels_last: bool):
        self.dataset, self.finish, self.channels_last = dataset, finish, channels_last

    def __call__(self, samples):
        return self.dataset.collate(samples, finish=self.finish, channels_last=self.channels_last)


class _CopyAhead:
    """Host-to-GPU copies on a side stream, one batch ahead of the step that uses them."""

    def __init__(self, loader: ShardLoader):
        self.loader = loader
        self.stream = torch.cuda.Stream(loader.device)
        self.pending = None

    def push(self, item):
        """Start copying ``item``; returns the batch copied before it, ready for the current stream."""
        with torch.cuda.stream(self.stream):
            x, y = self.loader._place(*item)
        started = (x, y, self.stream.record_event())
        previous, self.pending = self.pending, started
        return None if previous is None else self._use(*previous)

    def drain(self):
        previous, self.pending = self.pending, None
        return None if previous is None else self._use(*previous)

    def _use(self, x, y, copied):
        current = torch.cuda.current_stream(self.loader.device)
        current.wait_event(copied)
        x.record_stream(current)  # the allocator must not hand these out again before the step ends
        y.record_stream(current)
        return x, y


def gather(dataset, idx: torch.Tensor, pin: bool):
    """One batch from host memory, gathered straight into pinned memory when ``pin`` (one pass, not two)."""
    if not (pin and isinstance(dataset, ArrayDataset) and dataset.x.device.type == "cpu"):
        x, y = dataset.batch(idx)
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)
    out = []
    for t in (dataset.x, dataset.y):
        buf = torch.empty((len(idx), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
        out.append(torch.index_select(t, 0, idx, out=buf))
    return tuple(out)


def to_device(dataset, device: torch.device, channels_last: bool = False):
    """``dataset`` resident on ``device``: copied once, or (a lazy synthetic dataset) computed there once.

    A lazy dataset larger than ``DEVICE_SHARE`` of the device's free memory stays lazy: its
    batches are then computed on the device each step.
    """
    dataset = dataset.to(device)
    if not isinstance(dataset, ArrayDataset) and hasattr(dataset, "materialise"):
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        if free is None or dataset.nbytes() <= DEVICE_SHARE * free:
            return dataset.materialise(channels_last=channels_last)
        return dataset
    if channels_last and isinstance(dataset, ArrayDataset) and dataset.x.dim() == 4:
        dataset.x = dataset.x.contiguous(memory_format=torch.channels_last)
    return dataset
