"""A model's state as a few flat buffers: what broadcasts and averagings move.

Parameters and floating-point buffers (batch-norm running statistics) are packed into one
contiguous buffer per dtype, moved in one message, and copied back -- one collective per
dtype instead of one per tensor, which is what makes a periodic broadcast or averaging cheap
in messages (document 000 counts one broadcast of N values per epoch).
Integer buffers (e.g. batch norm's ``num_batches_tracked``) are left alone: they count steps,
they are equal on every rank, and averaging them would be meaningless.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ddtrain import comm


_HANDOVER = [False]


@contextmanager
def handover():
    """Inside: the replicas are known bitwise equal (a step boundary of ``auto``, docs/AUTO.md), so the start-up
    broadcast of rank 0's state by a strategy being built (DDP's ``init_sync``, local SGD's) is skipped: at
    100 Mbit/s it is a second per switch for a 5 MB model."""
    _HANDOVER[0] = True
    try:
        yield
    finally:
        _HANDOVER[0] = False


def in_handover() -> bool:
    return _HANDOVER[0]


def state_tensors(module: torch.nn.Module, buffers: bool = True) -> list[torch.Tensor]:
    """Parameters, then floating-point buffers (if ``buffers``), in module order."""
    out = list(module.parameters())
    if buffers:
        out += [b for b in module.buffers() if b.is_floating_point()]
    return out


def _groups(tensors) -> dict:
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


@torch.no_grad()
def _each_flat_(tensors, fn) -> None:
    """Apply ``fn(flat)`` in place to one flat copy per dtype, then copy the result back."""
    for group in _groups(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        fn(flat)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_(tensors, *, group=None, counted: bool = True) -> None:
    """Every rank takes group rank 0's values of ``tensors``.

    ``counted``: with ddtrain's binomial-tree ``bcast`` (traffic counted under "bcast"); else
    with torch.distributed's own broadcast (setup, like DDP's initial one: not counted).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if not counted and _HANDOVER[0]:   # a set-up broadcast of a state every rank already holds (``handover``)
        return
    if counted:
        _each_flat_(tensors, lambda flat: comm.bcast(flat, 0, group))
    else:
        root = dist.get_global_rank(group, 0) if group is not None else 0
        _each_flat_(tensors, lambda flat: dist.broadcast(flat, src=root, group=group))


def average_(tensors, *, algorithm: str = "ring", group=None) -> None:
    """Replace ``tensors`` by their mean over ``group``, with a ddtrain.comm all-reduce (counted)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    _each_flat_(tensors, lambda flat: comm.all_reduce(flat, algorithm, op="avg", group=group))
