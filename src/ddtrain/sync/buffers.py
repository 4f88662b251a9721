"""DDP's ``broadcast_buffers`` rule, for a strategy whose workers run the model without DDP (ps-sync).

What ``DistributedDataParallel`` does (torch's ``_pre_forward``/``_post_forward``, the same from
torch 1.x to 2.13): before a forward, if the *previous* forward ran with gradients enabled and
their synchronisation on (``require_backward_grad_sync``, off inside ``no_sync()``) -- or it is
the first forward -- rank 0's buffers (every buffer: BatchNorm's running statistics and its
``num_batches_tracked`` too) are broadcast to the others. So every training step starts from
rank 0's statistics, and the first evaluation forward after training (under ``no_grad``)
broadcasts once more, which is why a plain-DDP script evaluates with rank 0's statistics on
every rank; the forwards after it do not.

The strategies run through DDP (ddp, the all-reduce hooks, hybrid) get this from DDP itself;
``prepare``'s model calls them for evaluation too. ps-sync's workers call ``BufferRule`` around
every forward. ps-async's workers do not step together, so none of their forwards waits for
another worker's (their buffers stay their own), and local-sgd averages buffers with the
parameters at each averaging instead (docs/PORTING.md).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.sync.state import broadcast_


class BufferRule:
    """Broadcast group rank 0's buffers of ``module`` before a forward when DDP would (see the module doc)."""

    def __init__(self, module: torch.nn.Module, group=None, enabled: bool = True):
        self.module, self.group, self.enabled = module, group, enabled
        self.due = True           # DDP's require_forward_param_sync: the first forward broadcasts

    def before_forward(self) -> None:
        if not (self.due and self.enabled and dist.is_initialized()):
            return
        buffers = list(self.module.buffers())
        if buffers:
            broadcast_(buffers, group=self.group, counted=False)   # as DDP's own: setup-like, not the strategy's traffic

    def after_forward(self, synced: bool) -> None:
        """``synced``: the forward ran with gradients enabled and their synchronisation on."""
        self.due = synced
