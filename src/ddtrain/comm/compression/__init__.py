"""Gradient compression written once over ``ddtrain.comm``: one module per method, one record each in ``COMPRESSIONS``.

A method is named by a spec string, the ``--compression`` word: ``none``, ``fp16``, ``bf16``,
``powersgd:RANK`` (optionally ``powersgd:RANK:WARMUP_STEPS``) or ``topk:FRACTION``.
``build(spec)`` returns a compressor (a small stateful object, one per model) whose
``all_reduce_(flat, shapes, algorithm=..., group=..., key=..., last=...)`` averages the flat
gradient buffer ``flat`` (the parameters' gradients of ``shapes``, back to back) over the group
the way the method prescribes, in place, sending the compressed tensors through a ``ddtrain.comm``
all-reduce (or all-gather), so every algorithm and the traffic counters see what really travels.
``key`` names the buffer (a DDP bucket index) and ``keys`` its tensors (DDP's hook passes each
parameter's position in the model) for the state kept between steps (error feedback, PowerSGD's
Q); ``last`` says the step's last buffer (PowerSGD counts its warm-up steps by it).

A compressor's ``state_dict()`` / ``load_state_dict(state, shapes)`` save and restore that state
for checkpoints, per tensor (``memory``: independent of how DDP cut the model into buckets), so a
resumed run at the same size equals its uninterrupted twin bit for bit. The contract that lets a
checkpoint change size: what differs per rank is under ``"error"`` (tensor key -> tensor), the
rest of the state is the same on every rank; ``merge_states`` makes one state of several ranks'.

Every record carries ``wire_bytes(shapes, world, argument, element_size=4)``: the published
formula of the bytes one rank sends per step (after any warm-up), the mean over the ranks
(``volume`` says why that mean is the same for every all-reduce algorithm).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from ddtrain.comm.compression import cast, memory, powersgd, topk
from ddtrain.comm.compression.volume import allgather_bytes, allreduce_bytes, numel

SPECS = "none, fp16, bf16, powersgd:RANK[:WARMUP_STEPS] or topk:FRACTION"


@dataclass(frozen=True, kw_only=True)
class Compression:
    """One gradient compression method, as every other package sees it."""

    name: str                                 # the word before the ':' of --compression
    build: Callable | None                    # (argument) -> a compressor with all_reduce_(); None: no compression
    wire_bytes: Callable[..., float]          # (shapes, world, argument, element_size=4) -> bytes one rank sends per step
    parse: Callable[[str], object]            # the text after ':' (or "") -> the argument; ValueError naming the problem
    error_feedback: bool = False              # keeps what it did not send and adds it to the next step's gradient
    collective: str = "all-reduce"            # what carries it: "all-reduce" (the chosen algorithm) or "all-gather"
    summary: str = ""                         # one line for docs and --help


def _no_argument(name: str):
    def parse(text: str):
        if text:
            raise ValueError(f"compression {name}:{text}: {name} takes no argument; use {name!r}")
        return None
    return parse


def _none_bytes(shapes, world: int, argument=None, element_size: int = 4) -> float:
    return allreduce_bytes(sum(numel(s) for s in shapes) * element_size, world)


COMPRESSIONS: dict[str, Compression] = {}


def register_compression(record: Compression) -> Compression:
    """Add ``record`` to ``COMPRESSIONS`` (a new method from outside the package needs only this call)."""
    COMPRESSIONS[record.name] = record
    return record


for _record in (
    Compression(name="none", build=None, wire_bytes=_none_bytes, parse=_no_argument("none"),
                summary="full-precision gradients (2(R-1)/R·N bytes per rank and step)"),
    Compression(name="fp16", build=lambda _: cast.Cast("fp16"), wire_bytes=cast.wire_bytes, parse=_no_argument("fp16"),
                summary="gradients cast to float16 (divided by R first), summed, cast back: half the bytes"),
    Compression(name="bf16", build=lambda _: cast.Cast("bf16"), wire_bytes=cast.wire_bytes, parse=_no_argument("bf16"),
                summary="gradients cast to bfloat16 (divided by R first), summed, cast back: half the bytes"),
    Compression(name="powersgd", build=lambda arg: powersgd.PowerSGD(*arg), wire_bytes=powersgd.wire_bytes,
                parse=powersgd.parse, error_feedback=True,
                summary="PowerSGD (Vogels et al. 2019): rank-r factors P, Q of each matrix, error feedback, warm start"),
    Compression(name="topk", build=lambda arg: topk.TopK(arg), wire_bytes=topk.wire_bytes, parse=topk.parse,
                error_feedback=True, collective="all-gather",
                summary="the largest FRACTION of each gradient tensor (values + int32 indices), error feedback"),
):
    register_compression(_record)


def parse_spec(spec: str) -> tuple[Compression, object]:
    """``"powersgd:4"`` -> (the powersgd record, its argument); ValueError("compression ...") naming what is wrong."""
    if not isinstance(spec, str):
        raise ValueError(f"compression must be a string ({SPECS}), got {spec!r}")
    name, _, text = spec.partition(":")
    record = COMPRESSIONS.get(name)
    if record is None:
        raise ValueError(f"compression must be one of {SPECS}; got {spec!r}")
    return record, record.parse(text)


def check_spec(spec: str) -> None:
    """Raise ValueError("compression ...") unless ``spec`` names a method with a valid argument."""
    parse_spec(spec)


def build(spec: str):
    """A fresh compressor for ``spec`` (one per model: it keeps per-buffer state), or None for ``none``."""
    record, argument = parse_spec(spec)
    return None if record.build is None else record.build(argument)


def merge_states(states: list[dict]) -> dict:
    """One compressor state for a rank of another world size, from the old ranks' states.

    Per-rank error feedback cannot be split anew exactly (each rank's holds what its own
    compressor left out), so every new rank starts from the old ranks' mean error: the next
    averaged gradient then carries the same residual (the mean of the errors) before
    compression, while what the compressor picks of it differs. What is the same on every rank
    (PowerSGD's Q, its step count and seed generator) is kept as it was.
    """
    if not states:
        return {}
    merged = dict(states[0])
    if "error" in merged:
        merged["error"] = memory.mean_pieces([s.get("error", {}) for s in states])
    return merged


def wire_bytes(spec: str, shapes, world: int, element_size: int = 4) -> float:
    """Bytes one rank sends per step (mean over ranks, after any warm-up) for gradients of ``shapes``."""
    record, argument = parse_spec(spec)
    return record.wire_bytes([tuple(s) for s in shapes], world, argument, element_size)


def collective_operations(spec: str, algorithm: str) -> tuple[str, ...]:
    """The ``ddtrain.comm.traffic`` operations a compressed synchronisation counts its bytes under."""
    record, _ = parse_spec(spec)
    return ("allgather",) if record.collective == "all-gather" else (algorithm,)


__all__ = ["COMPRESSIONS", "Compression", "SPECS", "allgather_bytes", "allreduce_bytes", "build", "check_spec",
           "collective_operations", "merge_states", "parse_spec", "register_compression", "wire_bytes"]
