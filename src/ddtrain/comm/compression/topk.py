"""``topk:FRACTION``: send only the largest-magnitude FRACTION of each gradient tensor, with error feedback.

Top-k sparsification with error feedback (memory), as Stich, Cordonnier & Jaggi, "Sparsified
SGD with memory" (NeurIPS 2018) and Lin et al.'s Deep Gradient Compression (ICLR 2018), per
layer: each rank adds the error it kept to its gradient, picks in every tensor the
``k = ceil(FRACTION·numel)`` entries of largest magnitude, keeps the rest as the next step's
error, and sends (values, int32 indices into the buffer). Different ranks pick different
entries, so sparse vectors cannot be summed on the way: every rank's pairs are all-gathered
(``comm.allgather``, the ring; whatever ``--algorithm``/strategy reduces the other methods),
and each rank scatter-adds all of them, in rank order, and divides by R -- the same bits on
every rank.

Bytes per rank and step: the ring all-gather of Σk values and Σk indices, ``(R-1)·Σk·(4 + 4)``
for float32 gradients. It saves bytes over the all-reduce's ``2(R-1)/R·N·4`` only when
``Σk < N/R``; the traffic grows with R, the known limit of all-gather sparsification.
"""
from __future__ import annotations

import math

import torch

from ddtrain.comm import primitives
from ddtrain.comm.compression.cast import group_size
from ddtrain.comm.compression.memory import BucketMemory, check_pieces, tensor_keys
from ddtrain.comm.compression.volume import allgather_bytes, numel

INDEX_BYTES = 4     # int32 indices: a buffer holds fewer than 2**31 elements


def parse(text: str) -> float:
    """``"0.01"`` -> 0.01; ValueError unless 0 < FRACTION <= 1."""
    try:
        fraction = float(text)
    except ValueError:
        raise ValueError(f"compression topk:{text}: write topk:FRACTION with a number in (0, 1], "
                         "e.g. topk:0.01") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"compression topk:{text}: the fraction must be in (0, 1], got {fraction:g}")
    return fraction


def kept(size: int, fraction: float) -> int:
    """Entries sent of a tensor of ``size`` elements: ceil(FRACTION·size) (at least one of a non-empty tensor)."""
    return min(size, math.ceil(fraction * size))


def wire_bytes(shapes, world: int, argument: float = 0.01, element_size: int = 4) -> float:
    """(R-1)·Σk·(element size + 4): the ring all-gather of every tensor's k values and int32 indices."""
    k = sum(kept(numel(s), argument) for s in shapes)
    return allgather_bytes(k * (element_size + INDEX_BYTES), world)


class TopK:
    """Top-k state of one model: the error (what was not sent) of every gradient tensor, per rank."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        self.error = BucketMemory()

    def all_reduce_(self, flat: torch.Tensor, shapes, *, algorithm: str = "native", group=None, key=0, keys=None,
                    last: bool = True, timeout_s: float | None = None) -> torch.Tensor:
        """Average the sparsified ``flat`` (gradients of ``shapes`` back to back) over ``group``, in place.

        ``keys`` name the tensors of ``shapes`` for the error kept between steps (``memory``).
        """
        world = group_size(group)
        sizes = [numel(s) for s in shapes]
        error = self.error.get(key, tuple(zip(tensor_keys(key, len(shapes), keys), sizes)), flat, zeros=True)
        flat.add_(error)
        picked, offset = [], 0
        for size in sizes:
            k = kept(size, self.fraction)
            if k:
                top = torch.topk(flat[offset:offset + size].abs(), k, sorted=False).indices
                picked.append(top.add_(offset))
            offset += size
        indices = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.int64, device=flat.device)
        values = flat[indices]
        error.copy_(flat)
        error[indices] = 0                          # what was sent leaves the memory; the rest waits
        if world == 1:
            return flat.sub_(error)
        all_values = primitives.allgather(values, group=group, timeout_s=timeout_s)
        all_indices = primitives.allgather(indices.to(torch.int32), group=group, timeout_s=timeout_s)
        flat.zero_()
        flat.index_add_(0, all_indices.reshape(-1).long(), all_values.reshape(-1))
        return flat.div_(world)

    def state_dict(self) -> dict:
        """This rank's error, per tensor (``error``: what differs per rank; ``merge_states`` averages it)."""
        return {"error": self.error.state_dict()}

    def load_state_dict(self, state: dict, shapes: dict | None = None) -> None:
        """Take back ``state_dict()``; ``shapes`` (tensor key -> shape), when given, must fit every piece."""
        error = dict(state.get("error", {}))
        check_pieces(error, shapes, lambda shape: numel(shape), "error feedback")
        self.error.load_state_dict(error)
