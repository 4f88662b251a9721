"""What parameter servers and workers exchange, and who holds which parameters.

Sharding: each parameter lives on one server, chosen greedily by size (largest first, to the
server holding the fewest elements so far; ties to the lower server), which balances bytes.

Messages: one per (worker, server) and direction, each a tensor moved by torch.distributed
point-to-point (``ddtrain.comm.p2p``: deadlines and traffic counting). A message is a byte
buffer: a **header** of 8-byte slots (kind, version, aux as int64; then the worker's current
hyper-parameters and, per parameter of the shard, whether it has a gradient, as float64)
followed by the shard's values, so kind, version, hyper-parameters and data travel in one
transfer and a receive never needs to know in advance which kind is coming. Sizes never
change, so no receive can mismatch: the control messages carry a full-size, unused payload.

Worker -> server: GRAD (version = the parameter version the gradient was computed on; the
header carries the hyper-parameters of every param group, read from the worker's optimizer at
that step, so a scheduler on the worker changes what the server applies), HELLO (an async
worker asks for parameters before computing), PAUSE (an async worker will not compute for a
while, e.g. at an epoch end: answered at once, never gated; aux says why, ``PAUSE_REASONS``), STOP (training is over), SET (the
worker's parameters changed outside training, e.g. a checkpoint loaded after ``prepare``: the
server installs them), STATE (send me your optimizer state, for ``optimizer.state_dict()``),
LOAD (install this optimizer state; aux = its size in bytes, the bytes follow in full-size
messages), ADD (another model is being prepared: once every worker has said ADD, all ranks
set it up together). Server -> worker: PARAMS (version = the server's update count), FINAL
(every worker has stopped: the final parameters) or STATE (aux = bytes of the state that follow).

Failure notes go through the job's store, not through messages: after a timed-out wait Gloo
closes *every* connection of the process ("Application timeout caused pair closure"), so a
server that has just timed out on a dead worker can no longer tell the others anything over
the process group. It writes a note to the store instead; a worker whose wait on the server
fails reads it (``FailureNote``) and names the worker the server lost.

Compression (``--compression fp16`` or ``bf16``): every worker -> server message carries its
values in the 16-bit type (``Plan.wire_dtype``), so a gradient costs half the payload bytes
(the header is unchanged); the server widens it back before averaging or applying it. SET's
parameters then travel in full precision as bytes after the header (as LOAD's state does),
never through the 16-bit payload. Server -> worker messages (the parameters) stay full size.
PowerSGD and top-k are refused here (``wire_dtype``): PowerSGD needs the sum of every
worker's P before anyone can compute Q, a round this protocol (one gradient up, parameters
down) does not have; top-k would need a sparse message layout it does not have yet.

Traffic: steps count under the strategy's name ("ps-sync", "ps-async"); STOP/FINAL under
"<name> stop", HELLO/PAUSE and their answers under "<name> control", so a step's bytes can be
compared with the cost model.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.comm import traffic
from ddtrain.comm.p2p import open_comm
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.distributed.job import default_store, restart_attempt

GRAD, PARAMS, STOP, HELLO, FINAL, PAUSE, SET, STATE, LOAD, ADD = range(10)
KIND_NAMES = {GRAD: "GRAD", PARAMS: "PARAMS", STOP: "STOP", HELLO: "HELLO", FINAL: "FINAL", PAUSE: "PAUSE",
              SET: "SET", STATE: "STATE", LOAD: "LOAD", ADD: "ADD"}
# why a worker paused (PAUSE's aux), named by a server that then waits too long for it
EVALUATION, COLLECTIVE, EPOCH_END, REPLICA_CHECK = 1, 2, 3, 4
PAUSE_REASONS = {EVALUATION: "for evaluation", COLLECTIVE: "for a collective among the workers",
                 EPOCH_END: "at the end of an epoch", REPLICA_CHECK: "for a replica check"}
ASIDE = (SET, STATE, LOAD)     # answered at once, outside ps-sync's rounds and ps-async's gate
FIXED_SLOTS = 3                                       # int64 kind, version, aux
STOP_SUFFIX, CONTROL_SUFFIX = " stop", " control"     # traffic apart from the steps
SUFFIX = {GRAD: "", STOP: STOP_SUFFIX, HELLO: CONTROL_SUFFIX, PAUSE: CONTROL_SUFFIX, SET: CONTROL_SUFFIX,
          STATE: CONTROL_SUFFIX, LOAD: CONTROL_SUFFIX, ADD: CONTROL_SUFFIX}
# param-group entries that choose an implementation, not the arithmetic: not sent
IMPLEMENTATION_KEYS = {"params", "foreach", "fused", "differentiable", "capturable"}


def header_bytes(optimizer, shard_parameters: int) -> int:
    """Bytes of one message's header for ``optimizer`` and a server holding ``shard_parameters`` parameters."""
    return 8 * (FIXED_SLOTS + sum(n for _, _, n in hyper_layout(optimizer.param_groups)) + shard_parameters)


