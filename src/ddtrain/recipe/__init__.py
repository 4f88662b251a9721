"""The training recipe built from its settings (``RecipeConfig``): batch arithmetic, the optimizer, the lr schedule, clipping.

A leaf beside ``models`` and ``data``: it knows torch, not distribution (a worker count is a
number) nor the loop, so ``ddtrain.config`` nests its section and ``training`` uses it.

Batch: ``global_batch_size`` G gives each rank micro-batches of G / (workers x grad_accum).
Optimizer: sgd, adam or adamw over two parameter groups when norms and biases are kept out of
weight decay (the default for adamw), at ``lr`` scaled by the global batch over
``lr_reference_batch`` (``scale_lr="linear"`` as Goyal et al. 2017 and Horovod, or ``"sqrt"``).
Schedule: a ``torch.optim.lr_scheduler.LambdaLR`` over optimizer updates, the factor a pure
function (``lr_factor``) of the update index, warm-up first. The schedule advances, and the
gradient clipping runs, in hooks on the optimizer's own ``step``, so they act wherever that
step runs: after DDP's averaged backward, after a GradScaler's unscale, and on the parameter
servers, which hold the optimizer for ps-sync and ps-async.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ddtrain.errors import ConfigError
from ddtrain.recipe.config import OPTIMIZERS, SCHEDULES, RecipeConfig

__all__ = ["OPTIMIZERS", "SCHEDULES", "Plan", "RecipeConfig", "Schedule", "build_optimizer", "clip_gradients",
           "global_batch", "grad_accum_for", "loss_function", "lr_factor", "per_rank_batch", "plan", "resolve",
           "scaled_lr", "updates_per_epoch", "worker_counts"]
# torch's OneCycleLR defaults: start at max/25, end at start/1e4, 30% of the run rising
ONECYCLE_DIV, ONECYCLE_FINAL_DIV, ONECYCLE_PCT = 25.0, 1e4, 0.3


# ---- batch arithmetic ----

def per_rank_batch(config: RecipeConfig, workers: int) -> int:
    """Samples per micro-batch on each rank: ``global_batch_size / (workers x grad_accum)``, else ``batch_size``."""
    if not config.global_batch_size:
        return config.batch_size
    parts = workers * config.grad_accum
    if config.global_batch_size % parts:
        raise ConfigError("global_batch_size", f"{config.global_batch_size} does not divide into {workers} worker(s) "
                          f"x grad_accum {config.grad_accum} = {parts} equal micro-batches "
                          f"(nearest that do: {_near(config.global_batch_size, parts)}; worker counts that divide "
                          f"it with grad_accum {config.grad_accum}: "
                          f"{_listed(worker_counts(config.global_batch_size, config.grad_accum))})")
    return config.global_batch_size // parts


def _near(total: int, parts: int) -> str:
    low = total // parts * parts
    return ", ".join(str(v) for v in (low, low + parts) if v > 0)


def _listed(values: list[int], most: int = 12) -> str:
    return ", ".join(map(str, values[:most])) + (", ..." if len(values) > most else "")


def worker_counts(global_batch: int, grad_accum: int = 1) -> list[int]:
    """The worker counts R for which ``global_batch`` splits into R x ``grad_accum`` equal micro-batches."""
    return [r for r in range(1, global_batch // grad_accum + 1) if global_batch % (r * grad_accum) == 0]


def grad_accum_for(global_batch: int, workers: int, grad_accum: int) -> int | None:
    """The gradient accumulation that keeps ``global_batch`` on ``workers`` ranks (a resume at another size).

    ``grad_accum`` itself when ``workers x grad_accum`` divides the global batch; else the
    smallest larger value that does (per-rank micro-batches no larger than asked), else the
    largest smaller one; None when ``workers`` does not divide the global batch at all.
    """
    if global_batch % workers:
        return None
    fits = [k for k in range(1, global_batch // workers + 1) if global_batch % (workers * k) == 0]
    larger = [k for k in fits if k >= grad_accum]
    return larger[0] if larger else fits[-1]


def global_batch(config: RecipeConfig, workers: int) -> int:
    """Samples per optimizer update over all workers."""
    return per_rank_batch(config, workers) * workers * config.grad_accum


def resolve(config: RecipeConfig, workers: int, resuming: bool = False) -> RecipeConfig:
    """``config`` with ``batch_size`` the per-rank micro-batch (what the results record stores).

    ``resuming``: a run that continues a checkpoint keeps its global batch on any worker count
    that divides it, with the gradient accumulation ``grad_accum_for`` chooses where
    ``grad_accum`` does not fit (``fit`` says so in one line); a worker count that does not
    divide the global batch is refused, naming those that do. (``TrainConfig.resolved`` applies
    it to a whole configuration.)
    """
    import dataclasses
    total, k = config.global_batch_size, config.grad_accum
    if total and resuming and total % (workers * k):
        fits = grad_accum_for(total, workers, k)
        if fits is None:
            raise ConfigError("global_batch_size", f"{total} samples cannot be shared by {workers} worker(s), so a "
                              f"resume on {workers} cannot keep the run's global batch; worker counts that can: "
                              f"{_listed(worker_counts(total))}")
        config = dataclasses.replace(config, grad_accum=fits)
    batch = per_rank_batch(config, workers)
    return config if batch == config.batch_size else dataclasses.replace(config, batch_size=batch)


def scaled_lr(config: RecipeConfig, workers: int) -> float:
    """``lr`` times (global batch / reference batch), or its square root, or 1 (``scale_lr``)."""
    ratio = global_batch(config, workers) / config.lr_reference_batch
    return config.lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.scale_lr]


# ---- optimizer ----

def excludes_norms_and_biases(config: RecipeConfig) -> bool:
    return config.decay_exclude == "norms-biases" or (config.decay_exclude == "auto" and config.optimizer == "adamw")


def param_groups(model: nn.Module, weight_decay: float, exclude_norms_and_biases: bool) -> list[dict]:
    """One group, or two: decayed weights and undecayed norms and biases (every parameter of one dimension).

    One-dimensional parameters are biases and the scales and shifts of normalisation layers
    (BatchNorm, LayerNorm, GroupNorm): decaying them only pulls normalised activations to zero
    (Goyal et al. 2017, and nanoGPT's ``configure_optimizers``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not exclude_norms_and_biases or not weight_decay:
        return [{"params": params, "weight_decay": weight_decay}]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
            if g["params"]]


