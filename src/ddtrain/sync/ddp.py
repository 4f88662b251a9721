"""``ddp``: PyTorch DistributedDataParallel with the backend's own all-reduce (the default)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddtrain.errors import DDTrainError
from ddtrain.sync.base import Strategy, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor
from ddtrain.sync.state import in_handover


# Devices torch's SyncBatchNorm computes its statistics on (its forward refuses the CPU)
SYNC_BATCHNORM_DEVICES = ("cuda",)


def sync_batchnorm_(model: torch.nn.Module, group=None) -> None:
    """Replace every BatchNorm layer inside ``model`` by a SyncBatchNorm sharing its parameters and buffers."""
    if isinstance(model, torch.nn.modules.batchnorm._BatchNorm):
        raise DDTrainError("sync_batchnorm: the model itself is a BatchNorm layer; wrap it in a module first")
    for name, child in model.named_children():
        # the converted layer takes the same Parameter objects, so optimizers built on the model stay valid
        setattr(model, name, torch.nn.SyncBatchNorm.convert_sync_batchnorm(child, group))


def ddp_model(model, options: SyncOptions, comm_hook=None, hook_state=None):
    """Wrap ``model`` in DDP on its own device with the user's DDP options and an optional communication hook."""
    device = next(model.parameters()).device
    if options.sync_batchnorm:
        if device.type not in SYNC_BATCHNORM_DEVICES:
            raise DDTrainError(f"sync_batchnorm=True needs the model on CUDA devices (SyncBatchNorm has no "
                               f"{device.type} implementation); leave it off with the gloo backend on CPU")
        sync_batchnorm_(model)
    wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=options.bucket_cap_mb, find_unused_parameters=options.find_unused_parameters,
                  static_graph=options.static_graph, gradient_as_bucket_view=options.gradient_as_bucket_view,
                  # passed only when off: newer torch warns on any broadcast_buffers argument (renamed)
                  **({} if options.broadcast_buffers else {"broadcast_buffers": False}),
                  **({"init_sync": False} if in_handover() else {}))   # auto's switch: the state is equal already
    if comm_hook is not None:
        wrapped.register_comm_hook(hook_state, comm_hook)
    return wrapped


def gradient_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class DDPStrategy(Strategy):
    """``ddp``: DDP-wrapped model; traffic by formula (the native all-reduce runs inside DDP, unseen)."""

    def __init__(self, model, optimizer, options: SyncOptions):
        world = dist.get_world_size()
        super().__init__(ddp_model(model, options), optimizer, module=model, stats=SyncStats(
            method="formula: one ring all-reduce a step, 2(R-1)/R of the gradient bytes "
                   "and 2(R-1) messages each way (DDP's buckets not counted apart)"))
        self.bytes_per_step = int(2 * (world - 1) / world * gradient_bytes(model))
        self.messages_per_step = 2 * (world - 1)
        self.monitor = DivergenceMonitor(model, self.stats, None, options.check_every)
        self.stats.extra["comm_wait_note"] = "not observable: the native all-reduce runs inside DDP"

    def after_step(self, step: int) -> None:
        super().after_step(step)
        stats, steps = self.stats, self.monitor.steps
        stats.bytes_sent = stats.bytes_received = self.bytes_per_step * steps
        stats.messages_sent = stats.messages_received = self.messages_per_step * steps
