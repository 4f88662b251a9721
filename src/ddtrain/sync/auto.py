"""``auto``: predict the fastest strategies, try the best few on the job's own links, keep the fastest.

At the first forward pass, on every rank at once (docs/AUTO.md):

1. **Calibrate** on the job's own links and compute: one forward+backward of the model on the
   first batch, timed (the model's buffers, gradients and RNG put back afterwards: no side effect),
   a short pairwise exchange fit of α, β, γ (``costmodel.calibration.calibrate``, messages up to
   1 MiB) and, for the compressions allowed, each compressor's own work on the model's shapes
   (``costmodel.codecs``, a group of each rank alone: no messages).
2. **Predict**: ``costmodel.advise`` ranks every strategy × compression × algorithm of
   ``STRATEGIES`` (and local SGD every K steps with DiLoCo's outer step); the candidates are the
   eligible ones: accuracy risk known within 1 point (``costmodel.risks``) *and* exact, or of a
   family allowed by ``--auto-allow``. The ``--auto-candidates`` best (the fastest of each family
   first, then the next fastest) are tried.
3. **Verify**: each candidate trains ``--auto-trial-steps`` real steps (after its own warm-up: DDP's
   first step, PowerSGD's uncompressed steps; local SGD: one whole interval), timed on every rank;
   the slowest rank's median (local SGD: mean over the interval, averaging included) is its step.
4. **Commit** to the fastest measured. With ``--auto-recheck F`` the committed method's
   communication wait (step time minus the calibrated compute step) is watched every window of
   steps; when it moves by a factor F either way, the links are calibrated again, the candidates
   re-ranked and re-tried, and the job switches only when another one is faster by
   ``SWITCH_MARGIN`` (hysteresis; and at most one re-check every ``RECHECK_GAP_WINDOWS`` windows).

Handover at a step boundary: the model's parameters and buffers, the optimizer (its state, the
lr schedule on it), the loop's step count and RNG are the job's, untouched by a switch; a method
being left finishes first (local SGD's last averaging, the replicas equal again: its ``close``),
and the next one is built on the same module and optimizer (DDP broadcasts rank 0's state, equal
already). Compressor state (error feedback, PowerSGD's Q and warm-up) and DiLoCo's outer optimizer
start fresh at every switch. With the default eligibility (exact methods only: the same averaged
gradient every step) an auto run trains what the fixed method trains from the same state.

The record (``run_record``): the calibration, the predictions, every trial's predicted and measured
step, every switch (step, from, to, why), the choice, each re-check, every step's time on this
rank, and the selection overhead; ``ddtrain report`` draws it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import typing

import torch
import torch.distributed as dist
import torch.nn as nn

from ddtrain.costmodel import advise
from ddtrain.costmodel.burst import TokenBucket
from ddtrain.costmodel.calibration import calibrate, exchange_time
from ddtrain.costmodel.codecs import time_codecs
from ddtrain.distributed import runtime
from ddtrain.errors import ConfigError
from ddtrain.sync.base import Strategy, SyncOptions, SyncStats
from ddtrain.sync.state import average_, handover

NAME = "auto"
# the families that change the optimisation, each with its risk in one line (--auto-allow's words)
RISKS = {
    "fp16": "fp16: gradients rounded to 16 bits before the sum, no error feedback: a different trajectory "
            "(+0.46 points on ours, results/compression/accuracy.json)",
    "bf16": "bf16: gradients rounded to bfloat16 before the sum, no error feedback: a different trajectory "
            "(+0.28 points on ours, results/compression/accuracy.json)",
    "powersgd": "powersgd: a rank-4 gradient with error feedback: every update differs from the exact one, the "
                "error is carried to later steps (+0.56 points on ours; rank 1 loses accuracy, Vogels et al. 2019)",
    "topk": "topk: 10% of each gradient per step, the rest fed back later: a delayed, different trajectory "
            "(+0.65 points on ours; Lin et al. 2018 need momentum correction below 1%)",
    "local-sgd": "local-sgd: replicas step apart for K steps, then DiLoCo's outer step: no step is the global "
                 "batch's (-0.27 points on MNIST's mlp at K=20, results/diloco/cluster_100mbit.json; unmeasured "
                 "on other models)",
}
ALLOW_WORDS = tuple(RISKS)
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd:4:2", "topk:0.1")   # powersgd: the shortest warm-up DDP allows
LOCAL_SGD_INTERVAL, LOCAL_SGD_OUTER = 20, "nesterov"   # DiLoCo at K=20, the setting of results/diloco
CALIBRATION_MAX_BYTES = 1 << 20    # 1 MiB: 84 ms a message at 100 Mbit/s keeps the fit short
CALIBRATION_BUDGET_S = 0.6
SWITCH_MARGIN = 0.10               # a re-check switches only to a method measured 10 % faster
RECHECK_GAP_WINDOWS = 3            # windows between two re-checks
NOISE_FLOOR = 0.05                 # a drift must also move the step time by 5 %: a tiny wait's ratio is noise
WAIT_FLOOR = 0.10                  # waits below 10 % of the step count as 10 %: a machine's load moves them that much
DRIFT_WINDOWS = 3                  # a drift must hold for this many windows in a row (slow windows are load)
LINK_PROBE_BYTES = 128 << 10       # the link itself, timed every window: a pairwise exchange of 128 KiB (10 ms at
LINK_PROBE_BUDGET_S = 0.02         # 100 Mbit/s, four of them); a faster link shows here even when the method running
                                   # does not wait on it (PowerSGD's step is its codec's), so another may now be faster
PRUNE_FACTOR = 2.0                 # a method predicted 2x slower than the fastest candidate is not tried (the
                                   # adviser is within 20 % on the emulated cluster: docs/ADVISE.md)
EARLY_STOP_FACTOR = 2.0            # a trial whose first timed step is 2x the best measured this round stops there


def check_allow(text: str) -> tuple[str, ...]:
    """``--auto-allow``'s words (comma-separated), each one of ``ALLOW_WORDS``; ConfigError naming the field."""
    words = tuple(w.strip() for w in (text or "").split(",") if w.strip())
    for w in words:
        if w not in ALLOW_WORDS:
            raise ConfigError("auto_allow", f"unknown method family {w!r}; give a comma-separated list of "
                                            f"{', '.join(ALLOW_WORDS)} (or nothing: exact methods only)")
    return words


