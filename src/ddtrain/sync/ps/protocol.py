"""What parameter servers and workers exchange, and who holds which parameters.

Sharding: each parameter lives on one server, chosen greedily by size (largest first, to the
server holding the fewest elements so far; ties to the lower server), which balances bytes.

Messages: one per (worker, server) and direction, each a tensor moved by torch.distributed
point-to-point (``ddtrain.comm.p2p``: deadlines and traffic counting). A message is a byte
buffer: a **16-byte header** of two int64 (kind, version) followed by the shard's values,
so kind, version and data travel in one transfer and a receive never needs to know in
advance which kind is coming. Sizes never change, so no receive can mismatch: the control
messages (HELLO, PAUSE, STOP) carry a full-size, unused payload.

Worker -> server: GRAD (version = the parameter version the gradient was computed on),
HELLO (an async worker asks for parameters before computing), PAUSE (an async worker will
not compute for a while, e.g. at an epoch end: answered at once, never gated), STOP
(training is over). Server -> worker: PARAMS (version = the server's update count) or FINAL
(every worker has stopped: the final parameters).

Failure notes go through the job's store, not through messages: after a timed-out wait Gloo
closes *every* connection of the process ("Application timeout caused pair closure"), so a
server that has just timed out on a dead worker can no longer tell the others anything over
the process group. It writes a note to the store instead; a worker whose wait on the server
fails reads it (``FailureNote``) and names the worker the server lost.

Traffic: steps count under the strategy's name ("ps-sync", "ps-async"); STOP/FINAL under
"<name> stop", HELLO/PAUSE and their answers under "<name> control", so a step's bytes can be
compared with the cost model.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddtrain.dist import runtime
from ddtrain.comm import traffic
from ddtrain.comm.p2p import open_comm
from ddtrain.errors import DDTrainError

GRAD, PARAMS, STOP, HELLO, FINAL, PAUSE = range(6)
KIND_NAMES = {GRAD: "GRAD", PARAMS: "PARAMS", STOP: "STOP", HELLO: "HELLO", FINAL: "FINAL", PAUSE: "PAUSE"}
HEADER_BYTES = 16                                     # int64 kind, int64 version
STOP_SUFFIX, CONTROL_SUFFIX = " stop", " control"     # traffic apart from the steps
SUFFIX = {GRAD: "", STOP: STOP_SUFFIX, HELLO: CONTROL_SUFFIX, PAUSE: CONTROL_SUFFIX}


def assign_shards(sizes: list[int], servers: int) -> list[int]:
    """Server index (0..servers-1) of each parameter: largest first, to the least-loaded server."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i], load[s] = s, load[s] + sizes[i]
    return owner


