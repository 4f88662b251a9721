"""The MPI primitives of document 000 ch. 2, over torch.distributed point-to-point.

Ranks and roots are *group ranks* (as in MPI communicators); with ``group=None`` they are the
global ranks. Every call is collective over the group except ``send``/``recv``; every rank
passes tensors of the same shape and dtype. Block layouts follow MPI: a "stacked" tensor
holds one block per rank along dim 0, in rank order (a 0-d tensor's stack is 1-d).

    send(tensor, dst) / recv(out, src)        blocking point-to-point
    bcast(tensor, root)                       root's tensor to everyone (binomial tree), in place
    scatter(send, out, root)                  block i of root's stacked ``send`` lands in rank i's ``out``
    gather(tensor, out, root)                 every rank's tensor stacked by rank at the root
    allgather(tensor, out)                    the same stack on every rank (ring all-gather)
    reduce(tensor, op, root)                  elementwise reduction at the root (binomial tree)
    alltoall(send, out)                       block j of rank i's ``send`` lands as block i of rank j's ``out``

``reduce`` ops: sum, avg, prod, max, min, land, lor (results are bool), band, bor (integer and
bool dtypes), maxloc, minloc (return ``(values, ranks)``: the extreme value and the lowest group
rank holding it, as MPI breaks ties). Traffic is counted under each primitive's name.
"""
from __future__ import annotations

import torch

from ddtrain.errors import DDTrainError
from ddtrain.comm.ops import REDUCE_OPS, check_device, check_op, combine_
from ddtrain.comm.p2p import exchange, open_comm, sendrecv, wait
from ddtrain.comm.ring import all_gather_
from ddtrain.comm.tree import broadcast_from_root_, reduce_to_root_


def _comm(name, group, timeout_s, tensor):
    if not isinstance(tensor, torch.Tensor):
        raise DDTrainError(f"{name} needs a torch.Tensor, got {type(tensor).__name__}")
    check_device(group, tensor.device, name)
    return open_comm(name, group, timeout_s, device=tensor.device)


def _check_root(comm, root):
    if not 0 <= root < comm.size:
        raise DDTrainError(f"{comm.name}: root {root} is not a rank of a group of {comm.size}")


def _stack_shape(tensor: torch.Tensor, n: int) -> tuple:
    return (n,) if tensor.dim() == 0 else (n * tensor.shape[0], *tensor.shape[1:])


def _stack_out(comm, tensor, out):
    """``out`` checked (or allocated) to hold one block per rank, flattened to (n, block numel)."""
    shape = _stack_shape(tensor, comm.size)
    if out is None:
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif out.numel() != comm.size * tensor.numel() or out.dtype != tensor.dtype or not out.is_contiguous():
        raise DDTrainError(f"{comm.name}: out must be a contiguous {tensor.dtype} tensor of shape {tuple(shape)} "
                           f"(one block per rank), got {out.dtype} {tuple(out.shape)}")
    return out, out.view(comm.size, -1)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def send(tensor: torch.Tensor, dst: int, group=None, *, timeout_s: float | None = None) -> None:
    """Send ``tensor`` to group rank ``dst`` and wait until it has left."""
    comm = _comm("send", group, timeout_s, tensor)
    _check_root(comm, dst)
    sendrecv(comm, sends=[(dst, _contiguous(tensor))], label="send")


def recv(out: torch.Tensor, src: int, group=None, *, timeout_s: float | None = None) -> torch.Tensor:
    """Receive into ``out`` (contiguous) from group rank ``src``; returns ``out``."""
    comm = _comm("recv", group, timeout_s, out)
    _check_root(comm, src)
    if not out.is_contiguous():
        raise DDTrainError("recv: out must be contiguous")
    sendrecv(comm, recvs=[(src, out)], label="recv")
    return out


def bcast(tensor: torch.Tensor, root: int = 0, group=None, *, timeout_s: float | None = None) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with the root's (binomial tree); returns it."""
    comm = _comm("bcast", group, timeout_s, tensor)
    _check_root(comm, root)
    if comm.size > 1:
        work = _contiguous(tensor)
        broadcast_from_root_(comm, [work], root)
        if work is not tensor:
            tensor.copy_(work)
    return tensor


def scatter(send: torch.Tensor | None, out: torch.Tensor, root: int = 0, group=None, *,
            timeout_s: float | None = None) -> torch.Tensor:
    """Rank i's ``out`` receives block i of the root's ``send`` (one block per rank along dim 0)."""
    comm = _comm("scatter", group, timeout_s, out)
    _check_root(comm, root)
    if not out.is_contiguous():
        raise DDTrainError("scatter: out must be contiguous")
    if comm.rank != root:
        sendrecv(comm, recvs=[(root, out)], label="scatter")
        return out
    if send is None or send.numel() != comm.size * out.numel() or send.dtype != out.dtype:
        got = "None" if send is None else f"{send.dtype} {tuple(send.shape)}"
        raise DDTrainError(f"scatter: the root's send must be a {out.dtype} tensor of shape "
                           f"{_stack_shape(out, comm.size)} (one block of {tuple(out.shape)} per rank), got {got}")
    blocks = _contiguous(send).view(comm.size, -1)
    sendrecv(comm, sends=[(p, blocks[p]) for p in range(comm.size) if p != root], label="scatter")
    out.view(-1).copy_(blocks[root])
    return out


