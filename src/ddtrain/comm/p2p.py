"""Point-to-point exchanges with deadlines and traffic counting: the one way comm/ moves bytes.

Every algorithm is written in *group ranks* (0..n-1 of its process group) and calls
``exchange(comm, sends, recvs, label)`` then ``wait(comm, pending)``. On CUDA tensors the
transfers of one exchange are posted together with ``torch.distributed.batch_isend_irecv``
(global ranks; one NCCL group call, so a send and a receive with the same peer cannot
deadlock). On CPU tensors (Gloo, whose sends and receives are independent anyway) they go
straight to the group's ``ProcessGroup.send``/``recv`` in group ranks: the same transfers
without the Python bookkeeping of ``batch_isend_irecv``, which made each step about three
times slower on Gloo. Empty transfers are skipped (both sides compute the same sizes, so
both skip); traffic is counted and the timeline hooks fed.

Deadlines: one per collective call (``Comm.deadline``). On Gloo every wait is
``work.wait(timeout=remaining)`` and a miss raises :class:`CommError` naming the operation,
the step and the peer. On NCCL an explicit timeout would block the CPU thread until the GPU
finishes each step (killing the overlap of kernels with transfers), so there the wait only
orders the current CUDA stream after the transfer and the process group's watchdog
(``init(timeout_s=...)``) is the deadline.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.comm import traffic


# Tests set this to run the CUDA code path (batched posting, waits that leave the deadline to
# the process group) on Gloo with CPU tensors, so that CI without GPUs exercises it too.
GPU_PATH_ON_CPU = False


class CommError(DDTrainError):
    """A transfer failed or missed its deadline; the message names operation, step and peer."""


def default_timeout_s() -> float:
    """The deadline of one collective: ddtrain.init()'s timeout, else DDTRAIN_TIMEOUT_S, else 300 s."""
    from ddtrain.distributed import runtime
    return runtime.deadline_s()


@dataclass
class Comm:
    """One collective call's view of its process group."""

    name: str                 # operation name, for traffic counters and error messages
    group: object             # the torch ProcessGroup (None: the default group)
    ranks: list[int]          # global rank of each group rank
    rank: int                 # this process's group rank
    size: int
    timeout_s: float
    deadline: float           # time.monotonic() by which the whole call must finish
    blocking_waits: bool      # False on CUDA tensors (see the module docstring)
    process_group: object = None   # the ProcessGroup object (direct send/recv on CPU tensors)