def build_optimizer(config: RecipeConfig, model: nn.Module, workers: int = 1) -> torch.optim.Optimizer:
    """The optimizer ``config`` names over ``model``'s parameters, at the scaled learning rate."""
    lr = scaled_lr(config, workers)
    groups = param_groups(model, config.weight_decay, excludes_norms_and_biases(config))
    # On CUDA one fused kernel updates every parameter instead of for-each launches: +0.3 % on a
    # compiled bf16 ResNet-50 on one H100 (5,847 against 5,829 images/s, median of 3 rounds each:
    # results/gpu1_issue20/defaults4.json). The CPU keeps the for-each path its tests pin.
    fused = {"fused": True} if all(p.is_cuda and p.is_floating_point() for p in model.parameters()) else {}
    if config.optimizer == "adam":
        return torch.optim.Adam(groups, lr=lr, **fused)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **fused)
    return torch.optim.SGD(groups, lr=lr, momentum=config.momentum, **fused)


# ---- schedule ----

@dataclass(frozen=True)
class Plan:
    """The schedule's numbers in optimizer updates."""

    schedule: str
    total: int                 # updates in the whole run
    warmup: int                # updates of linear warm-up (counted inside total)
    milestones: tuple = ()     # step / multistep: updates at which lr is multiplied by gamma
    gamma: float = 0.1


def updates_per_epoch(micro_batches: int, grad_accum: int) -> int:
    """Optimizer updates in an epoch of ``micro_batches`` per rank (a last, incomplete group is dropped)."""
    return micro_batches // grad_accum


