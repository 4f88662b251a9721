"""``ddtrain.comm_hook``: ddtrain's all-reduce algorithms and compressors as a hook for a user's own DDP.

    state, hook = ddtrain.comm_hook(algorithm="ring", compression="powersgd:2", model=model)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, hook)

It is the hook the ``ring``/``tree``/``butterfly``/``central`` strategies (and ``ddp`` with
``--compression``) register on the DDP they build (``allreduce.allreduce_hook``), handed out
rather than written again: the same buckets, the same algorithm, the same bits. Plain DDP,
Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` and a Ray Train worker's
``DistributedDataParallel`` all take it (docs/BRIDGES.md).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ddtrain import comm
from ddtrain.comm import compression as compressions
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.sync.allreduce import HookState, allreduce_hook
from ddtrain.sync.base import SyncStats


class CommHookState(HookState):
    """The state a ``comm_hook`` carries: algorithm, compressor and its memory, traffic; checkpointable.

    ``state_dict()`` is this rank's compressor memory (error feedback, PowerSGD's Q and step
    count) keyed by parameter position when ``model`` was given, and DDP's buckets; save it
    per rank beside the model (it differs per rank under error feedback) and hand it back
    with ``load_state_dict`` before the first step of the resumed run.
    """

    def state_dict(self) -> dict:
        return self.compressor_state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Restore ``state_dict()``'s state; DDTrainError (strict) when it was written by another compressor."""
        try:
            note = self.load_compressor_state_dict(state)
        except ValueError as exc:   # pieces of another model's shapes
            raise DDTrainError(f"comm_hook state: {exc}") from None
        if note is not None and strict:
            raise DDTrainError(f"comm_hook state: {note} (load_state_dict(..., strict=False) accepts that)")

    def traffic(self) -> SyncStats:
        """What this rank's hook has sent and received, and its seconds inside the algorithm, since it was made."""
        stats = SyncStats()
        self.ledger.fill(stats)
        stats.extra["buckets_reduced"] = self.buckets
        return stats


def comm_hook(algorithm: str = "ring", compression: str | None = None, *, model: torch.nn.Module | None = None,
              group=None) -> tuple[CommHookState, Callable]:
    """(state, hook) for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    algorithm: a ``ddtrain.comm.ALGORITHMS`` name (``ring``, ``tree``, ``butterfly``, ``central``,
    ``ring-async``, ``native``). compression: a ``--compression`` spec (``fp16``, ``bf16``,
    ``powersgd:RANK[:WARMUP]``, ``topk:FRACTION``) or None. model: the module DDP wraps (before
    wrapping); with it the compressor's memory is keyed by parameter position, so a checkpoint
    of it fits any bucket size; without it, by DDP's bucket index. group: the process group DDP
    reduces over (None: the default group). Uncompressed, the gradients equal DDP's own average
    (to rounding: the algorithm sums in another order).
    """
    if algorithm not in comm.ALGORITHMS:
        raise ConfigError("algorithm", f"{algorithm!r} is not one of: {', '.join(sorted(comm.ALGORITHMS))}")
    spec = "none" if compression is None else compression
    try:
        compressions.check_spec(spec)
    except ValueError as exc:
        raise ConfigError("compression", str(exc).removeprefix("compression ")) from None
    state = CommHookState(algorithm, group, None, spec)
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError("model", f"must be the torch.nn.Module DDP wraps, got {type(model).__name__}")
        state.name_parameters(getattr(model, "module", model))   # a DDP passed by mistake: its module's parameters
    return state, allreduce_hook
