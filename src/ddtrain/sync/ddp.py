"""``ddp``: PyTorch DistributedDataParallel with the backend's own all-reduce (the default)."""
from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddtrain.sync.base import Synced, SyncOptions, SyncStats
from ddtrain.sync.divergence import DivergenceMonitor


def ddp_model(model, options: SyncOptions, comm_hook=None, hook_state=None):
    """Wrap ``model`` in DDP on its own device, with an optional communication hook."""
    device = next(model.parameters()).device
    wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  bucket_cap_mb=options.bucket_cap_mb)
    if comm_hook is not None:
        wrapped.register_comm_hook(hook_state, comm_hook)
    return wrapped


def gradient_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def wrap_ddp(model, optimizer, options: SyncOptions) -> Synced:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return Synced(model, optimizer, model, SyncStats(method="none: world size 1"))
    synced = Synced(ddp_model(model, options), optimizer, model,
                    SyncStats(method="formula: one ring all-reduce a step, 2(R-1)/R of the gradient bytes "
                                     "and 2(R-1) messages each way (DDP's buckets not counted apart)"))
    per_step = int(2 * (world - 1) / world * gradient_bytes(model))
    messages = 2 * (world - 1)
    monitor = DivergenceMonitor(model, synced.stats, None, options.check_every)
    synced.stats.extra["comm_wait_note"] = "not observable: the native all-reduce runs inside DDP"

    def after_step(step: int) -> None:
        monitor.after_step()
        stats = synced.stats
        stats.bytes_sent = stats.bytes_received = per_step * monitor.steps
        stats.messages_sent = stats.messages_received = messages * monitor.steps

    synced.after_step = after_step
    synced.end_epoch = lambda epoch: monitor.end_epoch(epoch)
    return synced