def plan(config: RecipeConfig, per_epoch: int, *, epochs: int, steps: int) -> Plan:
    """The schedule of ``config`` for a run of ``epochs`` (or ``steps``) of ``per_epoch`` updates (warm-up checked)."""
    total = epochs * per_epoch if epochs else steps
    if steps:
        total = min(total, steps)
    warmup = config.lr_warmup_steps or round(config.lr_warmup_epochs * per_epoch)
    if warmup and warmup >= total:
        given = config.lr_warmup_steps or f"{config.lr_warmup_epochs:g} ({warmup} updates)"
        raise ConfigError("lr_warmup_steps" if config.lr_warmup_steps else "lr_warmup_epochs",
                          f"{given} is not shorter than the run ({total} optimizer updates)")
    milestones: tuple = ()
    if config.lr_schedule == "multistep":
        epochs = _milestone_epochs(config.lr_milestones)
        milestones = tuple(round(e * per_epoch) for e in epochs) if epochs else \
            (warmup + (total - warmup) // 2, warmup + 3 * (total - warmup) // 4)
    elif config.lr_schedule == "step":
        period = round(config.lr_step_epochs * per_epoch) if config.lr_step_epochs else max((total - warmup) // 3, 1)
        milestones = tuple(range(warmup + period, total, max(period, 1)))
    return Plan(config.lr_schedule, total, warmup, milestones, config.lr_gamma)


def _milestone_epochs(text: str) -> list[float]:
    if not text:
        return []
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError("lr_milestones", f"takes comma-separated epochs (e.g. 30,60,80), got {text!r}") from None
    if values != sorted(values) or any(v <= 0 for v in values):
        raise ConfigError("lr_milestones", f"must be positive and increasing, got {text!r}")
    return values


def lr_factor(p: Plan, update: int) -> float:
    """The learning rate of update ``update`` (0-based) as a multiple of the peak ``--lr``."""
    if p.schedule == "onecycle":
        return _onecycle(p, update)
    if update < p.warmup:
        return (update + 1) / p.warmup      # linear warm-up, reaching the peak at the last warm-up update
    span = max(p.total - p.warmup, 1)
    done = min(update - p.warmup, span)
    if p.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * done / span))
    if p.schedule == "linear":
        return 1.0 - done / span
    if p.schedule in ("step", "multistep"):
        return p.gamma ** sum(1 for m in p.milestones if update >= m)
    return 1.0


def _onecycle(p: Plan, update: int) -> float:
    """torch's OneCycleLR (cosine phases, its defaults) as a factor; the warm-up sets the rising phase."""
    pct = p.warmup / p.total if p.warmup else ONECYCLE_PCT
    start, low = 1.0 / ONECYCLE_DIV, 1.0 / ONECYCLE_DIV / ONECYCLE_FINAL_DIV
    rise_end, end = pct * p.total - 1, p.total - 1
    update = min(update, end)

    def anneal(a, b, frac):
        return b + (a - b) / 2.0 * (math.cos(math.pi * frac) + 1)
    if update <= rise_end:
        return anneal(start, 1.0, update / rise_end if rise_end > 0 else 1.0)
    return anneal(1.0, low, (update - rise_end) / (end - rise_end) if end > rise_end else 1.0)


# The settings that, with the updates per epoch, fix the learning rate of every update. A resume that
# changes one of them can give the updates already trained another lr than the new settings would
# have: the run would then follow neither schedule (``schedule_change``).
SCHEDULE_SETTINGS = ("steps", "epochs", "lr_schedule", "lr_warmup_steps", "lr_warmup_epochs", "lr_step_epochs",
                     "lr_milestones", "lr_gamma")


def schedule_record(config, p: Plan) -> dict:
    """What a checkpoint keeps of the schedule (``config`` a TrainConfig): the plan in updates and its settings."""
    flat = config.flat()
    return {"plan": dataclasses.asdict(p), "settings": {name: flat[name] for name in SCHEDULE_SETTINGS}}


def _plan_from(record: dict) -> Plan | None:
    """The Plan of a ``schedule_record`` (None when it is not one this version wrote)."""
    values = record.get("plan") if isinstance(record, dict) else None
    names = {f.name for f in dataclasses.fields(Plan)}
    if not isinstance(values, dict) or set(values) != names:
        return None
    return Plan(**{**values, "milestones": tuple(values["milestones"])})