def check(options: SyncOptions) -> None:
    """StrategySpec.check of ``auto``: its own settings."""
    check_allow(options.auto_allow)
    if options.auto_candidates < 1:
        raise ConfigError("auto_candidates", f"must be at least 1, got {options.auto_candidates}")
    if options.auto_trial_steps < 1:
        raise ConfigError("auto_trial_steps", f"must be at least 1, got {options.auto_trial_steps}")
    if not (options.auto_recheck == 0 or options.auto_recheck > 1):
        raise ConfigError("auto_recheck", f"must be 0 (off) or a factor > 1, got {options.auto_recheck}")


def family(method: advise.Method) -> str | None:
    """The ``--auto-allow`` word a method needs (None: exact, always allowed)."""
    if method.kind == "average":
        return "local-sgd"
    return None if method.compression == "none" else method.compression.partition(":")[0]


def strategy_infos(strategies) -> list[advise.StrategyInfo]:
    """What the adviser needs of each strategy auto can switch to: those that send gradients or averages (``auto``
    itself has sends=''; a sharded strategy's state is split over the ranks, which ``handover`` does not move)."""
    outers = typing.get_args(typing.get_type_hints(SyncOptions)["outer_optimizer"])
    infos = [spec.advice_info(outers) for spec in strategies.values() if spec.sends in ("gradient", "average")]
    return advise.predictable(infos)[0]