def group_info(group) -> tuple[int, int]:
    """(group rank, group size) of this process; (0, 1) without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise DDTrainError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise DDTrainError(f"this process (global rank {dist.get_rank()}) is not a member of the group")
    return rank, dist.get_world_size(group)


def open_comm(name: str, group=None, timeout_s: float | None = None, device=None) -> Comm:
    """Describe ``group`` for one call named ``name`` with a deadline ``timeout_s`` from now."""
    rank, size = group_info(group)
    timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise DDTrainError(f"{name}: timeout must be positive, got {timeout_s}")
    pg = (group if group is not None else dist.group.WORLD) if size > 1 else None
    ranks = dist.get_process_group_ranks(pg) if size > 1 else [rank]
    cuda = GPU_PATH_ON_CPU or (device is not None and torch.device(device).type == "cuda")
    return Comm(name, group, ranks, rank, size, timeout_s, time.monotonic() + timeout_s, not cuda, pg)


def _who(comm: Comm, peer: int) -> str:
    glob = comm.ranks[peer]
    return f"rank {peer}" if glob == peer else f"group rank {peer} (global rank {glob})"


@dataclass
class Pending:
    """Transfers posted by one ``exchange`` and not yet waited for."""

    label: str
    works: list
    items: list                          # (direction, group peer, nbytes) per posted transfer
    start_s: float = 0.0
    done: bool = field(default=False)
    comm: object = None                  # the Comm they were posted on


def exchange(comm: Comm, sends=(), recvs=(), label: str = "") -> Pending:
    """Post ``sends`` [(peer, tensor)] and ``recvs`` [(peer, tensor)] together; peers are group ranks.

    Several transfers with the same peer in the same direction match in list order. Empty
    tensors are skipped. Tensors must be contiguous and must not be touched until ``wait``.
    """
    posts, items = [], []
    start = time.time() if traffic.HOOKS else 0.0
    # Receives first: on Gloo over TCP a pairwise exchange whose send is posted first ran at
    # half the link rate in the emulated cluster (0.48 of the link against 0.85-0.90).
    for direction, pairs in (("recv", recvs), ("send", sends)):
        for peer, tensor in pairs:
            if tensor.numel() == 0:
                continue
            if peer == comm.rank or not 0 <= peer < comm.size:
                raise CommError(f"{comm.name}: {label}: invalid peer {peer} for rank {comm.rank} of {comm.size}")
            if tensor.is_complex():
                tensor = torch.view_as_real(tensor)
            items.append((direction, peer, tensor.numel() * tensor.element_size()))
            posts.append((direction, peer, tensor))
    if posts and (GPU_PATH_ON_CPU or any(t.is_cuda for _, _, t in posts)):   # one NCCL group call per exchange
        # NCCL knows fewer dtypes than torch (no int16, for one); it moves bytes all the same.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if d == "send" else dist.irecv, _as_bytes(t),
                                                   comm.ranks[p], group=comm.group) for d, p, t in posts])
    else:                                      # Gloo: straight to the ProcessGroup, in group ranks
        pg = comm.process_group
        works = [pg.send([t], p, 0) if d == "send" else pg.recv([t], p, 0) for d, p, t in posts]
    return Pending(label, works, items, start, comm=comm)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as uint8 (a one-element tensor may carry any stride; give it 1)."""
    flat = t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def wait(comm: Comm, pending: Pending) -> None:
    """Wait for every transfer of ``pending`` before the call's deadline; count it."""
    if pending.done:
        return
    # Gloo gives one work per transfer; NCCL one for the whole coalesced group.
    per_item = len(pending.works) == len(pending.items)
    for i, work in enumerate(pending.works):
        items = [pending.items[i]] if per_item else pending.items
        _wait_one(comm, work, pending.label, items)
    pending.done = True
    if not pending.items:
        return
    sent = [n for d, _, n in pending.items if d == "send"]
    received = [n for d, _, n in pending.items if d == "recv"]
    traffic.record(comm.name, bytes_sent=sum(sent), bytes_received=sum(received),
                   messages_sent=len(sent), messages_received=len(received))
    if traffic.HOOKS:
        end = time.time()
        for direction, peer, nbytes in pending.items:
            traffic.emit(traffic.Span(f"{comm.name} {pending.label}".strip(), pending.start_s, end,
                                      comm.ranks[peer], nbytes, direction))


def _describe(comm: Comm, label: str, items) -> tuple[str, str]:
    what = " and ".join(f"{'send to' if d == 'send' else 'receive from'} {_who(comm, p)}" for d, p, _ in items)
    return (f"{comm.name}: {label}: " if label else f"{comm.name}: "), what


def _wait_one(comm: Comm, work, label: str, items) -> None:
    if not comm.blocking_waits:
        try:
            work.wait()
        except Exception as exc:  # the watchdog's abort, a closed connection, ...
            where, what = _describe(comm, label, items)
            raise CommError(f"{where}failed to {what}: {exc}") from exc
        return
    remaining = comm.deadline - time.monotonic()
    if remaining <= 0:
        where, what = _describe(comm, label, items)
        raise CommError(f"{where}deadline of {comm.timeout_s:g}s passed before waiting to {what}")
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=remaining))
    except Exception as exc:
        where, what = _describe(comm, label, items)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise CommError(f"{where}timed out after {comm.timeout_s:g}s waiting to {what}") from exc
        raise CommError(f"{where}failed to {what}: {exc}") from exc
    if ok is False:
        where, what = _describe(comm, label, items)
        raise CommError(f"{where}timed out after {comm.timeout_s:g}s waiting to {what}")


def sendrecv(comm: Comm, sends=(), recvs=(), label: str = "") -> None:
    """``exchange`` then ``wait``: one blocking step."""
    wait(comm, exchange(comm, sends, recvs, label))