class Message:
    """One preallocated message: a header (kind, version) and a shard's values, in one byte buffer."""

    def __init__(self, numel: int, dtype: torch.dtype, device):
        size = torch.empty((), dtype=dtype).element_size()
        self.buffer = torch.zeros(HEADER_BYTES + numel * size, dtype=torch.uint8, device=device)
        self.header = self.buffer[:HEADER_BYTES].view(torch.int64)
        self.payload = self.buffer[HEADER_BYTES:].view(dtype)

    def read_header(self) -> tuple[int, int]:
        kind, version = self.header.tolist()
        return int(kind), int(version)

    def set_header(self, kind: int, version: int) -> None:
        self.header.copy_(torch.tensor([kind, version], dtype=torch.int64))

    @torch.no_grad()
    def pack_(self, tensors, grads: bool = False) -> None:
        offset = 0
        for t in tensors:
            n = t.numel()
            source = t.grad if grads else t
            if source is None:
                self.payload[offset:offset + n].zero_()
            else:
                self.payload[offset:offset + n].copy_(source.detach().reshape(-1))
            offset += n

    @torch.no_grad()
    def unpack_(self, tensors) -> None:
        offset = 0
        for t in tensors:
            t.copy_(self.payload[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


@dataclass
class Plan:
    """Who is who, and which parameters each server holds (the same on every rank)."""

    name: str                    # "ps-sync" or "ps-async": the traffic operation and error prefix
    workers: list[int]           # global ranks
    servers: list[int]           # global ranks
    shards: list[list[torch.nn.Parameter]]   # per server, in model order
    dtype: torch.dtype
    device: torch.device
    timeout_s: float
    pairs: dict | None = None    # ps-async on NCCL: (worker, server) -> that pair's own process group

    def message(self, server_index: int) -> Message:
        return Message(sum(p.numel() for p in self.shards[server_index]), self.dtype, self.device)

    def comm(self, timeout_s: float | None = None, suffix: str = ""):
        """A deadline for one exchange; its traffic counts under ``name + suffix``."""
        return open_comm(self.name + suffix, None, timeout_s or self.timeout_s, device=self.device)

    def route(self, comm, worker: int, server: int):
        """(comm, peer group rank) for one transfer between ``worker`` and ``server``.

        Without pairs: ``comm`` itself and the other side's global rank. With pairs (ps-async on
        NCCL, see ``ps_async``): the pair's own group, so its transfers run on their own NCCL
        stream instead of queueing behind receives posted for other workers.
        """
        me = dist.get_rank() if dist.is_initialized() else worker
        if self.pairs is None:
            return comm, (server if me == worker else worker)
        pair = open_comm(comm.name, self.pairs[(worker, server)], comm.timeout_s, device=self.device)
        pair.deadline = comm.deadline
        return pair, (1 if me == worker else 0)     # servers are the last ranks: worker < server

    def operations(self) -> tuple[str, ...]:
        return (self.name, self.name + STOP_SUFFIX, self.name + CONTROL_SUFFIX)


def make_plan(name: str, module, servers: int, timeout_s: float | None, world: int) -> Plan:
    """Roles (the last ``servers`` ranks serve) and the greedy sharding of ``module``'s parameters."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise DDTrainError(f"{name}: the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise DDTrainError(f"{name}: every trainable parameter must have one dtype, got {sorted(map(str, dtypes))}")
    workers = world - servers
    owner = assign_shards([p.numel() for p in params], servers)
    shards = [[p for p, o in zip(params, owner) if o == s] for s in range(servers)]
    return Plan(name, list(range(workers)), list(range(workers, world)), shards, params[0].dtype,
                params[0].device, timeout_s or runtime.timeout_s())


def reattribute(operation: str, suffix: str, nbytes: int, messages: int) -> None:
    """Move received traffic from ``operation`` to ``operation + suffix`` once we know what it was.

    A server posts its receives before it knows whether a worker will send a gradient or a
    control message; the per-step counters should only hold the steps.
    """
    traffic.record(operation, bytes_received=-nbytes, messages_received=-messages)
    traffic.record(operation + suffix, bytes_received=nbytes, messages_received=messages)


_notes = itertools.count()      # every rank applies a ps strategy the same number of times


class FailureNote:
    """One line in the job's store saying which worker a server lost (see the module docstring)."""

    def __init__(self, name: str):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key = f"ddtrain/{name}/{attempt}/{next(_notes)}/failed"

    @staticmethod
    def _store():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception:   # no default group, or a torch without the accessor
            return None

    def post(self, text: str) -> None:
        store = self._store()
        if store is not None:
            try:
                store.set(self.key, text)
            except Exception:   # the note is a courtesy; the server fails anyway
                pass

    def read(self, wait_s: float) -> str | None:
        """The note, looking for up to ``wait_s`` seconds; None if there is none."""
        store = self._store()
        if store is None:
            return None
        deadline = time.monotonic() + wait_s
        try:
            while not store.check([self.key]):
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.05)
            return store.get(self.key).decode()
        except Exception:   # the store went away with rank 0: no note
            return None
