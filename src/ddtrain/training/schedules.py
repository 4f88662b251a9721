"""Learning-rate schedules sized from the training loader before ``prepare``: found, and refused with the fix.

A one-process script sizes a per-step schedule from ``len(train_loader)``: ``OneCycleLR(total_steps=
epochs * len(train_loader))``, ``CosineAnnealingLR(T_max=...)``, Hugging Face's
``get_scheduler(num_training_steps=...)`` (a ``LambdaLR`` over a ``functools.partial``). Until the
loader is prepared, its length is the whole data set's batch count; prepared, each of R ranks
gets about 1/R of it. A schedule made before ``prepare`` thus spans R times the steps the run
takes (the issue's port ended at lr 0.0053 instead of 0.00012 at 2 ranks), while the plain-DDP
twin, which builds its loader with a DistributedSampler first, sizes it right.

``check_sizes`` looks at the schedulers already made on the optimizers (the objects that refer
to them: a scheduler keeps its optimizer, not the other way round) for a length that is a whole
multiple of the unprepared ``len(train_loader)``, and raises naming the scheduler, the field and
the numbers. The fix -- create the scheduler after ``prepare`` -- is always right: schedulers
made afterwards are never looked at. Schedules counted in epochs (``StepLR`` stepped per epoch)
or in a fixed number of steps that is not such a multiple pass.
"""
from __future__ import annotations

import functools
import gc

from torch.optim.lr_scheduler import LRScheduler

from ddtrain.errors import DDTrainError

# OneCycleLR; CosineAnnealingLR; LinearLR, ConstantLR, PolynomialLR; CosineAnnealingWarmRestarts
SIZE_FIELDS = ("total_steps", "T_max", "total_iters", "T_0")
SIZE_WORDS = ("step", "iter", "total")     # names of the lambdas' arguments and free variables that hold a length


def schedulers_of(optimizer) -> list:
    """The ``LRScheduler`` objects made on ``optimizer`` (found through what refers to it), sub-schedulers first."""
    if not getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
        return []                  # no scheduler was ever made on it: skip the search
    found = []
    for referrer in gc.get_referrers(optimizer):
        if isinstance(referrer, LRScheduler):
            found.append(referrer)
        elif isinstance(referrer, dict) and referrer.get("optimizer") is optimizer:   # an instance's __dict__
            found += [owner for owner in gc.get_referrers(referrer)
                      if isinstance(owner, LRScheduler) and getattr(owner, "__dict__", None) is referrer]
    return found


def _function_sizes(function) -> list[tuple[str, int]]:
    """(name, value) of the integer lengths a lambda of LambdaLR holds: partial's arguments, closed-over variables."""
    sizes = []
    if isinstance(function, functools.partial):
        sizes += [(name, value) for name, value in function.keywords.items()]
        function = function.func
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    if code is not None:
        for name, cell in zip(code.co_freevars, cells):
            try:
                sizes.append((name, cell.cell_contents))
            except ValueError:     # an empty cell
                pass
    return [(name, value) for name, value in sizes
            if isinstance(value, int) and not isinstance(value, bool) and any(w in name.lower() for w in SIZE_WORDS)]


def sizes_of(scheduler) -> list[tuple[str, int]]:
    """(field, value) of every length ``scheduler`` was given in steps."""
    sizes = [(name, getattr(scheduler, name)) for name in SIZE_FIELDS
             if isinstance(getattr(scheduler, name, None), int)]
    for function in getattr(scheduler, "lr_lambdas", None) or ():
        sizes += _function_sizes(function)
    return sizes


def check_sizes(optimizers, train_loader, prepared_batches: int | None, workers: int) -> None:
    """Refuse a scheduler made before ``prepare`` whose length is a multiple of the unprepared ``len(train_loader)``."""
    if workers <= 1 or prepared_batches is None:
        return
    try:
        batches = len(train_loader)
    except TypeError:             # an iterable dataset without a length: nothing was sized from it
        return
    if batches <= prepared_batches or batches == 0:
        return
    for optimizer in optimizers:
        for scheduler in schedulers_of(optimizer):
            for name, value in sizes_of(scheduler):
                if value >= batches and value % batches == 0:
                    raise DDTrainError(
                        f"prepare(): the {type(scheduler).__name__} made before prepare() has {name}={value}, "
                        f"{value // batches} x len(train_loader) = {batches} batches of the whole data set; prepared, "
                        f"the training loader gives {prepared_batches} batches on each of the {workers} ranks, so the "
                        f"schedule would run about {batches / prepared_batches:.3g} times too long. Create the "
                        f"scheduler after prepare(), sizing it from the prepared len(train_loader)")
