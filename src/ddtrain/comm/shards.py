"""Reduce-scatter and all-gather of one flat buffer cut into per-rank shards, over a chosen algorithm (ZeRO's traffic).

ZeRO's communication is the two phases of the ring all-reduce taken apart: a reduce-scatter of the
gradients (each rank ends with its shard summed over every rank) and, after each rank has stepped
its shard, an all-gather of the parameters. ``reduce_scatter_(flat, algorithm)`` and
``all_gather_(flat, algorithm)`` do them with

- ``ring``: ``ring.reduce_scatter_``/``ring.all_gather_`` themselves (000's share-reduce and share-only
  phases), n-1 steps each, (n-1)/n of the buffer sent per rank per phase;
- ``native``: torch.distributed's ``reduce_scatter_tensor``/``all_gather_into_tensor`` (Gloo and NCCL
  have both), on a copy padded to n equal shards;
- every other algorithm (tree, butterfly, central, ring-async): its all-reduce of the whole buffer,
  of which each rank keeps its shard (a reduce-scatter costs a full all-reduce there: they have no
  reduce-scatter phase of their own to call), then the ring all-gather.

Shards: ``shard_bounds(numel, n)`` cuts the buffer into n pieces of ``ceil(numel / n)`` elements, the
last one shorter (possibly empty), so a padded copy of n equal pieces lines up with them. Which
piece a rank holds after the reduce-scatter depends on the algorithm (``owned_shard``: the ring's
rank r finishes piece r+1), and the all-gather starts from that piece. Traffic is counted under
``zero-reduce-scatter`` and ``zero-all-gather`` (the ring's, counted; native's by formula), or
under the algorithm's name for its all-reduce.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ddtrain import comm
from ddtrain.comm import ring, traffic
from ddtrain.comm.p2p import group_info, open_comm

REDUCE_SCATTER, ALL_GATHER = "zero-reduce-scatter", "zero-all-gather"
# torch 2.13 renamed them (the old names warn); 2.4-2.12 have only the old ones
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_bounds(numel: int, parts: int) -> list[int]:
    """Offsets of ``parts`` shards of ``ceil(numel / parts)`` elements (the last shorter; trailing ones may be empty)."""
    size = math.ceil(numel / parts) if numel else 0
    return [min(i * size, numel) for i in range(parts + 1)]


def owned_shard(algorithm: str, rank: int, size: int) -> int:
    """The shard ``rank`` holds reduced after ``reduce_scatter_`` with ``algorithm`` (the ring's ends one ahead)."""
    return (rank + 1) % size if algorithm == "ring" else rank


def operations(algorithm: str) -> tuple[str, ...]:
    """The traffic operations ZeRO's collectives with ``algorithm`` are counted under (a Ledger's)."""
    return (REDUCE_SCATTER, ALL_GATHER, algorithm)


def _padded(flat: torch.Tensor, size: int) -> torch.Tensor:
    bounds = shard_bounds(flat.numel(), size)
    piece = bounds[1] - bounds[0]
    if piece * size == flat.numel():
        return flat
    out = torch.zeros(piece * size, dtype=flat.dtype, device=flat.device)
    out[:flat.numel()].copy_(flat)
    return out


def _record_formula(name: str, piece_bytes: int, size: int) -> None:
    # what a bandwidth-optimal phase (NCCL's ring) moves per rank; Gloo's reduce_scatter_tensor was seen to move
    # about an all-reduce's bytes on the interface (docs/SHARDING.md: the bench scaling network check)
    nbytes = (size - 1) * piece_bytes
    traffic.record(name, bytes_sent=nbytes, bytes_received=nbytes, messages_sent=size - 1,
                   messages_received=size - 1, method=traffic.FORMULA)


def reduce_scatter_(flat: torch.Tensor, algorithm: str, group=None) -> torch.Tensor:
    """Sum ``flat`` over ``group`` shard by shard; returns this rank's shard (``owned_shard``) of the sum, a new tensor.

    ``flat`` is used as scratch (its other shards hold partial sums afterwards).
    """
    rank, size = group_info(group)
    bounds = shard_bounds(flat.numel(), size)
    mine = owned_shard(algorithm, rank, size)
    lo, hi = bounds[mine], bounds[mine + 1]
    if size == 1:
        return flat.clone()
    if algorithm == "ring":
        ring.reduce_scatter_(flat, "sum", open_comm(REDUCE_SCATTER, group, device=flat.device), bounds)
    elif algorithm == "native":
        padded = _padded(flat, size)
        out = torch.empty(padded.numel() // size, dtype=flat.dtype, device=flat.device)
        _REDUCE_SCATTER(out, padded, op=dist.ReduceOp.SUM, group=group)
        _record_formula(REDUCE_SCATTER, out.numel() * out.element_size(), size)
        return out[:hi - lo].clone()
    else:
        comm.all_reduce(flat, algorithm, op="sum", group=group)
    return flat[lo:hi].clone()


def all_gather_(flat: torch.Tensor, algorithm: str, group=None) -> torch.Tensor:
    """Fill every shard of ``flat`` from the rank that owns it (``owned_shard``); returns ``flat``."""
    rank, size = group_info(group)
    if size == 1:
        return flat
    bounds = shard_bounds(flat.numel(), size)
    mine = owned_shard(algorithm, rank, size)
    if algorithm == "native":
        padded = _padded(flat, size)
        piece = padded.numel() // size
        _ALL_GATHER(padded, padded[mine * piece:(mine + 1) * piece].clone(), group=group)
        _record_formula(ALL_GATHER, piece * padded.element_size(), size)
        if padded is not flat:
            flat.copy_(padded[:flat.numel()])
        return flat
    ring.all_gather_(flat, open_comm(ALL_GATHER, group, device=flat.device), bounds, first=mine - rank)
    return flat
