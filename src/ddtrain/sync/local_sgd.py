"""``local-sgd``: every rank steps on its own gradients; every K steps the replicas are brought together.

Between averagings the replicas drift apart. Every ``--sync-every K`` steps (or at every epoch
end with ``--sync-every epoch``) one all-reduce with ddtrain's ``ring`` (traffic under "ring")
brings them together, as ``--outer-optimizer`` says:

* ``average``: parameters and floating-point buffers become their mean over the ranks.
* ``nesterov`` (DiLoCo, Douillard et al. 2023): each rank's parameter change since the last
  averaging, ``anchor - theta_r`` (the "outer gradient"), is averaged, and an outer SGD with
  Nesterov momentum (``--outer-lr`` 0.7, ``--outer-momentum`` 0.9, the paper's) steps the anchor,
  from which every replica restarts. Buffers are averaged. Outer lr 1 and momentum 0 is ``average``.

``--local-sgd-warmup-steps W`` (post-local SGD, Lin et al. 2020; PyTorch's PostLocalSGDOptimizer):
the first W steps average the gradients every step (DDP with the ring as its hook: the ``ring``
strategy's steps), local steps after. ``--adaptive-interval`` chooses each next interval with
``choose_interval`` from the spread and times measured at each averaging. The run ends with an
averaging if steps were taken since the last one, so every rank returns (and rank 0 saves) the
same model. On the ``prepare`` path, where ddtrain does not see the end of the script's loop,
every pass over the training loader ends so (right after the step that follows its last batch,
or when it is exhausted): a model evaluated after a pass, or saved after the loop, is the average.
The record's fields are defined in docs/PERFORMANCE.md ("local-sgd's record").
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from ddtrain.comm import traffic
from ddtrain.sync.accounting import Ledger
from ddtrain.sync.allreduce import HookState, allreduce_hook
from ddtrain.sync.base import SyncOptions
from ddtrain.sync.ddp import ddp_model
from ddtrain.sync.divergence import relative_spread, spread_terms
from ddtrain.sync.periodic import PeriodicStrategy
from ddtrain.sync.state import average_, broadcast_, state_tensors

ALGORITHM = "ring"
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9   # Douillard et al. 2023, sec. 3 (their best outer optimizer)


def outer_settings(options: SyncOptions) -> tuple[float, float]:
    """(outer lr, outer momentum) that ``options`` stand for; ``average`` is (1, 0)."""
    if options.outer_optimizer == "average":
        return 1.0, 0.0
    return (DILOCO_OUTER_LR if options.outer_lr is None else options.outer_lr,
            DILOCO_OUTER_MOMENTUM if options.outer_momentum is None else options.outer_momentum)


def choose_interval(interval: int, divergence: float, averaging_s: float, step_s: float, *, comm_fraction: float,
                    max_divergence: float, min_interval: int, max_interval: int) -> int:
    """The next interval: the shortest one whose averaging fits the communication budget, capped by the divergence bound.

    ``interval`` steps just ended with an averaging that took ``averaging_s`` while a compute
    step took ``step_s``, and the replicas had spread ``divergence`` apart (``relative_spread``).
    Communication: an averaging every K steps costs ``averaging_s / (K * step_s)`` of the compute
    time, so ``K_comm = ceil(averaging_s / (comm_fraction * step_s))`` is the shortest interval within
    budget -- shorter intervals keep the replicas closer, so none longer is taken for speed.
    Divergence: the spread grows with the steps apart (linearly for a steady drift, as the square
    root for noise), so ``K_div = floor(interval * max_divergence / divergence)`` keeps it under the
    bound under the linear assumption, the cautious one when growing. The choice is
    ``min(K_comm, K_div, 2 * interval)`` (the bound wins over speed; at most doubling, because the
    extrapolation is local), clamped to ``[min_interval, max_interval]``.
    """
    by_comm = math.ceil(averaging_s / (comm_fraction * step_s)) if step_s > 0 else max_interval
    by_divergence = math.floor(interval * max_divergence / divergence) if divergence > 0 else max_interval
    return max(min_interval, min(max_interval, by_comm, by_divergence, 2 * interval))


ANCHORED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> its DiLoCo strategy (a weak reference)


def reanchor_after_load(module, _incompatible_keys) -> None:
    """``load_state_dict`` post-hook of a DiLoCo model: re-anchor its strategy (none for a copy of the model)."""
    strategy = ANCHORED.get(module)
    if strategy is not None and strategy() is not None:
        strategy().reanchor()


class WarmupHook(HookState):
    """DDP's hook state for the warm-up: the ring average of each bucket, then (``local``) the bucket as it is."""

    local = False