def choose_trials(ranked: list[advise.Prediction], allow: tuple[str, ...], k: int) -> list[advise.Prediction]:
    """The ``k`` methods to try: eligible (risk within the bound) and exact or allowed; the fastest predicted of each
    family first (so an allowed family is tried at all), then the next fastest of any."""
    usable = [p for p in ranked if p.eligible and (family(p.method) is None or family(p.method) in allow)]
    if usable:
        fastest = min(p.step_s for p in usable)
        usable = [p for p in usable if p.step_s <= PRUNE_FACTOR * fastest]
    firsts, seen = [], set()
    for p in usable:
        key = family(p.method) or "exact"
        if key not in seen:
            seen.add(key)
            firsts.append(p)
    chosen = firsts[:k]
    for p in usable:
        if len(chosen) >= k:
            break
        if p not in chosen:
            chosen.append(p)
    return sorted(chosen, key=lambda p: p.step_s)


def method_options(options: SyncOptions, method: advise.Method) -> SyncOptions:
    """The SyncOptions that run ``method`` (auto's own settings back at their defaults)."""
    base = {f.name: getattr(SyncOptions(), f.name) for f in dataclasses.fields(SyncOptions) if f.name.startswith("auto_")}
    if method.kind == "average":
        return dataclasses.replace(options, **base, compression="none", sync_every=method.sync_every,
                                   outer_optimizer=method.outer)
    return dataclasses.replace(options, **base, compression=method.compression, sync_every=1,
                               outer_optimizer="average")


def _scalar(out) -> torch.Tensor:
    """A scalar of a forward's output (tensors found in tuples, lists, dicts summed), for the timed backward."""
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    parts = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    found = [_scalar(o) for o in parts if isinstance(o, (torch.Tensor, dict, list, tuple))]
    return sum(found) if found else torch.zeros(())


def compute_seconds(module: nn.Module, args, kwargs, repeats: int = 2) -> float:
    """Median seconds of forward+backward of ``module`` on the batch, with no trace left: its buffers (BatchNorm's
    running statistics), gradients and the RNG (dropout) are put back as they were."""
    params = list(module.parameters())
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in module.buffers()]
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    device = params[0].device if params else torch.device("cpu")
    times = []
    try:
        for p in params:
            p.grad = None
        for i in range(repeats + 1):     # the first allocates
            start = time.perf_counter()
            _scalar(module(*args, **kwargs)).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append(time.perf_counter() - start)
    finally:
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        for p, g in zip(params, grads):
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return statistics.median(times)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The floating-point tensors of an optimizer's state (momentum, Adam's moments), in a fixed order on every rank."""
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    out = []
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p, {})
                out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)
                        and state[k].is_floating_point() and state[k].dim() > 0]
    return out


def _agree_max(values: list[float]) -> list[float]:
    """Element-wise maximum over the ranks (every rank then decides alike; the slowest rank paces a step)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class AutoModel(nn.Module):
    """What the loop calls: the user's module (a child, so ``train()``/``eval()`` reach it), each forward routed to the
    method running now."""

    def __init__(self, module: nn.Module, route):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_route", route)

    def forward(self, *args, **kwargs):
        return self._route(*args, **kwargs)


