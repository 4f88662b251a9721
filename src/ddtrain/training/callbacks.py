"""The loop's extension points: a callback sees the run begin and end, and every epoch and step, with the ``TrainState``.
A callback is any object with some of the hook methods below (``ddtrain.observe.profiler.Profiler``
is one, without importing this module); ``Callback`` is a convenient base whose hooks do
nothing. The loop binds each hook once per run and calls only the ones a callback defines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from ddtrain.config import TrainConfig
    from ddtrain.data import Data
    from ddtrain.reliability.checkpoint import Checkpointer
    from ddtrain.reliability.nonfinite import NonfiniteGuard
    from ddtrain.reliability.preemption import Preemption
    from ddtrain.reliability.replicas import ReplicaCheck

HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_train_end")


class Callback:
    """Override what you need; ``logs`` holds the step's or epoch's metrics (Keras-style).

    A step's ``logs``: ``loss`` (a tensor on the device) and the loop's clock readings
    (``time.perf_counter``) ``begin_s`` (the end of the previous step), ``data_end_s`` (batch in
    hand), ``compute_end_s`` (after backward) and ``end_s`` (after the optimizer and the
    strategy's sync), so that the data, compute and optimizer seconds are their differences.
    """

    def on_train_begin(self, state): ...
    def on_epoch_begin(self, epoch, state): ...
    def on_step_begin(self, step, state): ...
    def on_step_end(self, step, logs, state): ...
    def on_epoch_end(self, epoch, logs, state): ...
    def on_train_end(self, record, state): ...


def bound(callbacks, name: str) -> list:
    """The ``name`` methods of ``callbacks``, leaving out those a callback lacks or keeps as Callback's no-op."""
    noop = getattr(Callback, name)
    out = []
    for cb in callbacks:
        method = getattr(cb, name, None)
        if method is not None and getattr(method, "__func__", method) is not noop:
            out.append(method)
    return out


@dataclass(eq=False)
class TrainState:
    """What the loop works with, handed to every callback (read it; the loop owns the counters)."""

    config: TrainConfig
    strategy: Any                       # the applied strategy (ddtrain.sync.wrap's result)
    model: torch.nn.Module              # the module being trained (the strategy's ``module``)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    device: torch.device
    data: Data
    record: dict                        # the results record, written once at the end of fit
    fingerprint: dict                   # what must agree between ranks and with a checkpoint
    callbacks: list = field(default_factory=list)
    epochs: int = 0                     # the last epoch this run trains
    step: int = 0                       # optimizer steps (updates) done in the whole run
    first_step: int = 0                 # the step this process started training at (a resume's checkpoint step)
    epoch: int = 1                      # the epoch running now
    steps_done: int = 0                 # steps done in this epoch
    checkpointer: Checkpointer | None = None    # with a checkpoint_dir
    nonfinite: NonfiniteGuard | None = None
    replicas: ReplicaCheck | None = None        # on workers of a distributed run
    preemption: Preemption | None = None        # with a checkpoint_dir: stop and save on SIGTERM and the like
    schedule: Any = None                # the lr schedule (ddtrain.recipe.Schedule), when not constant
    updates_per_epoch: int = 0          # optimizer steps in an epoch (micro-batches // grad_accum)
    balancer: Any = None                # with --balance on the workers of a distributed run (training.balance)
