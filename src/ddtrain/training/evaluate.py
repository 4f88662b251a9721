"""Loss and accuracy over a dataset, each worker taking its share; sums kept on the device."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddtrain.data.loading import ShardLoader


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
             task: str, group, distributed: bool, amp: str = "off", channels_last: bool = False, problems=None):
    """Loss and accuracy over ``dataset``, each worker taking every ``workers``-th sample.

    Exact means over the whole set: every sample counted once (no padding, no dropped tail
    batch), and a worker with no sample at all (fewer samples than workers) adds zeros.
    ``problems``: the ``ProblemLog`` bad image files are reported to (the training loader's).
    """
    classify, loss_fn = task == "classification", loss_function(task)
    meter = Meter(device, classify)
    was_training = module.training
    module.eval()
    idx = torch.arange(worker_rank, len(dataset), workers)
    if len(idx):
        loader = ShardLoader(dataset, _Fixed(idx, workers), min(batch_size, len(idx)), device,
                             channels_last=channels_last, problems=problems)
        loader.steps = math.ceil(len(idx) / loader.batch_size)  # the training loader drops a 1-sample tail batch
        with torch.no_grad(), autocast(device, amp):
            for x, y in loader:
                out = module(x)
                meter.add(loss_fn(out.float(), y), out, y, classify)
    module.train(was_training)
    loss, accuracy, _ = meter.reduce(group, distributed)
    return loss, accuracy


class _Fixed:
    """A fixed list of indices in the shape ShardLoader reads from a sampler."""

    def __init__(self, idx, workers: int):
        self._idx, self.per_rank, self.world = idx, len(idx), workers

    def set_epoch(self, epoch: int) -> None:
        pass

    def indices(self):
        return self._idx

    def __len__(self) -> int:
        return self.per_rank


def autocast(device, amp: str):
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)