def hyper_layout(groups) -> list[tuple[int, str, int]]:
    """(group index, key, slots) of every numeric hyper-parameter in ``groups`` (tuples such as betas: one slot each)."""
    layout = []
    for g, group in enumerate(groups):
        for key, value in group.items():
            if key in IMPLEMENTATION_KEYS:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                layout.append((g, key, 1))
            elif isinstance(value, (bool, int, float)):
                layout.append((g, key, 1))
            elif isinstance(value, tuple) and value and all(isinstance(v, (int, float)) for v in value):
                layout.append((g, key, len(value)))
    return layout


def read_hyper(groups, layout) -> list[float]:
    """The current values of ``layout``'s entries in ``groups``, flat."""
    if len(groups) != 1 + max((g for g, _, _ in layout), default=len(groups) - 1):
        raise DDTrainError(f"ps-sync/ps-async: the optimizer has {len(groups)} param groups now; parameter servers "
                           "need the groups it had at prepare() (add_param_group after prepare is not supported)")
    values = []
    for g, key, n in layout:
        value = groups[g][key]
        values.extend(float(v) for v in value) if n > 1 or isinstance(value, tuple) else values.append(float(value))
    return values


def write_hyper(groups, layout, values) -> None:
    """Set ``layout``'s entries of ``groups`` from ``values``, each in its original type."""
    i = 0
    for g, key, n in layout:
        old = groups[g][key]
        if isinstance(old, tuple):
            groups[g][key] = tuple(type(o)(v) for o, v in zip(old, values[i:i + n]))
        elif isinstance(old, torch.Tensor):
            old.fill_(values[i])
        else:
            groups[g][key] = type(old)(values[i])
        i += n