class AutoStrategy(Strategy):
    """``auto``: the methods it tries and commits to run inside it (``current``), one at a time."""

    def __init__(self, model: nn.Module, optimizer, options: SyncOptions, *, strategies: dict):
        # ``strategies``: ddtrain.sync.STRATEGIES, given by its registration line (the registry imports this module)
        self.strategies = {n: s for n, s in strategies.items() if n != NAME}
        self.options, self.allow = options, check_allow(options.auto_allow)
        super().__init__(AutoModel(model, self._forward), optimizer, module=model,
                         stats=SyncStats(method="the committed method's (auto)"))
        self.current: Strategy | None = None
        self.method: advise.Method | None = None
        self.phase = "calibrate"             # calibrate -> trial -> committed (-> trial at a re-check)
        self.trials: list[dict] = []         # this round's, in order; each gets its measured step
        self.trial_index = 0
        self.phase_steps = 0                 # steps of the current method since it was built
        self.times: list[float] = []         # this phase's step times (this rank)
        self.last_end = None
        self.steps = 0
        self.compute_s = 0.0
        self.baseline: dict | None = None    # the committed method's measured step and wait
        self.last_recheck = 0
        self.drifting = 0                    # windows in a row whose wait moved by the factor
        self.record = {"allow": list(self.allow), "risks": {w: RISKS[w] for w in self.allow},
                       "candidates": options.auto_candidates, "trial_steps": options.auto_trial_steps,
                       "recheck_factor": options.auto_recheck, "switch_margin": SWITCH_MARGIN,
                       "calibrations": [], "predicted": [], "trials": [], "switches": [], "rechecks": [],
                       "choice": None, "step_times": [], "selection_s": 0.0}

    # ---- the loop's calls, handed to the method running now
    def _forward(self, *args, **kwargs):
        if self.current is None:
            if not (torch.is_grad_enabled() and self.module.training):   # an evaluation before training: nothing
                return self.module(*args, **kwargs)                       # to time or to synchronise yet
            self._start(args, kwargs)
        inner = self.current.no_sync() if self.accumulating else contextlib.nullcontext()
        with inner:   # gradient accumulation: the loop opened auto's no_sync before this forward
            return self.current.model(*args, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        return self.current.require_backward_grad_sync if self.current is not None else self._sync_gradients

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if self.current is not None:
            self.current.require_backward_grad_sync = value
        self._sync_gradients = bool(value)

    def optimizer_step(self, optimizer, user_step, closure=None):
        if self.current is None:
            return super().optimizer_step(optimizer, user_step, closure)
        return self.current.optimizer_step(optimizer, user_step, closure)

    def end_epoch(self, epoch: int) -> None:
        if self.current is not None:
            self.current.end_epoch(epoch)

    def last_batch(self) -> None:
        if self.current is not None:
            self.current.last_batch()

    def replicas_identical(self, step: int) -> bool:
        return self.current.replicas_identical(step) if self.current is not None else True

    def after_step(self, step: int) -> None:
        self.current.after_step(step)
        now = time.perf_counter()
        if self.last_end is not None:
            seconds = now - self.last_end
            self.times.append(seconds)
            self.record["step_times"].append([self.steps, seconds, self.method.label])
        self.steps += 1
        self.phase_steps += 1
        if self.phase == "trial" and (self.phase_steps >= self._trial_length(self.method) or self._hopeless()):
            self._trial_done()
        elif self.phase == "committed":
            self._maybe_recheck()
        self.last_end = time.perf_counter()

    def update_stats(self) -> None:
        if self.current is not None:
            self.current.update_stats()
            self.stats = self.current.stats
        self.stats.extra["auto"] = {"choice": self.record["choice"], "switches": len(self.record["switches"])}

    def run_record(self) -> dict:
        """The record's ``auto`` section (docs/PERFORMANCE.md, "auto's record")."""
        return self.record

    def close(self) -> None:
        if self.current is not None:
            self.current.finish()

    # ---- calibration and prediction
    def _start(self, args, kwargs) -> None:
        start = time.perf_counter()
        self.compute_s = _agree_max([compute_seconds(self.module, args, kwargs)])[0]
        batch = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)
        self.batch_size = batch
        self._predict(first=True)
        self.record["selection_s"] += time.perf_counter() - start
        self._begin_round("start")
        self.last_end = time.perf_counter()

    def _predict(self, first: bool) -> None:
        start = time.perf_counter()
        cal = calibrate(max_bytes=CALIBRATION_MAX_BYTES, budget_s=CALIBRATION_BUDGET_S, references=False)
        shapes = tuple(tuple(p.shape) for p in self.module.parameters() if p.requires_grad)
        methods = advise.candidates(strategy_infos(self.strategies),
                                    [c for c in COMPRESSIONS if c == "none" or family_of_spec(c) in self.allow],
                                    [LOCAL_SGD_INTERVAL])
        methods = [m for m in methods if m.kind == "gradient" or m.outer == LOCAL_SGD_OUTER]
        specs = sorted({m.compression for m in methods if m.compression != "none"})
        codecs = {}
        if specs:
            if first or not hasattr(self, "codecs"):
                world = dist.get_world_size() if dist.is_initialized() else 1
                alone = [dist.new_group([r]) for r in range(world)][dist.get_rank()] if world > 1 else None
                measured = time_codecs(specs, shapes, calls=2, group=alone)
                self.codecs = dict(zip(specs, _agree_max([measured[s] for s in specs])))
            codecs = self.codecs
        workers = self.workers
        workload = advise.Workload(shapes=shapes, workers=workers, batch_size=self.batch_size,
                                   compute_s=self.compute_s)
        p = cal.params
        network = advise.Network(alpha_s=p.alpha_s, bucket=TokenBucket(burst_bytes=0, beta_s_per_byte=p.beta_s_per_byte),
                                 gamma_s_per_byte=p.gamma_s_per_byte, codec_s=codecs, name="auto")
        advice = advise.advise(workload, network, methods)
        self.ranked = advice["predictions"]
        self.record["calibrations"].append({"step": self.steps, "alpha_s": p.alpha_s,
                                            "beta_s_per_byte": p.beta_s_per_byte,
                                            "rate_Mbit_s": 8e-6 / p.beta_s_per_byte if p.beta_s_per_byte else None,
                                            "gamma_s_per_byte": p.gamma_s_per_byte, "compute_s": self.compute_s,
                                            "codec_s": dict(codecs), "elapsed_s": time.perf_counter() - start})
        self.record["predicted"].append({"step": self.steps, "ranked": [
            {**{k: q.as_dict()[k] for k in ("label", "step_s", "exposed_s", "bytes_per_step", "eligible")},
             "family": family(q.method) or "exact",
             "allowed": family(q.method) is None or family(q.method) in self.allow} for q in self.ranked]})

    # ---- trials and the choice
    def _begin_round(self, why: str) -> None:
        picked = choose_trials(self.ranked, self.allow, self.options.auto_candidates)
        if not picked:   # cannot happen with the exact methods registered; said plainly if it does
            raise ConfigError("auto_allow", "no method is eligible to try")
        self.round = len(self.record["choices"]) if "choices" in self.record else 0
        self.trials = [{"round": self.round, "label": p.method.label, "train_args": p.method.train_args(),
                        "predicted_step_s": p.step_s, "method": p.method} for p in picked]
        incumbent = self.method
        if incumbent is not None:
            # a re-check: the method running now is tried first (no switch to start with), even if re-ranked out
            mine = [t for t in self.trials if t["method"] == incumbent] or [{
                "round": self.round, "label": incumbent.label, "train_args": incumbent.train_args(),
                "predicted_step_s": next((q.step_s for q in self.ranked if q.method == incumbent), None),
                "method": incumbent}]
            self.trials = mine + [t for t in self.trials if t["method"] != incumbent]
        self.trial_index = 0
        self.phase = "trial"
        if incumbent is not None:
            self.phase_steps, self.times = 0, []
        else:
            self._switch_to(self.trials[0]["method"], why)

    def _trial_length(self, method: advise.Method) -> int:
        """Steps a trial runs: its warm-up (DDP's first step, the compressor's uncompressed ones) plus the timed ones;
        local SGD: whole intervals (an averaging included) covering at least the timed steps."""
        if method.kind == "average":
            return method.sync_every * max(1, math.ceil(self.options.auto_trial_steps / method.sync_every))
        return self._warmup(method) + self.options.auto_trial_steps

    @staticmethod
    def _warmup(method: advise.Method) -> int:
        if method.kind == "average":
            return 0
        name, _, arg = method.compression.partition(":")
        return max(1, int(arg.split(":")[1]) if name == "powersgd" and arg.count(":") else 1)

    def _hopeless(self) -> bool:
        """After its first timed step, is this trial already EARLY_STOP_FACTOR x the best measured this round?
        (One small all-reduce, once per trial: every rank stops alike.)"""
        done = [t["measured_step_s"] for t in self.trials[:self.trial_index]]
        if not done or self.method.kind == "average" or self.phase_steps != self._warmup(self.method) + 1:
            return False
        first = _agree_max([self.times[-1]])[0]
        return first > EARLY_STOP_FACTOR * min(done)

    def _measured(self, method: advise.Method) -> float:
        """This rank's step of the phase just run (times[i] is the phase's step i), its warm-up left out."""
        timed = self.times[self._warmup(method):]
        if not timed:
            return math.inf
        return sum(timed) / len(timed) if method.kind == "average" else statistics.median(timed)

    def _trial_done(self) -> None:
        trial = self.trials[self.trial_index]
        trial["measured_step_s"] = _agree_max([self._measured(self.method)])[0]
        trial["steps"], trial["start_step"] = self.phase_steps, self.steps - self.phase_steps
        self.trial_index += 1
        if self.trial_index < len(self.trials):
            self._switch_to(self.trials[self.trial_index]["method"], "trial")
            return
        self.record["trials"] += [{k: v for k, v in t.items() if k != "method"} for t in self.trials]
        best = min(self.trials, key=lambda t: t["measured_step_s"])
        incumbent = self.trials[0] if self.baseline is not None else None   # a re-check's first trial: the incumbent
        if incumbent is not None and best is not incumbent and \
                best["measured_step_s"] > (1 - SWITCH_MARGIN) * incumbent["measured_step_s"]:
            best = incumbent   # hysteresis: not faster by the margin, stay
        trial_steps = sum(t["steps"] for t in self.trials)
        trial_s = sum(t["measured_step_s"] * t["steps"] for t in self.trials)
        # the time the trials cost beyond running the chosen method all along (its measured step)
        self.record["selection_s"] += max(trial_s - best["measured_step_s"] * trial_steps, 0.0)
        if best["method"] != self.method:
            self._switch_to(best["method"], "commit")
        else:
            runtime.print0(f"auto: step {self.steps}: committed to {best['label']} "
                           f"(measured {1e3 * best['measured_step_s']:.1f} ms per step)")
        choice = {"step": self.steps, "label": best["label"], "train_args": best["train_args"],
                  "measured_step_s": best["measured_step_s"], "predicted_step_s": best["predicted_step_s"],
                  "round": self.round, "since_step": self.built_at}
        self.record["choice"] = choice
        self.record.setdefault("choices", []).append(choice)
        self.phase = "committed"
        self.baseline = {"step_s": best["measured_step_s"], "wait_s": max(best["measured_step_s"] - self.compute_s, 0.0)}
        if self.options.auto_recheck:
            self.baseline["link_s"] = self._probe_link()
            self.baseline["link_probes"] = [self.baseline["link_s"]]
        self.last_recheck = self.steps

    def _switch_to(self, method: advise.Method, why: str) -> None:
        """Hand the job over at this step boundary: the method running finishes, ``method`` is built on the same
        module and optimizer."""
        start = time.perf_counter()
        before = self.method.label if self.method else None
        if self.current is not None:
            self.current.finish()     # local SGD averages (the replicas equal again); hooks and threads end
            if not self.current.spec.replicated:
                # local steps left each rank its own optimizer state (momentum of its own gradients): the method
                # coming next steps one global state, so the ranks' are averaged (exactly what DDP's step needs)
                average_(optimizer_tensors(self.optimizer), algorithm="ring")
            self.current.update_stats()
            self.record.setdefault("left", []).append({"label": before, "stats": self.current.stats.as_dict()})
            self.current = None
            gc.collect()              # the old DDP's reducer (its autograd hooks) goes now, not at some later step
        spec = self.strategies[method.strategy]
        first = before is None   # the first build broadcasts rank 0's state, as every strategy does at its start
        with contextlib.nullcontext() if first else handover():
            self.current = spec.build(self.module, self.optimizer, method_options(self.options, method))
        if not first:
            # the parameters are equal on every rank at a step boundary (exact methods by construction, local SGD
            # after its last averaging); buffers (BatchNorm's statistics) need not be under DDP: rank 0's, as DDP's rule
            buffers = list(self.module.buffers())
            if buffers and dist.is_initialized() and dist.get_world_size() > 1:
                with torch.no_grad():
                    for b in buffers:
                        dist.broadcast(b, 0)
        self.current.spec = spec
        self.method, self.built_at = method, self.steps
        self.phase_steps, self.times = 0, []
        seconds = time.perf_counter() - start
        self.record["selection_s"] += seconds
        self.record["switches"].append({"step": self.steps, "from": before, "to": method.label, "why": why,
                                        "seconds": seconds})
        runtime.print0(f"auto: step {self.steps}: {before or 'start'} -> {method.label} ({why})")
        self.last_end = time.perf_counter()   # the step after a switch is timed from here, the build left out

    # ---- re-check while running
    def _maybe_recheck(self) -> None:
        factor = self.options.auto_recheck
        window = max(2 * self.options.auto_trial_steps, 10)
        if self.method.kind == "average":
            window = self.method.sync_every * max(1, math.ceil(window / self.method.sync_every))
        if not factor or self.phase_steps % window or len(self.times) < window:
            return
        now = _agree_max([self._window(window)])[0]
        base = self.baseline
        wait = max(now - self.compute_s, 0.0)
        moved, ratio = drifted(now, base["step_s"], self.compute_s, factor)
        link = self._probe_link()
        # the link's baseline: the median of the probes since the choice (one probe taken in a load spike would
        # make every later one look faster); a drifting window's probe does not join it
        link_base = statistics.median(base["link_probes"]) if base.get("link_probes") else None
        link_ratio = link / link_base if link_base else 1.0
        link_moved = link_ratio > factor or link_ratio < 1 / factor
        if link_base and not link_moved:
            base["link_probes"] = (base["link_probes"] + [link])[-5:]
        moved = moved or link_moved
        self.drifting = self.drifting + 1 if moved else 0
        if self.drifting < DRIFT_WINDOWS or self.steps - self.last_recheck < RECHECK_GAP_WINDOWS * window:
            return
        self.drifting = 0
        entry = {"step": self.steps, "label": self.method.label, "step_s": now, "wait_s": wait,
                 "baseline_step_s": base["step_s"], "baseline_wait_s": base["wait_s"], "ratio": ratio,
                 "link_s": link, "baseline_link_s": link_base, "link_ratio": link_ratio}
        self.record["rechecks"].append(entry)
        runtime.print0(f"auto: step {self.steps}: the communication wait of {self.method.label} moved x{ratio:.2f} "
                       f"({1e3 * base['wait_s']:.1f} -> {1e3 * wait:.1f} ms), the link's 128 KiB exchange "
                       f"x{link_ratio:.2f}; re-ranking")
        start = time.perf_counter()
        self._predict(first=False)
        self.record["selection_s"] += time.perf_counter() - start
        self.last_recheck = self.steps
        self._begin_round("recheck")

    def _probe_link(self) -> float:
        """Seconds of a pairwise exchange of LINK_PROBE_BYTES (slowest rank); its time counts as selection time."""
        start = time.perf_counter()
        seconds = exchange_time(LINK_PROBE_BYTES, budget_s=LINK_PROBE_BUDGET_S)
        self.record["selection_s"] += time.perf_counter() - start
        return seconds

    def _window(self, window: int) -> float:
        recent = self.times[-window:]
        return sum(recent) / len(recent) if self.method.kind == "average" else statistics.median(recent)


def drifted(step_s: float, baseline_step_s: float, compute_s: float, factor: float) -> tuple[bool, float]:
    """(has the communication wait moved by ``factor`` either way, its ratio): the wait is the step time less the
    compute step; a move must also change the step time by NOISE_FLOOR (a tiny wait's ratio is noise)."""
    floor = WAIT_FLOOR * baseline_step_s   # a wait below a tenth of the step is "none": its ratio is noise
    wait, base = max(step_s - compute_s, floor), max(baseline_step_s - compute_s, floor)
    ratio = wait / base if base > 0 else 1.0
    moved = abs(step_s - baseline_step_s) > NOISE_FLOOR * baseline_step_s
    return moved and (ratio > factor or ratio < 1 / factor), ratio


def family_of_spec(spec: str) -> str | None:
    """The ``--auto-allow`` word of a compression spec (None for none)."""
    return None if spec == "none" else spec.partition(":")[0]