def gather(tensor: torch.Tensor, out: torch.Tensor | None = None, root: int = 0, group=None, *,
           timeout_s: float | None = None) -> torch.Tensor | None:
    """Every rank's ``tensor`` stacked in rank order at the root (returned there; None elsewhere)."""
    comm = _comm("gather", group, timeout_s, tensor)
    _check_root(comm, root)
    tensor = _contiguous(tensor)
    if comm.rank != root:
        sendrecv(comm, sends=[(root, tensor)], label="gather")
        return None
    out, blocks = _stack_out(comm, tensor, out)
    sendrecv(comm, recvs=[(p, blocks[p]) for p in range(comm.size) if p != root], label="gather")
    blocks[root].copy_(tensor.view(-1))
    return out


def allgather(tensor: torch.Tensor, out: torch.Tensor | None = None, group=None, *,
              timeout_s: float | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked in rank order, on every rank (ring all-gather)."""
    comm = _comm("allgather", group, timeout_s, tensor)
    out, blocks = _stack_out(comm, _contiguous(tensor), out)
    blocks[comm.rank].copy_(tensor.reshape(-1))
    k = tensor.numel()
    if comm.size > 1:
        all_gather_(out.view(-1), comm, [i * k for i in range(comm.size + 1)], first=0, phase="allgather")
    return out


def alltoall(send: torch.Tensor, out: torch.Tensor | None = None, group=None, *,
             timeout_s: float | None = None) -> torch.Tensor:
    """Block j of this rank's ``send`` goes to rank j; ``out`` holds the blocks received, in rank order."""
    comm = _comm("alltoall", group, timeout_s, send)
    n, r = comm.size, comm.rank
    if send.dim() == 0 or send.shape[0] % n:
        raise DDTrainError(f"alltoall: send needs one block per rank along dim 0 (a multiple of {n} rows), "
                           f"got shape {tuple(send.shape)}")
    send = _contiguous(send)
    sent = send.view(n, -1)
    if out is None:
        out = torch.empty_like(send)
    elif out.shape != send.shape or out.dtype != send.dtype or not out.is_contiguous():
        raise DDTrainError(f"alltoall: out must be a contiguous {send.dtype} tensor of shape {tuple(send.shape)}")
    got = out.view(n, -1)
    peers = [p for p in range(n) if p != r]
    pending = exchange(comm, sends=[(p, sent[p]) for p in peers], recvs=[(p, got[p]) for p in peers],
                       label="alltoall")
    got[r].copy_(sent[r])
    wait(comm, pending)
    return out


def reduce(tensor: torch.Tensor, op: str = "sum", root: int = 0, group=None, *,
           timeout_s: float | None = None):
    """Elementwise reduction of every rank's ``tensor`` at the root (binomial tree); ``tensor`` is not modified.

    Returns the result at the root -- a ``(values, ranks)`` pair for maxloc/minloc -- and None elsewhere.
    """
    comm = _comm("reduce", group, timeout_s, tensor)
    _check_root(comm, root)
    check_op(op, tensor.dtype, REDUCE_OPS, "reduce")
    if op in ("land", "lor"):
        acc = [tensor.to(torch.bool).reshape(-1).clone()]
    elif op in ("maxloc", "minloc"):
        acc = [tensor.reshape(-1).clone(), torch.full((tensor.numel(),), comm.rank, dtype=torch.int64,
                                                      device=tensor.device)]
    else:
        acc = [tensor.reshape(-1).clone()]
    if op in ("maxloc", "minloc"):
        better = torch.gt if op == "maxloc" else torch.lt

        def fold(mine, theirs):
            take = better(theirs[0], mine[0]) | ((theirs[0] == mine[0]) & (theirs[1] < mine[1]))
            mine[0].copy_(torch.where(take, theirs[0], mine[0]))
            mine[1].copy_(torch.where(take, theirs[1], mine[1]))
    else:
        combine = combine_(op)

        def fold(mine, theirs):
            combine(mine[0], theirs[0])

    if comm.size > 1:
        reduce_to_root_(comm, acc, fold, root)
    if comm.rank != root:
        return None
    if op == "avg":
        acc[0].div_(comm.size)
    values = acc[0].view(tensor.shape)
    return (values, acc[1].view(tensor.shape)) if op in ("maxloc", "minloc") else values