def _describe(p: Plan) -> str:
    warm = f" after {p.warmup} warm-up" if p.warmup else ""
    drops = f" (x{p.gamma:g} at {', '.join(map(str, p.milestones))})" if p.milestones else ""
    return f"{p.schedule} over {p.total} updates{warm}{drops}"


def schedule_change(saved: dict, now: dict, updates: int) -> str | None:
    """How resuming ``saved`` (a checkpoint's ``schedule_record``) after ``updates`` updates under ``now`` changes
    the schedule, in words naming the settings; None when the updates already trained had the lr ``now`` gives them.

    Only the past decides: the updates after the checkpoint follow ``now`` in the resumed run as in an uninterrupted
    one, so a resume is the same training as an uninterrupted run with ``now``'s settings exactly when every update
    before it had the same lr under both (more steps at a constant lr, or a step schedule with its period given, do).
    """
    old, new = _plan_from(saved), _plan_from(now)
    if old is None or old == new:   # None: a record of another version, which cannot be compared
        return None
    first = next((u for u in range(updates) if lr_factor(old, u) != lr_factor(new, u)), None)
    if first is None:
        return None
    was = saved.get("settings", {})
    changed = [f"{name} {was.get(name)!r} -> {value!r}" for name, value in now["settings"].items()
               if was.get(name, value) != value]
    return (f"{', '.join(changed) or 'the updates per epoch'}: {_describe(old)} -> {_describe(new)}; update "
            f"{first} trained at {lr_factor(old, first):.4g} x the peak lr, which these settings give "
            f"{lr_factor(new, first):.4g}")


class Schedule:
    """The learning rate over optimizer updates: a LambdaLR stepped by the optimizer's own ``step``.

    ``lr(update)`` answers without the optimizer (a parameter-server worker never steps its own
    optimizer: its servers do), so tracking reads the same curve on every rank.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, p: Plan):
        self.plan, self.optimizer = p, optimizer
        self.peak = [g["lr"] for g in optimizer.param_groups]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: lr_factor(p, u))
        # after each real update (not a GradScaler's skipped one), the next update's lr
        self._handle = optimizer.register_step_post_hook(lambda *_: self.scheduler.step())

    def lr(self, update: int) -> float:
        return self.peak[0] * lr_factor(self.plan, update)

    def jump_to(self, update: int) -> None:
        """Resume: the lr of update ``update`` (after a checkpoint restored the optimizer)."""
        self.scheduler.last_epoch = update
        for group, peak in zip(self.optimizer.param_groups, self.peak):
            group["lr"] = peak * lr_factor(self.plan, update)

    def remove(self) -> None:
        self._handle.remove()


def clip_gradients(optimizer: torch.optim.Optimizer, max_norm: float):
    """Clip the gradients of ``optimizer``'s parameters to total norm ``max_norm`` just before each of its steps.

    A pre-hook on ``step`` sees the gradients DDP has averaged, after a GradScaler's unscale, and
    on a parameter server the workers' mean (the global norm with one server; with several, each
    server clips its own shard). Returns the hook's handle.
    """
    def clip(opt, _args, _kwargs):
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        sharded = getattr(opt, "ddtrain_total_grad_norm", None)   # ZeRO: each rank holds a shard of the gradient
        if sharded is not None:
            norm = sharded()     # collective: the norm of the whole gradient, on every rank
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)   # clip_grad_norm_'s rule
            for p in params:
                p.grad.mul_(scale)
        elif params:
            torch.nn.utils.clip_grad_norm_(params, max_norm)
    return optimizer.register_step_pre_hook(clip)


def loss_function(task: str, label_smoothing: float = 0.0):
    """Cross-entropy (with ``label_smoothing``) for classification, mean squared error otherwise."""
    import torch.nn.functional as F
    if task == "classification":
        if label_smoothing:
            return lambda out, y: F.cross_entropy(out, y, label_smoothing=label_smoothing)
        return F.cross_entropy
    return F.mse_loss
