"""Batches of one rank's shard, already on the training device.

In-memory ``ArrayDataset``s are gathered a whole batch at a time (optionally from a copy
resident on the GPU, so a step never waits on the host); other datasets go through a
``torch.utils.data.DataLoader`` with worker processes, pinned memory and prefetch.
"""
from __future__ import annotations

import math
import queue
import threading

import torch
from torch.utils.data import DataLoader, Dataset

from ..errors import DDTrainError
from .arrays import ArrayDataset
from .sharding import ShardSampler


def steps_per_epoch(samples_per_rank: int, batch_size: int) -> int:
    """Every rank runs this many steps; a trailing batch of one sample is dropped (batch norm)."""
    steps = math.ceil(samples_per_rank / batch_size)
    if steps > 1 and samples_per_rank % batch_size == 1:
        steps -= 1
    return steps


class ShardLoader:
    """Iterate this rank's batches for the current epoch (``set_epoch`` reshuffles)."""

    def __init__(self, dataset: Dataset, sampler: ShardSampler, batch_size: int, device: torch.device, *,
                 workers: int = 0, on_device: bool = False, channels_last: bool = False, collate_fn=None):
        if batch_size < 1:
            raise DDTrainError(f"batch size must be at least 1, got {batch_size}")
        if batch_size > len(sampler):
            raise DDTrainError(f"batch size {batch_size} is larger than a rank's shard "
                               f"({len(sampler)} samples on each of {sampler.world} ranks); "
                               f"use a smaller --batch-size or fewer ranks")
        self.dataset, self.sampler, self.batch_size, self.device = dataset, sampler, batch_size, device
        self.channels_last = channels_last
        self.steps = steps_per_epoch(len(sampler), batch_size)
        # Datasets that gather (ArrayDataset) or compute (synthetic BatchDataset) a whole batch at
        # once skip the DataLoader's per-sample path when no loader processes are asked for.
        self.fast = hasattr(dataset, "batch") and hasattr(dataset, "to") and workers == 0
        if self.fast and on_device and device.type != "cpu":
            self.dataset = dataset.to(device)  # copied once
            if channels_last and isinstance(self.dataset, ArrayDataset) and self.dataset.x.dim() == 4:
                self.dataset.x = self.dataset.x.contiguous(memory_format=torch.channels_last)
        self.pin = device.type == "cuda"
        self.workers, self.collate_fn = workers, collate_fn

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps

    def _batches(self, device=None):
        idx = self.sampler.indices()
        if device is not None and device.type != "cpu":
            # One copy per epoch: a per-step copy from pageable memory would make the host wait
            # for the GPU to drain its queue every step.
            idx = idx.to(device)
        for s in range(self.steps):
            yield idx[s * self.batch_size:(s + 1) * self.batch_size]

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
                    x, y = self.dataset.batch(b)
                    item = (x.pin_memory(), y.pin_memory()) if pin else (x, y)
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
        try:
            while True:
                item = ready.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield self._place(*item)
        finally:
            stop.set()

    def _place(self, x, y):
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.channels_last and x.dim() == 4 and not x.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y

    def __iter__(self):
        if self.fast:
            on = self.dataset.x.device if isinstance(self.dataset, ArrayDataset) else self.dataset.device
            if self.pin and on.type == "cpu":
                yield from self._prefetched(on)
                return
            for b in self._batches(on):
                yield self._place(*self.dataset.batch(b))
            return
        loader = DataLoader(self.dataset, batch_sampler=[b.tolist() for b in self._batches()],
                            num_workers=self.workers, pin_memory=self.pin, collate_fn=self.collate_fn,
                            persistent_workers=False, prefetch_factor=4 if self.workers else None)
        for x, y in loader:
            yield self._place(x, y)