def warmup_hook(state: WarmupHook, bucket):
    """Post-local SGD's hook: ``allreduce_hook`` during the warm-up; afterwards the local gradient, no message."""
    if not state.local:
        return allreduce_hook(state, bucket)
    buffer = bucket.buffer()
    future = torch.futures.Future(devices=[buffer.device]) if buffer.device.type == "cuda" else torch.futures.Future()
    future.set_result(buffer)
    return future


class LocalSGDStrategy(PeriodicStrategy):
    """Local steps; an averaging (or DiLoCo's outer step) when one is due, and once more at the end.

    With K=1, plain SGD and ``average``, averaging ``p - lr·g_r`` over the ranks is ``p - lr·mean(g_r)``,
    the one-process step with the global batch; heavy-ball momentum keeps that (linear in the
    gradients), Adam does not. With K > 1 no optimizer is equivalent.
    """

    SYNCS_NAME = "averagings"

    def __init__(self, model, optimizer, options: SyncOptions):
        self.options = options
        self.outer_lr, self.outer_momentum = outer_settings(options)
        self.warmup_steps = options.local_sgd_warmup_steps
        ledger = Ledger((ALGORITHM,))
        self.hook = None
        if self.warmup_steps:
            # buffers are averaged at the averagings, not sent from rank 0 before every forward
            self.hook = WarmupHook(ALGORITHM, None, ledger)
            with warnings.catch_warnings():   # newer torch renames broadcast_buffers; the old name still means it
                warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
                wrapped = ddp_model(model, dataclasses.replace(options, no_broadcast_buffers=True),
                                    comm_hook=warmup_hook, hook_state=self.hook)   # broadcasts rank 0's state (not counted)
        else:
            wrapped = model
            broadcast_(state_tensors(model), counted=False)
        super().__init__(wrapped, optimizer, options, ledger=ledger, module=model)
        self.interval = options.sync_every     # the interval now (changes with --adaptive-interval)
        self.log: list[dict] = []              # one entry per averaging (the record's "averaging_log")
        self.step_times: list[float] = []      # seconds between this interval's step ends, averagings excluded
        self.last_step_end = None
        self.bytes_per_averaging = 0
        self.warmup_bytes = 0
        self.outer = self.anchor = None
        if options.outer_optimizer == "nesterov":
            self.anchor = [p.detach().clone() for p in model.parameters()]   # the global parameters of DiLoCo
            self.outer = torch.optim.SGD(self.anchor, lr=self.outer_lr, momentum=self.outer_momentum,
                                         nesterov=self.outer_momentum > 0)
            # parameters loaded from outside (a checkpoint's) are where the next interval starts; a
            # module-level hook, so that the model still deep-copies and pickles (as a plain module)
            ANCHORED[model] = weakref.ref(self)
            model.register_load_state_dict_post_hook(reanchor_after_load)
        self.pass_ending = False               # prepare's training loader gave its last batch of a pass

    @torch.no_grad()
    def reanchor(self) -> None:
        """Take the model's parameters now as the point the next outer gradient is measured from."""
        if self.anchor is not None:
            for a, p in zip(self.anchor, self.module.parameters()):
                a.copy_(p)

    def unsynced(self) -> bool:
        """Were local steps taken since the last averaging (the warm-up's steps are synchronous)?"""
        return self.steps > max(self.synced_at, self.warmup_steps)

    def last_batch(self) -> None:
        self.pass_ending = True

    def due(self, steps: int) -> bool:
        if steps <= self.warmup_steps or self.every == "epoch":
            return False
        if self.options.adaptive_interval:
            return steps - self.synced_at >= self.interval
        return (steps - self.warmup_steps) % self.every == 0

    def due_at_epoch_end(self) -> bool:
        return self.every == "epoch" and self.unsynced()

    def end_epoch(self, epoch: int) -> None:
        due = self.pass_ending and self.unsynced() or self.due_at_epoch_end()   # pass_ending: no step followed its last batch
        self.pass_ending = False
        if due:
            self.sync()
        self.monitor.end_epoch(epoch, after_sync=due)

    def after_step(self, step: int) -> None:
        now = time.perf_counter()
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
        super().after_step(step)
        if self.warmup_steps and self.steps == self.warmup_steps:
            # the replicas took identical steps so far: local steps from here, measured from here
            self.hook.local = True
            self.warmup_bytes = traffic.snapshot().by_operation.get(ALGORITHM, traffic.Counts()).bytes_sent \
                - self.ledger.start.by_operation.get(ALGORITHM, traffic.Counts()).bytes_sent
            self.synced_at = self.steps
            self.reanchor()
        if self.pass_ending:
            # On the prepare path a pass over the training loader ends with an averaging, so that
            # evaluation after it, and the model a script saves after its loop (on rank 0 alone, where
            # no collective can run), are the replicas' average (issue 29, item 5).
            self.pass_ending = False
            if self.unsynced():
                self.sync()
        self.last_step_end = time.perf_counter()

    @torch.no_grad()
    def sync_(self) -> None:
        params = list(self.module.parameters())
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        local = [p.detach().clone() for p in params]          # this replica, for the spread
        before = traffic.snapshot().by_operation.get(ALGORITHM, traffic.Counts()).bytes_sent
        start = time.perf_counter()
        if self.outer is None:
            average_(params + buffers, algorithm=ALGORITHM)
            mean = params
        else:
            outer_grads = [a - x for a, x in zip(self.anchor, local)]   # this replica's outer gradient
            average_(outer_grads + buffers, algorithm=ALGORITHM)       # one all-reduce: the mean outer gradient
            mean = [a - g for a, g in zip(self.anchor, outer_grads)]   # the replicas' mean, for the spread
            for a, g in zip(self.anchor, outer_grads):
                a.grad = g
            self.outer.step()
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        averaging_s = time.perf_counter() - start
        self.bytes_per_averaging = traffic.snapshot().by_operation.get(ALGORITHM, traffic.Counts()).bytes_sent - before
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        self.record_averaging(spread_terms(local, mean), step_s, averaging_s)
        self.step_times, self.last_step_end = [], None

    def record_averaging(self, terms: torch.Tensor, step_s: float, averaging_s: float) -> None:
        """Agree on the measurements (one all-reduce of 4 numbers, not counted: measurement) and log them.

        Every rank then holds the same numbers, so every rank chooses the same next interval.
        """
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        agreed = torch.cat([terms.to(torch.float64), torch.tensor([step_s, averaging_s], dtype=torch.float64,
                                                                  device=terms.device)])
        if ranks > 1:
            dist.all_reduce(agreed)
        divergence = relative_spread(agreed, ranks)
        step_s, averaging_s = (float(v) / ranks for v in agreed[2:])
        interval = self.steps - self.synced_at
        if self.options.adaptive_interval:
            o = self.options
            self.interval = choose_interval(max(interval, 1), divergence, averaging_s, step_s,
                                            comm_fraction=o.adaptive_comm_fraction,
                                            max_divergence=o.adaptive_max_divergence,
                                            min_interval=o.adaptive_min_interval, max_interval=o.adaptive_max_interval)
        self.log.append({"step": self.steps, "interval": interval, "relative_divergence": divergence,
                         "averaging_s": averaging_s, "step_s": step_s, "bytes_sent": self.bytes_per_averaging,
                         "next_interval": self.interval})

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "interval": self.interval}
        if self.outer is not None:   # DiLoCo's global parameters and outer momentum (equal on every rank)
            state["anchor"] = [a.detach().clone() for a in self.anchor]
            state["outer"] = self.outer.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        super().load_state_dict(state)
        self.interval = state["interval"]
        if self.warmup_steps and self.steps >= self.warmup_steps:
            self.hook.local = True          # the warm-up was over when the checkpoint was written
        if self.outer is not None and "anchor" in state:
            for a, saved in zip(self.anchor, state["anchor"]):   # after the model's load re-anchored it
                a.copy_(saved)
            self.outer.load_state_dict(state["outer"])

    def close(self) -> None:
        if self.unsynced():
            self.sync()
        if self.hook is not None:
            self.hook.close()

    def update_stats(self) -> None:
        super().update_stats()
        after_warmup = self.steps - min(self.steps, self.warmup_steps)
        self.stats.extra.update({
            "outer_optimizer": self.options.outer_optimizer, "outer_lr": self.outer_lr,
            "outer_momentum": self.outer_momentum, "local_sgd_warmup_steps": self.warmup_steps,
            "warmup_bytes_sent": self.warmup_bytes if self.steps >= self.warmup_steps else self.stats.bytes_sent,
            "adaptive_interval": self.options.adaptive_interval, "bytes_per_averaging": self.bytes_per_averaging,
            "interval_mean": after_warmup / self.syncs if self.syncs else None, "averaging_log": self.log})