def assign_shards(sizes: list[int], servers: int) -> list[int]:
    """Server index (0..servers-1) of each parameter: largest first, to the least-loaded server."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i], load[s] = s, load[s] + sizes[i]
    return owner


class Message:
    """One preallocated message: a header of ``slots`` 8-byte slots and a shard's values, in one byte buffer.

    Slots 0-2 are int64 (kind, version, aux); the rest float64 (hyper-parameters, then one
    has-gradient flag per parameter of the shard).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device, slots: int = FIXED_SLOTS):
        size = torch.empty((), dtype=dtype).element_size()
        header_bytes = 8 * slots
        self.buffer = torch.zeros(header_bytes + numel * size, dtype=torch.uint8, device=device)
        self.header = self.buffer[:8 * FIXED_SLOTS].view(torch.int64)
        self.values = self.buffer[8 * FIXED_SLOTS:header_bytes].view(torch.float64)
        self.payload = self.buffer[header_bytes:].view(dtype)
        self.payload_bytes = self.buffer[header_bytes:]

    def read_header(self) -> tuple[int, int]:
        kind, version, _ = self.header.tolist()
        return int(kind), int(version)

    def aux(self) -> int:
        return int(self.header[2].item())

    def set_header(self, kind: int, version: int, aux: int = 0) -> None:
        self.header.copy_(torch.tensor([kind, version, aux], dtype=torch.int64))

    def set_values(self, values) -> None:
        if len(values):
            self.values[:len(values)].copy_(torch.tensor(values, dtype=torch.float64))

    def read_values(self, start: int, count: int) -> list[float]:
        return self.values[start:start + count].tolist()

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
    hyper: list = field(default_factory=list)   # hyper_layout of the optimizer's param groups
    group: object = None         # the process group its messages travel in (None: the default group)
    wire_dtype: torch.dtype | None = None   # worker -> server payloads (--compression fp16/bf16); None: dtype

    @property
    def compressed(self) -> bool:
        """Do worker -> server messages carry their values in a narrower type than the parameters?"""
        return self.wire_dtype is not None and self.wire_dtype != self.dtype

    def slots(self, server_index: int) -> int:
        return FIXED_SLOTS + sum(n for _, _, n in self.hyper) + len(self.shards[server_index])

    def message(self, server_index: int, to_server: bool = False) -> Message:
        """A message for ``server_index``'s shard; ``to_server``: a worker's to it (in ``wire_dtype`` when compressed)."""
        dtype = self.wire_dtype if to_server and self.compressed else self.dtype
        return Message(sum(p.numel() for p in self.shards[server_index]), dtype, self.device,
                       self.slots(server_index))

    def comm(self, timeout_s: float | None = None, suffix: str = ""):
        """A deadline for one exchange; its traffic counts under ``name + suffix``."""
        return open_comm(self.name + suffix, self.group, timeout_s or self.timeout_s, device=self.device)

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


def wire_dtype(spec: str) -> torch.dtype | None:
    """The worker -> server payload type for compression ``spec``; ConfigError for methods servers cannot carry.

    The parameter-server strategies' ``StrategySpec.check``: ``ddtrain.sync.check_options`` runs it
    before anything is built, so the strategy's own calls only map the name to a dtype.
    """
    method = spec.partition(":")[0]
    if method == "none":
        return None
    if method in ("fp16", "bf16"):
        return {"fp16": torch.float16, "bf16": torch.bfloat16}[method]
    raise ConfigError("compression", f"{spec} is not supported with parameter servers (PowerSGD needs every "
                      f"worker's P summed before Q can be computed, a round the servers' protocol does not have; "
                      f"top-k has no sparse message layout there); use fp16 or bf16, or a ring/ddp strategy")


def flat_bytes(tensors) -> torch.Tensor:
    """``tensors`` back to back, as bytes (full precision, whatever ``wire_dtype`` is)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]).view(torch.uint8)


@torch.no_grad()
def unpack_bytes_(tensors, data: torch.Tensor) -> None:
    """The inverse of ``flat_bytes``: copy ``data`` into ``tensors`` (all of one dtype)."""
    values, offset = data.view(tensors[0].dtype), 0
    for t in tensors:
        t.copy_(values[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def make_plan(name: str, module, servers: int, timeout_s: float | None, world: int, optimizer=None) -> Plan:
    """Roles (the last ``servers`` ranks serve) and the greedy sharding of ``module``'s parameters (or a list of them)."""
    params = [p for p in (module.parameters() if hasattr(module, "parameters") else module) if p.requires_grad]
    if not params:
        raise DDTrainError(f"{name}: the model has no trainable parameters")
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        raise DDTrainError(f"{name}: every trainable parameter must have one dtype, got {sorted(map(str, dtypes))}")
    workers = world - servers
    owner = assign_shards([p.numel() for p in params], servers)
    shards = [[p for p, o in zip(params, owner) if o == s] for s in range(servers)]
    return Plan(name, list(range(workers)), list(range(workers, world)), shards, params[0].dtype,
                params[0].device, timeout_s or runtime.timeout_s(),
                hyper=hyper_layout(optimizer.param_groups) if optimizer is not None else [])


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
        self.key = f"ddtrain/{name}/{restart_attempt()}/{next(_notes)}/failed"

    @staticmethod
    def _store():
        try:
            return default_store()
        except Exception:   # a torch without the accessor
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
