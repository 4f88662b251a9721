"""``--balance``: each worker's share of the global batch from its measured speed, and the straggler report.

A synchronous step waits for its slowest worker. With ``--balance speed`` the loop gives faster
workers more of the fixed global batch and keeps the step the same: the samples of step s are
still ``order[s*G:(s+1)*G]`` (only which rank computes which run of them changes:
``ddtrain.data.balance``), and each micro-batch's mean loss is weighted by its samples x R / G
(``loss_weight``), so the workers' averaged gradient is the mean over the global batch, whatever
the shares.

Measuring. A worker's *local time* for a step runs from the end of its previous step to the
moment its last parameter gradient is accumulated (a post-accumulate-grad hook on every
parameter): loading, forward and backward, but not the wait for the other workers, which comes
after (DDP's all-reduce finishes after the last gradient, parameter servers exchange in the
optimizer step). On CUDA the same two points are CUDA events, read at the re-measure. Every
``--balance-every`` steps the workers all-gather (local time, samples, step time) summed over the
window; each rank then computes, from the same gathered numbers, the same shares:

- per-sample time p_r = local time / samples over the window, smoothed: p_r <- 0.5 x this window
  + 0.5 x the previous estimate (``EMA_WEIGHT``; the first window's value as it is);
- target shares proportional to the speeds 1/p_r (``data.balance.proportional_shares``): integers
  summing to G, at least ``grad_accum`` each, none moved by more than half the uniform share
  (G / R / 2, ``MAX_CHANGE``) per re-measure;
- kept unless the predicted step time max_r(n_r x p_r) falls by at least 2 % (``MIN_GAIN``), so
  equal workers keep equal shares instead of trading noise.

The new shares take effect ``lag`` steps later (the steps the loader may already have drawn:
``ShardLoader.lookahead``; the next epoch when it draws an epoch at once), on every rank at the
same step. The shares are not training state: a resumed run starts from equal shares.

``--balance measure`` measures and reports the same, with equal shares: the straggler report
(``straggler``) says what each rank waits and what balancing would gain.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ddtrain.data.balance import ShareSchedule, predicted_step_s, proportional_shares, uniform_shares
from ddtrain.errors import ConfigError

EMA_WEIGHT = 0.5    # weight of the newest window in the smoothed per-sample time
MAX_CHANGE = 0.5    # a share moves by at most this fraction of the uniform share per re-measure
MIN_GAIN = 0.02     # new shares only when they cut the predicted step time by at least this fraction


def check(mode: str, *, synchronous: bool, strategy: str, global_batch: int, workers: int, grad_accum: int,
          sharding: str) -> None:
    """What ``--balance speed`` needs, checked before any worker starts (``training.build.check_run``)."""
    if mode != "speed":
        return
    if not synchronous:
        raise ConfigError("balance", f"'speed' needs a synchronous strategy (one step over the whole global batch); "
                          f"{strategy!r} is not: use --balance measure to see its stragglers")
    if sharding != "balanced":
        raise ConfigError("balance", f"'speed' splits the global batch of the balanced sharding, not {sharding!r}")
    if not global_batch:
        raise ConfigError("balance", "'speed' keeps the global batch fixed and splits it unequally: give "
                          "--global-batch-size")
    if global_batch < workers * grad_accum:
        raise ConfigError("balance", f"'speed' gives every worker at least grad_accum ({grad_accum}) samples a step; "
                          f"a global batch of {global_batch} cannot on {workers} workers")


def loss_weight(samples: int, workers: int, global_batch: int) -> float:
    """The factor on a micro-batch's mean loss that makes the workers' averaged gradient the global-batch mean."""
    return samples * workers / global_batch


class Balancer:
    """One worker's measurements and the shares every worker agreed on (``schedule``)."""

    def __init__(self, mode: str, *, workers: int, worker_rank: int, global_batch: int, grad_accum: int,
                 every: int, group, device: torch.device, lookahead: int | None, updates_per_epoch: int):
        self.mode, self.workers, self.rank, self.global_batch = mode, workers, worker_rank, global_batch
        self.grad_accum, self.every, self.group, self.device = grad_accum, every, group, device
        self.per_epoch = updates_per_epoch
        # steps the loader may have drawn ahead of the loop; None: an epoch at a time
        self.lag = None if lookahead is None else math.ceil(lookahead / grad_accum)
        self.schedule = ShareSchedule(uniform_shares(global_batch, workers))
        self.cuda = device.type == "cuda"
        self.per_sample_s: list[float] | None = None
        self.history: list[dict] = []
        self._hooks: list = []
        self._window = [0.0, 0.0, 0.0, 0]    # local s, step s, samples, steps
        self._pending: list = []             # CUDA: (start, last gradient, end) events not yet read
        self._t0 = self._grad_t = None
        self._events = None

    @property
    def unequal(self) -> bool:
        return self.mode == "speed"

    def attach(self, module: torch.nn.Module) -> None:
        """Note the time each parameter's gradient is accumulated (the last one ends the local work)."""
        for p in module.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_done))

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _gradient_done(self, _param) -> None:
        self._grad_t = time.perf_counter()
        if self._events is not None:
            self._events[1].record()

    def start(self) -> None:
        """The clock of the next step starts (an epoch's start; after each step, ``step_end`` restarts it)."""
        self._t0, self._grad_t = time.perf_counter(), None
        if self.cuda:
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            self._events[0].record()

    def step_end(self, step: int, samples: int, epoch_first_step: int) -> None:
        """After every step on every worker (``step`` counts the steps done): measure; every ``every`` steps agree."""
        now = time.perf_counter()
        window = self._window
        if self.cuda:
            begin, grad, end = self._events
            end.record()
            self._pending.append((begin, grad if self._grad_t is not None else end, end))   # no gradient: no wait seen
        else:
            window[0] += (self._grad_t if self._grad_t is not None else now) - self._t0
            window[1] += now - self._t0
        window[2] += samples
        window[3] += 1
        if step % self.every == 0:
            self._agree(step, epoch_first_step)
        self.start()

    def _agree(self, step: int, epoch_first_step: int) -> None:
        window = self._window
        if self.cuda:
            for begin, grad, end in self._pending:
                end.synchronize()
                window[0] += begin.elapsed_time(grad) / 1e3
                window[1] += begin.elapsed_time(end) / 1e3
            self._pending = []
        on = self.device if dist.get_backend(self.group) == "nccl" else "cpu"   # NCCL gathers CUDA tensors only
        mine = torch.tensor(window[:3] + [float(window[3])], dtype=torch.float64, device=on)
        everyone = [torch.empty_like(mine) for _ in range(self.workers)]
        dist.all_gather(everyone, mine, group=self.group)
        rows = [t.tolist() for t in everyone]   # the same numbers, bit for bit, on every rank
        self._window = [0.0, 0.0, 0.0, 0]
        if any(r[3] < 1 or r[2] <= 0 for r in rows):
            return
        now = [r[0] / r[2] for r in rows]
        self.per_sample_s = now if self.per_sample_s is None else \
            [EMA_WEIGHT * n + (1 - EMA_WEIGHT) * old for n, old in zip(now, self.per_sample_s)]
        shares = self.schedule.current()
        entry = {"step": step, "shares": shares, "per_sample_ms": [round(p * 1e3, 4) for p in self.per_sample_s],
                 "local_s": [round(r[0] / r[3], 6) for r in rows], "step_s": [round(r[1] / r[3], 6) for r in rows]}
        entry["wait_s"] = [round(max(s - loc, 0.0), 6) for s, loc in zip(entry["step_s"], entry["local_s"])]
        if self.unequal:
            proposed = proportional_shares([1 / p for p in self.per_sample_s], self.global_batch,
                                           minimum=self.grad_accum, previous=shares,
                                           max_change=max(1, int(MAX_CHANGE * self.global_batch / self.workers)))
            before, after = predicted_step_s(shares, self.per_sample_s), predicted_step_s(proposed, self.per_sample_s)
            if proposed != shares and after <= before * (1 - MIN_GAIN):
                first = epoch_first_step + self.per_epoch if self.lag is None else step + self.lag
                self.schedule.change(first, proposed)
                entry.update(new_shares=proposed, from_step=first)
        self.history.append(entry)

    def record(self) -> dict:
        """The results record's ``balance``: the rule, the shares and speeds over time, the straggler report."""
        return {"mode": self.mode, "every": self.every, "ema_weight": EMA_WEIGHT, "max_change": MAX_CHANGE,
                "min_gain": MIN_GAIN, "lag_steps": self.lag, "global_batch": self.global_batch,
                "final_shares": self.schedule.current(), "history": self.history,
                "straggler": straggler(self.history, self.global_batch)}


