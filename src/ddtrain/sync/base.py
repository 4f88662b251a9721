"""What every strategy is and reports: ``SyncOptions`` in, a ``Strategy`` (with its ``SyncStats``) out.

``Strategy`` is also the single-process strategy: at world size 1 ``ddtrain.sync.wrap`` returns
one of these, with the model and optimizer unchanged and no communication, whatever was asked.
"""
from __future__ import annotations

import typing
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ddtrain.comm import compression
from ddtrain.distributed import runtime
from ddtrain.errors import ConfigError, check_choices

# ps-async's corrections for asynchrony (docs/ALGORITHMS.md); the choices of --async-rule
AsyncRule = Literal["dana", "staleness", "lr-staleness", "momentum", "momentum-subtract", "lr-workers",
                    "lr-staleness-momentum", "lr-workers-momentum", "lr-staleness-no-momentum", "dc-staleness",
                    "dc-lr-workers", "plain"]
ASYNC_RULES = typing.get_args(AsyncRule)


@dataclass(kw_only=True)
class SyncOptions:
    """Strategy settings; each strategy reads the ones it needs (its StrategySpec.options)."""

    # Every rank must read the same ones (replicas, collectives and servers step together); a resume
    # may change them except the parameter servers' count and local SGD's outer optimizer, whose state
    # the checkpoint holds (ddtrain.config explains the metadata).

    sync_every: int | str = field(default=1, metadata={"agree": True, "resume": "may-change"})   # hybrid / local-sgd: steps between parameter syncs, or "epoch"
    servers: int = field(default=1, metadata={"agree": True, "resume": "same"})   # ps-*: how many ranks hold parameters
    staleness: int = field(default=4, metadata={"agree": True, "resume": "may-change"})   # ps-async: most versions a gradient may lag
    async_rule: AsyncRule = field(default="dana", metadata={"agree": True, "resume": "may-change"})   # ps-async: how updates are corrected for asynchrony (docs/ALGORITHMS.md): dana = lr/workers, a momentum per worker and look-ahead parameters (SGD; other optimizers get staleness); plain applies gradients as they come
    bucket_cap_mb: float = field(default=25.0, metadata={"agree": True, "resume": "may-change"})   # DDP gradient bucket size (MB)
    find_unused_parameters: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # DDP: allow parameters that get no gradient on some steps (branches, unused heads)
    static_graph: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # DDP: the set of used parameters never changes between steps
    gradient_as_bucket_view: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # DDP: gradients are views into the buckets (saves one copy of memory)
    no_broadcast_buffers: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # DDP: do not broadcast rank 0's buffers before each forward (broadcast_buffers=False)
    sync_batchnorm: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # convert BatchNorm layers to SyncBatchNorm (DDP-based strategies, CUDA)
    check_every: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # steps between replica-divergence checks (0: at epoch ends only)
    timeout_s: float | None = None   # ps-*: seconds a rank waits on a peer (None: ddtrain.init()'s timeout)
    outer_optimizer: Literal["average", "nesterov"] = field(default="average", metadata={"agree": True, "resume": "same"})   # local-sgd: at each averaging, 'average' takes the replicas' mean; 'nesterov' is DiLoCo's outer SGD with Nesterov momentum on the averaged parameter change (docs/ALGORITHMS.md)
    outer_lr: float | None = field(default=None, metadata={"agree": True, "resume": "may-change"})   # local-sgd --outer-optimizer nesterov: outer learning rate (default 0.7, DiLoCo's)
    outer_momentum: float | None = field(default=None, metadata={"agree": True, "resume": "may-change"})   # local-sgd --outer-optimizer nesterov: outer Nesterov momentum (default 0.9, DiLoCo's; 0: plain outer SGD)
    local_sgd_warmup_steps: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # local-sgd: average the gradients every step for this many first steps (post-local SGD), local steps after
    adaptive_interval: bool = field(default=False, metadata={"agree": True, "resume": "may-change"})   # local-sgd: choose each interval from the measured divergence and averaging time, starting at --sync-every (docs/ALGORITHMS.md)
    adaptive_min_interval: int = field(default=1, metadata={"agree": True, "resume": "may-change"})   # local-sgd --adaptive-interval: the shortest interval (steps)
    adaptive_max_interval: int = field(default=100, metadata={"agree": True, "resume": "may-change"})   # local-sgd --adaptive-interval: the longest interval (steps)
    adaptive_comm_fraction: float = field(default=0.1, metadata={"agree": True, "resume": "may-change"})   # local-sgd --adaptive-interval: the averaging may take this fraction of the interval's compute time
    adaptive_max_divergence: float = field(default=0.1, metadata={"agree": True, "resume": "may-change"})   # local-sgd --adaptive-interval: bound on the replicas' relative spread at an averaging (docs/PERFORMANCE.md; 0.026-0.147 measured at K=20 on MNIST, where DiLoCo matched ddp: results/diloco/cluster_100mbit.json)
    shard_algorithm: str = field(default="native", metadata={"agree": True, "resume": "may-change"})   # zero1/zero2: the ddtrain.comm algorithm of the gradient reduction and the parameter all-gather (ring: its own reduce-scatter and all-gather phases; native: torch's; others: their all-reduce, docs/SHARDING.md)
    fsdp_param_dtype: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata={"agree": True, "resume": "may-change"})   # fsdp: the dtype parameters are all-gathered and computed in (FSDP2's MixedPrecisionPolicy; gradients are reduced in fp32)
    compression: str = field(default="none", metadata={"agree": True, "resume": "may-change"})   # gradient compression: none, fp16, bf16, powersgd:RANK[:WARMUP_STEPS], topk:FRACTION (docs/ALGORITHMS.md)
    auto_allow: str = field(default="", metadata={"agree": True, "resume": "may-change"})   # auto: method families that change the optimisation it may choose, comma-separated: fp16, bf16, powersgd, topk, local-sgd (default: exact methods only; docs/AUTO.md states each risk)
    auto_candidates: int = field(default=3, metadata={"agree": True, "resume": "may-change"})   # auto: how many of the predicted best methods it tries on the job's links
    auto_trial_steps: int = field(default=5, metadata={"agree": True, "resume": "may-change"})   # auto: timed steps of each trial (after its warm-up; local SGD: whole intervals)
    auto_recheck: float = field(default=1.5, metadata={"agree": True, "resume": "may-change"})   # auto: re-rank and re-try when the committed method's communication wait moves by this factor (0: never)

    @property
    def broadcast_buffers(self) -> bool:
        """DDP's ``broadcast_buffers`` (a switch that defaults off is how the CLI spells "default on")."""
        return not self.no_broadcast_buffers

    def __post_init__(self):
        check_choices(self)
        if self.sync_every != "epoch" and (not isinstance(self.sync_every, int) or self.sync_every < 1):
            raise ConfigError("sync_every", f"must be a positive integer or 'epoch', got {self.sync_every!r}")
        if self.servers < 1:
            raise ConfigError("servers", f"must be at least 1, got {self.servers}")
        if self.staleness < 0:
            raise ConfigError("staleness", f"must be >= 0, got {self.staleness}")
        if self.bucket_cap_mb <= 0:
            raise ConfigError("bucket_cap_mb", f"must be positive, got {self.bucket_cap_mb}")
        if self.check_every < 0:
            raise ConfigError("check_every", f"must be >= 0, got {self.check_every}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError("timeout_s", f"must be positive, got {self.timeout_s}")
        try:
            compression.check_spec(self.compression)
        except ValueError as exc:   # "compression <what is wrong>"
            raise ConfigError("compression", str(exc).partition(" ")[2]) from None
        self._check_local_sgd()

    def _check_local_sgd(self) -> None:
        """local-sgd's settings (ddtrain.sync.local_sgd reads them)."""
        for name in ("outer_lr", "outer_momentum"):
            if getattr(self, name) is not None and self.outer_optimizer == "average":
                raise ConfigError(name, f"is read with outer_optimizer='nesterov' only ('average' is outer lr 1 "
                                        f"and momentum 0), got {getattr(self, name)}")
        if self.outer_lr is not None and not self.outer_lr > 0:
            raise ConfigError("outer_lr", f"must be positive, got {self.outer_lr}")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_momentum", f"must be in [0, 1), got {self.outer_momentum}")
        if not isinstance(self.local_sgd_warmup_steps, int) or self.local_sgd_warmup_steps < 0:
            raise ConfigError("local_sgd_warmup_steps", f"must be a non-negative integer, got "
                                                        f"{self.local_sgd_warmup_steps!r}")
        if not 1 <= self.adaptive_min_interval <= self.adaptive_max_interval:
            raise ConfigError("adaptive_min_interval", f"must be >= 1 and <= adaptive_max_interval "
                                                       f"({self.adaptive_max_interval}), got {self.adaptive_min_interval}")
        if not self.adaptive_comm_fraction > 0:
            raise ConfigError("adaptive_comm_fraction", f"must be positive, got {self.adaptive_comm_fraction}")
        if not self.adaptive_max_divergence > 0:
            raise ConfigError("adaptive_max_divergence", f"must be positive, got {self.adaptive_max_divergence}")
        if self.adaptive_interval and not (isinstance(self.sync_every, int)
                                           and self.adaptive_min_interval <= self.sync_every <= self.adaptive_max_interval):
            raise ConfigError("sync_every", f"must be an integer between adaptive_min_interval ({self.adaptive_min_interval}) "
                                            f"and adaptive_max_interval ({self.adaptive_max_interval}) with adaptive_interval: "
                                            f"it is the first interval; got {self.sync_every!r}")


@dataclass
class SyncStats:
    """Traffic and waiting of this rank. ``method`` says whether bytes were counted or computed."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    comm_wait_s: float = 0.0
    method: str = "counted"
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent, "messages_received": self.messages_received,
                "comm_wait_s": round(self.comm_wait_s, 6), "method": self.method, **self.extra}


class Strategy:
    """A strategy applied on this rank: call ``model``, step ``optimizer``, read ``stats``.

    ``role`` is "worker" for ranks that train on data, "server" for parameter-server ranks,
    which run ``serve()`` instead of the training loop. The loop (and ``prepare``'s optimizer
    wrapper) calls ``after_step(step)`` and ``end_epoch(epoch)``; ``finish()`` runs once when
    training ends, from the loop or else from ``ddtrain.shutdown()``. Subclasses override the
    hooks they need and put what ``finish`` does in ``close()``; state lives in attributes.

    ``no_sync()`` and ``optimizer_step()`` are what ``prepare``'s model and optimizer call; a
    strategy whose communication is not DDP's overrides them (see each).
    """

    def __init__(self, model: nn.Module, optimizer, *, module: nn.Module | None = None,
                 stats: SyncStats | None = None, role: str = "worker", workers: int | None = None,
                 worker_rank: int | None = None, group=None):
        distributed = dist.is_initialized()
        self.model = model                                   # what the loop calls (e.g. DDP-wrapped)
        self.module = model if module is None else module    # the bare model, for evaluation and saving
        self.optimizer = optimizer                           # what the loop steps
        self.stats = stats if stats is not None else SyncStats()
        self.role = role
        # ranks that train on data, and this rank's index among them (default: every rank)
        self.workers = workers if workers is not None else (dist.get_world_size() if distributed else 1)
        self.worker_rank = worker_rank if worker_rank is not None else (dist.get_rank() if distributed else 0)
        self.group = group                                   # process group of the workers (None: every rank)
        self.spec = None                                     # the StrategySpec it was built from (set by ``wrap``)
        self.monitor = None                                  # a DivergenceMonitor, where the strategy keeps one
        self.memory = None                                   # a sync.memory.MemoryMeter (set by ``wrap``)
        self.accumulating = 0                                # how many ``no_sync()`` contexts are open
        self._sync_gradients = True                          # require_backward_grad_sync where no DDP holds it
        self._finished = False

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch (nanoGPT's idiom sets it to skip the all-reduce of a micro-batch): False inside ``no_sync()``.

        DDP's own attribute when the model runs through DDP; otherwise this strategy's, which its
        step reads (the parameter servers refuse a step while it is off, as inside ``no_sync()``).
        """
        if isinstance(self.model, DistributedDataParallel):
            return self.model.require_backward_grad_sync
        return self._sync_gradients

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.require_backward_grad_sync = bool(value)
        else:
            self._sync_gradients = bool(value)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: inside, backward passes add to this rank's gradients and communicate nothing.

        The contract, for every strategy and world size: gradients of the backward passes run
        inside stay on this rank (summed, as PyTorch does); the next backward pass outside it
        (DDP-based strategies) or the next optimizer step (the others) synchronises everything
        accumulated, so k micro-batches, k-1 of them inside ``no_sync()``, give the step of one
        batch k times larger. Step the optimizer outside the context. Here: DDP's own
        ``no_sync()`` when the model is DDP-wrapped, and ``self.accumulating`` counts the open
        contexts for strategies that communicate elsewhere (they override this or read it).
        """
        inner = self.model.no_sync() if isinstance(self.model, DistributedDataParallel) else nullcontext()
        before = self._sync_gradients
        self.accumulating += 1
        self._sync_gradients = False
        try:
            with inner:
                yield
        finally:
            self.accumulating -= 1
            self._sync_gradients = before

    def optimizer_step(self, optimizer, user_step, closure=None):
        """One ``step()`` of a prepared optimizer: ``user_step`` is the user's optimizer class's own step.

        Default: run it. A strategy that replaced the optimizer by its own stepping object
        (``self.optimizer`` is then no ``torch.optim.Optimizer``) steps that object instead;
        strategies whose step is communication (parameter servers) may override this.
        ``after_step`` is called by the caller, once per step of every optimizer of the model.
        """
        if self.optimizer is not None and not isinstance(self.optimizer, (torch.optim.Optimizer, list)):
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        return user_step(closure) if closure is not None else user_step()

    def after_step(self, step: int) -> None:
        if self.monitor is not None:
            self.monitor.after_step()

    def end_epoch(self, epoch: int) -> None:
        if self.monitor is not None:
            self.monitor.end_epoch(epoch)

    def last_batch(self) -> None:
        """``prepare``'s training loader gave the last batch of a pass: the next step ends it (local-sgd averages)."""

    def serve(self) -> None:
        """A server's whole run (parameter servers); workers never call it."""

    def update_stats(self) -> None:
        """Refresh ``stats`` before it is read."""

    def state_dict(self) -> dict:
        """The strategy's own state between steps (its sync schedule, an outer optimizer), for checkpoints.

        The same on every rank (a checkpoint at another world size gives new ranks rank 0's); what
        differs per rank, a gradient compressor's state, is ``compressor_state_dict``.
        """
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back ``state_dict()``'s state; called after the model's and the optimizer's are loaded."""

    def compressor_state_dict(self) -> dict:
        """This rank's gradient-compressor state (error feedback, PowerSGD's Q and step count), for checkpoints.

        Saved per rank; at another world size ``ddtrain.comm.compression.merge_states`` makes the
        new ranks' from the old ones'. {} for a strategy without a compressor.
        """
        return {}

    def load_compressor_state_dict(self, state: dict) -> str | None:
        """Take back ``compressor_state_dict()``'s state; returns a note when it is not taken (None: taken, or none)."""
        if state.get("compression"):
            return (f"the compressor state of compression {state.get('compression')} is not restored: this run "
                    "has no compressor (world size 1, or a strategy that compresses nothing)")
        return None

    def replicas_identical(self, step: int) -> bool:
        """Are the replicas bitwise identical after ``step``? (Default: the spec's ``replicated``.)"""
        return self.spec.replicated

    def finish(self) -> None:
        """End the strategy: runs ``close()`` exactly once, however often it is called."""
        if self._finished:
            return
        self._finished = True
        if self.memory is not None:   # the bytes this rank held at its optimizer steps, in the record
            self.stats.extra["memory"] = self.memory.as_dict()
            self.memory.close()
        if self.finish in runtime.AT_SHUTDOWN:   # registered by ``wrap``; gone when shutdown() is the caller
            runtime.AT_SHUTDOWN.remove(self.finish)
        self.close()

    def close(self) -> None:
        """What ``finish`` does (last messages, a last averaging, threads to stop)."""


def single_process(model: nn.Module, optimizer) -> Strategy:
    """World size 1: the model and optimizer unchanged, nothing to communicate."""
    return Strategy(model, optimizer, stats=SyncStats(method="none: world size 1"), workers=1, worker_rank=0)
