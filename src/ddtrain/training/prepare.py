"""The minimal-change path: three objects in, the same three out, ready for data-parallel training.

    model, optimizer, loader = ddtrain.training.prepare(model, optimizer, loader, strategy="ring")

The model comes back on this rank's device and wrapped by the strategy; the optimizer's
``step()`` also runs the strategy's per-step synchronisation; the loader yields this rank's
disjoint shard of every epoch (reshuffled each time it is iterated, with a seed all ranks
share), already on the device. Parameter-server ranks never return: they serve the workers
until training ends and then exit the process.
"""
from __future__ import annotations

import sys

import torch
from torch.utils.data import DataLoader

from ddtrain.dist import runtime
from ddtrain.data.loading import ShardLoader
from ddtrain.data.sharding import ShardSampler
from ddtrain.errors import DDTrainError
from ddtrain.sync import SyncOptions, wrap


class SyncedOptimizer:
    """The user's optimizer, with the strategy's synchronisation after every ``step()``."""

    def __init__(self, synced):
        self._synced, self._inner, self._step = synced, synced.optimizer, 0

    def step(self, *args, **kwargs):
        result = self._inner.step(*args, **kwargs)
        self._synced.after_step(self._step)
        self._step += 1
        return result

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def synced(self):
        return self._synced


class PreparedLoader:
    """Iterating starts the next epoch of this rank's shard."""

    def __init__(self, loader: DataLoader, synced, device, seed: int):
        if not isinstance(loader, DataLoader):
            raise DDTrainError(f"prepare() takes a torch.utils.data.DataLoader, got {type(loader).__name__}")
        batch = loader.batch_size
        if batch is None:
            raise DDTrainError("prepare() needs a DataLoader with a batch_size (not a custom batch_sampler)")
        sampler = ShardSampler(len(loader.dataset), rank=synced.worker_rank, world_size=synced.workers,
                               shuffle=True, seed=seed)
        self._shard = ShardLoader(loader.dataset, sampler, batch, device, workers=loader.num_workers,
                                  collate_fn=loader.collate_fn)
        self._shard.fast = False  # keep the user's dataset semantics (transforms, collate)
        self._synced, self.epoch = synced, 0

    def __len__(self):
        return len(self._shard)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch - 1

    def __iter__(self):
        self.epoch += 1
        self._shard.set_epoch(self.epoch)
        yield from self._shard
        self._synced.end_epoch(self.epoch)


def prepare(model: torch.nn.Module, optimizer, loader: DataLoader | None = None, *,
            strategy: str = "ddp", seed: int = 0, **options):
    """Return ``(model, optimizer, loader)`` set up for ``strategy`` on this rank (see module doc)."""
    runtime.init()
    device = runtime.device()
    model.to(device)
    synced = wrap(strategy, model, optimizer, SyncOptions(**options))
    if synced.role == "server":
        synced.serve()
        synced.finish()
        runtime.shutdown()
        sys.exit(0)
    prepared = PreparedLoader(loader, synced, device, seed) if loader is not None else None
    return synced.model, SyncedOptimizer(synced), prepared