def straggler(history: list[dict], global_batch: int) -> dict:
    """Per-rank step, local and wait time over the run's windows, and the step time each split predicts.

    ``overhead_s`` is what a step spends besides the slowest rank's local work (the all-reduce's
    tail, the optimizer); the uniform and balanced predictions add it to max_r(n_r x p_r) with
    n_r = G / R and with n_r proportional to 1 / p_r (p_r: the last smoothed per-sample time).
    """
    if not history:
        return {}
    ranks = len(history[0]["step_s"])

    def mean(key, r):
        return sum(h[key][r] for h in history) / len(history)
    step_s = [mean("step_s", r) for r in range(ranks)]
    local_s = [mean("local_s", r) for r in range(ranks)]
    wait_s = [mean("wait_s", r) for r in range(ranks)]
    last = history[-1]
    per_sample = [p / 1e3 for p in last["per_sample_ms"]]
    overhead = max(max(last["step_s"]) - max(last["local_s"]), 0.0)
    uniform = overhead + global_batch / ranks * max(per_sample)
    balanced = overhead + global_batch / sum(1 / p for p in per_sample)
    return {"ranks": ranks, "step_s": [round(v, 6) for v in step_s], "local_s": [round(v, 6) for v in local_s],
            "wait_s": [round(v, 6) for v in wait_s], "slowest_rank": max(range(ranks), key=lambda r: per_sample[r]),
            "overhead_s": round(overhead, 6), "uniform_step_s": round(uniform, 6),
            "balanced_step_s": round(balanced, 6), "balancing_gain": round(uniform / balanced, 4)}
