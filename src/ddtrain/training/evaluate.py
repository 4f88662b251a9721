"""Loss and accuracy over a dataset, each worker taking its share; sums kept on the device."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddtrain.data.loading import ShardLoader
from ddtrain.data.sharding import ShardSampler


def loss_function(task: str):
    return F.cross_entropy if task == "classification" else F.mse_loss


class Meter:
    """Sums kept on the device (no host sync per step), reduced over the workers at epoch end."""

    def __init__(self, device, classify: bool = True):
        self.classify = classify
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss·n, correct, n

    def add(self, loss, out, y, classify: bool):
        n = y.shape[0]
        self.sums[0] += loss.detach().double() * n
        if classify:
            self.sums[1] += (out.argmax(1) == y).sum()
        self.sums[2] += n

    def reduce(self, group, distributed: bool):
        sums = self.sums.clone()
        if distributed:
            dist.all_reduce(sums, group=group)
        loss_sum, correct, n = sums.tolist()
        accuracy = correct / n if n and self.classify else None
        return (loss_sum / n if n else float("nan")), accuracy, int(n)


def evaluate(module: nn.Module, dataset, *, worker_rank: int, workers: int, batch_size: int, device,
             task: str, group, distributed: bool, amp: str = "off", channels_last: bool = False):
    """Loss and accuracy over ``dataset``, each worker taking every ``workers``-th sample."""
    sampler = ShardSampler(len(dataset), rank=worker_rank, world_size=workers, shuffle=False, remainder="pad") \
        if len(dataset) >= workers else None
    classify, loss_fn = task == "classification", loss_function(task)
    meter = Meter(device, classify)
    was_training = module.training
    module.eval()
    if sampler is not None:
        # The padded tail would count some samples twice; evaluate exactly the real ones.
        idx = torch.arange(worker_rank, len(dataset), workers)
        loader = ShardLoader(dataset, _Fixed(idx, sampler), min(batch_size, max(len(idx), 1)), device,
                             channels_last=channels_last) if len(idx) else []
        with torch.no_grad(), autocast(device, amp):
            for x, y in loader:
                out = module(x)
                meter.add(loss_fn(out.float(), y), out, y, classify)
    module.train(was_training)
    loss, accuracy, _ = meter.reduce(group, distributed)
    return loss, accuracy


class _Fixed(ShardSampler):
    def __init__(self, idx, like):
        self.__dict__.update(like.__dict__)
        self._idx, self.per_rank = idx, len(idx)

    def indices(self):
        return self._idx


def autocast(device, amp: str):
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
