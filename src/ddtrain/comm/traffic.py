"""How much this rank sent and received: messages and payload bytes, per operation.

Every algorithm in ``ddtrain.comm`` reports here, so a training run or a benchmark can say
what its synchronisation cost on the wire (document 002 measured packets per node; 000
counted messages per epoch).

What is counted:

* A **message** is one point-to-point transfer of one non-empty tensor between two ranks:
  one ``isend`` on the sender and its matching ``irecv`` on the receiver. Transfers of zero
  elements are never posted, so they are not counted. A message is counted when its wait
  completes (a transfer that timed out is not counted).
* **Bytes** are payload bytes (``numel * element_size``), not wire bytes: the transport's
  headers (TCP/IP, Gloo's or NCCL's own framing) are not included.
* ``native`` (the backend's own all-reduce) cannot be observed from Python. It is reported by
  formula, as the bandwidth-optimal ring would move it: ``2(n-1)/n * N`` bytes sent and the same
  received per rank, in ``2(n-1)`` messages. Such entries carry ``method="formula"``; entries
  that were observed carry ``method="counted"``; a mix says ``"counted+formula"``.

Counters are per process (= per rank) and per operation name ("ring", "tree", "bcast", ...).
``snapshot()`` reads them, ``reset()`` zeroes them, ``measure()`` captures one region.
``all_ranks()`` collects every rank's snapshot (through the store-free object collective, not
counted).

Timeline hooks: ``add_hook(fn)`` registers ``fn(span)`` to receive a :class:`Span` for every
message (name, start_s, end_s, peer, nbytes, direction) -- issue 6's timelines use this. With no
hook registered, no clock is read and nothing is built, so the hook costs nothing.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, fields
from typing import NamedTuple
from collections.abc import Callable, Iterator

COUNTED, FORMULA = "counted", "formula"


@dataclass
class Counts:
    """Traffic of one operation (or of all of them) on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    method: str = COUNTED

    def add(self, other: Counts) -> None:
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.messages_sent += other.messages_sent
        self.messages_received += other.messages_received
        self.method = _merge_method(self.method, other.method)

    def minus(self, before: Counts) -> Counts:
        return Counts(self.bytes_sent - before.bytes_sent, self.bytes_received - before.bytes_received,
                      self.messages_sent - before.messages_sent,
                      self.messages_received - before.messages_received, self.method)

    def is_zero(self) -> bool:
        return not (self.bytes_sent or self.bytes_received or self.messages_sent or self.messages_received)


@dataclass
class Snapshot(Counts):
    """Totals over all operations plus the per-operation breakdown (``by_operation``)."""

    by_operation: dict[str, Counts] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(Counts)}
        out["by_operation"] = {name: {f.name: getattr(c, f.name) for f in fields(Counts)}
                               for name, c in sorted(self.by_operation.items())}
        return out


class Span(NamedTuple):
    """One message as seen by this rank, for timelines.

    ``start_s``/``end_s`` are ``time.time()`` when the transfer was posted and when its wait
    returned (on CUDA: when the wait was enqueued, not when the GPU finished). ``peer`` is the
    peer's *global* rank; ``direction`` is "send" or "recv"; ``name`` is e.g.
    ``"ring reduce-scatter step 2"``.
    """

    name: str
    start_s: float
    end_s: float
    peer: int
    nbytes: int
    direction: str


def _merge_method(a: str, b: str) -> str:
    return a if a == b else "counted+formula"


_lock = threading.Lock()
_by_operation: dict[str, Counts] = {}
HOOKS: list[Callable[[Span], None]] = []   # read by the senders; empty means no timing at all


def record(operation: str, *, bytes_sent: int = 0, bytes_received: int = 0, messages_sent: int = 0,
           messages_received: int = 0, method: str = COUNTED) -> None:
    """Add traffic to ``operation``'s counters (called by the algorithms, not by users)."""
    with _lock:
        counts = _by_operation.get(operation)
        if counts is None:
            counts = _by_operation[operation] = Counts(method=method)
        counts.add(Counts(bytes_sent, bytes_received, messages_sent, messages_received, method))


def snapshot() -> Snapshot:
    """This rank's counters since the last ``reset()``: totals and per operation."""
    with _lock:
        per_op = {name: Counts(c.bytes_sent, c.bytes_received, c.messages_sent, c.messages_received,
                               c.method) for name, c in _by_operation.items()}
    return _total(per_op)


def reset() -> None:
    """Zero every counter of this rank."""
    with _lock:
        _by_operation.clear()


def difference(after: Snapshot, before: Snapshot) -> Snapshot:
    """What happened between two snapshots."""
    per_op = {}
    for name, counts in after.by_operation.items():
        delta = counts.minus(before.by_operation.get(name, Counts(method=counts.method)))
        if not delta.is_zero():
            per_op[name] = delta
    return _total(per_op)


def _total(per_op: dict[str, Counts]) -> Snapshot:
    methods = {c.method for c in per_op.values()}
    out = Snapshot(by_operation=per_op, method=methods.pop() if len(methods) == 1 else
                   ("counted+formula" if methods else COUNTED))
    for counts in per_op.values():
        out.add(counts)
    return out


@contextlib.contextmanager
def measure() -> Iterator[Snapshot]:
    """``with measure() as m: ...`` -- afterwards ``m`` holds the traffic of the block.

    The yielded snapshot is filled in when the block exits (it reads zero inside it). Other
    threads' traffic during the block is included (the counters are per process).
    """
    result = Snapshot()
    before = snapshot()
    try:
        yield result
    finally:
        delta = difference(snapshot(), before)
        for f in fields(Snapshot):
            setattr(result, f.name, getattr(delta, f.name))


def add_hook(fn: Callable[[Span], None]) -> None:
    """Call ``fn(span)`` for every message from now on (see :class:`Span`)."""
    HOOKS.append(fn)


def remove_hook(fn: Callable[[Span], None]) -> None:
    """Stop calling ``fn``; unknown hooks are ignored."""
    with contextlib.suppress(ValueError):
        HOOKS.remove(fn)


def emit(span: Span) -> None:
    """Hand ``span`` to every hook (callers check ``HOOKS`` first, so this is never free-running)."""
    for fn in list(HOOKS):
        fn(span)


def all_ranks(group=None) -> list[dict]:
    """Every rank's ``snapshot().as_dict()``, in group-rank order (a collective: all ranks call it).

    Uses ``all_gather_object``; that bookkeeping traffic is not counted.
    """
    import torch.distributed as dist

    mine = snapshot().as_dict()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [mine]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, mine, group=group)
    return out
