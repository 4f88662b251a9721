"""The optimizer ``prepare`` returns: an instance of a subclass of the user's own optimizer class.

Horovod's pattern (``hvd.DistributedOptimizer``): ``type(name, (cls,), {...})`` builds a subclass
of the user's class whose ``step`` runs the strategy's step (the user's own step, or the
parameter servers' exchange) and then the strategy's ``after_step``. The new object shares the
original's ``__dict__`` (param_groups, state, defaults, hooks), so a scheduler, a param-group
edit or a ``load_state_dict`` made on either object, before or after ``prepare``, is seen by
both; ``isinstance(optimizer, torch.optim.SGD)`` and every ``lr_scheduler`` accept it.
"""
from __future__ import annotations

import functools

import torch

from ddtrain.errors import DDTrainError


class StepCounter:
    """One model's optimizers: the strategy's ``after_step`` runs once every optimizer has stepped once more."""

    def __init__(self, strategy, optimizers: int):
        self.strategy, self.counts = strategy, [0] * optimizers
        self.steps = 0            # completed steps of the model (every optimizer stepped)
        self.after = []           # called with no argument after each completed step (ddtrain.training.state's boundary)

    def stepped(self, index: int) -> None:
        self.counts[index] += 1
        if min(self.counts) > self.steps:
            self.strategy.after_step(self.steps)
            self.steps += 1
            for hook in self.after:
                hook()

    def restore(self, steps: int) -> None:
        """Continue the count from ``steps`` (a loaded state): every optimizer has stepped that often."""
        self.steps, self.counts = steps, [steps] * len(self.counts)


def _prepared_step(self, closure=None):
    """The user's step through the strategy (push/pull on parameter servers), then its per-step sync."""
    user_step = super(type(self), self).step
    result = self._ddtrain_counter.strategy.optimizer_step(self, user_step, closure)
    self._ddtrain_counter.stepped(self._ddtrain_index)
    return result


# torch's Optimizer.__setstate__ (run by load_state_dict) wraps ``type(self).step`` in its profiling
# hooks unless marked: the user's class step, which ours calls, is already wrapped, so hooks
# registered with register_step_pre_hook run once per step, not twice.
_prepared_step.hooked = True


def _reduce(self):
    raise DDTrainError("a prepared optimizer cannot be pickled or deep-copied; save optimizer.state_dict() instead")


def prepare_optimizer(optimizer: torch.optim.Optimizer, counter: StepCounter, index: int) -> torch.optim.Optimizer:
    """A ``Prepared<Class>`` instance of a subclass of ``type(optimizer)`` sharing ``optimizer``'s state."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise DDTrainError(f"prepare(): optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    base = type(optimizer)
    if getattr(base, "_ddtrain_prepared", False):
        raise DDTrainError("prepare(): this optimizer was already prepared; pass the optimizer you created")
    cls = type(f"Prepared{base.__name__}", (base,), {
        "step": _prepared_step, "_ddtrain_prepared": True, "__reduce_ex__": lambda self, protocol: _reduce(self),
        "__doc__": f"{base.__name__} whose step() also runs ddtrain's strategy (see ddtrain.training.prepared_optimizer)",
        "__module__": base.__module__})
    prepared = cls.__new__(cls)
    prepared.__dict__ = optimizer.__dict__        # shared, not copied: both names see every change
    prepared._ddtrain_counter, prepared._ddtrain_index = counter, index
    step = optimizer.__dict__.get("step")
    if step is not None and hasattr(step, "_wrapped_by_lr_sched"):
        # A scheduler created before prepare put its step-counting wrapper of the *base* step in the
        # shared dict, which would shadow ours; wrap ours the same way so both keep working.
        @functools.wraps(_prepared_step)
        def counted_step(*args, **kwargs):
            prepared._opt_called = True
            return _prepared_step(prepared, *args, **kwargs)

        counted_step._wrapped_by_lr_sched = True
        prepared.__dict__["step"] = counted_step
    return prepared
