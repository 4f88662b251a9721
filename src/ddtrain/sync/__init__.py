"""How replicas stay consistent during training: one module per strategy, one line in STRATEGIES.

    ddp                  DDP with the backend's own all-reduce (the default)              ddp.py
    ring, ring-async,    DDP with that ddtrain.comm all-reduce as the communication       allreduce.py
    tree, butterfly,     hook (bucketing and overlap kept); one per algorithm in
    central              ddtrain.comm.ALGORITHMS but native (ddp's)
    ps-sync, ps-async    parameter servers on the last --servers ranks                   ps/
    hybrid               ring every step + rank 0's broadcast every K steps (000 ch. 5)   hybrid.py   } periodic.py
    local-sgd            local steps, parameters averaged every K steps                   local_sgd.py}

A strategy is a ``Strategy`` subclass (``base``) built by ``spec.build(model, optimizer, options)``;
``wrap`` looks the name up, handles world size 1 once for all of them (``single_process``: the
model and optimizer unchanged; the sharded ones, zero1, zero2 and fsdp, run as themselves when a
process group of one exists), and registers ``finish`` to run at ``ddtrain.shutdown()``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import partial

import torch
import torch.distributed as dist

from ddtrain import comm
from ddtrain.distributed import runtime
from ddtrain.errors import ConfigError, choice_error
from ddtrain.sync.allreduce import AllReduceStrategy, build_ddp
from ddtrain.sync.auto import NAME as AUTO_NAME, AutoStrategy, check as auto_check
from ddtrain.sync.base import Strategy, SyncOptions, SyncStats, single_process
from ddtrain.sync.fsdp import build_fsdp
from ddtrain.sync.hybrid import HybridStrategy
from ddtrain.sync.memory import MemoryMeter
from ddtrain.sync.local_sgd import ALGORITHM as LOCAL_SGD_ALGORITHM, LocalSGDStrategy
from ddtrain.sync.ps.protocol import wire_dtype
from ddtrain.sync.ps.strategy import build_param_server
from ddtrain.sync.spec import AUTO_OPTIONS, LOCAL_SGD_OPTIONS, StrategySpec
from ddtrain.sync.zero import build_zero

STRATEGIES: dict[str, StrategySpec] = {}


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` to ``STRATEGIES`` (a new strategy from outside the package needs only this call)."""
    STRATEGIES[spec.name] = spec
    return spec


def _servers_check(options: SyncOptions) -> None:
    wire_dtype(options.compression)   # the compression methods parameter servers can carry


def _shard_algorithm_check(options: SyncOptions) -> None:
    if options.shard_algorithm not in comm.ALGORITHMS:
        raise ConfigError("shard_algorithm", f"must be one of {', '.join(comm.ALGORITHMS)}, got "
                                             f"{options.shard_algorithm!r}")


for _spec in (
    StrategySpec(name="ddp", build=build_ddp, summary="DDP with the backend's own all-reduce (the default)",
                 sync_in_backward=True, algorithm="native", options=("sync_batchnorm", "compression"), sends="gradient"),
    *(StrategySpec(name=name, build=partial(AllReduceStrategy, algorithm=name), sync_in_backward=True, algorithm=name,
                   options=("sync_batchnorm", "compression"),
                   summary=f"DDP with ddtrain's {name} all-reduce as its communication hook", sends="gradient")
      for name in comm.ALGORITHMS if name != "native"),   # every algorithm of ddtrain.comm; native's is ddp
    StrategySpec(name="ps-sync", build=partial(build_param_server, asynchronous=False), uses_servers=True,
                 options=("servers", "timeout_s", "compression"), check=_servers_check,
                 replicated=False, algorithm="central",  # the master pattern over workers + servers; checkpoints
                 # hold the servers' state
                 not_predicted="parameter servers: not modelled",
                 summary="parameter servers on the last --servers ranks; each step waits for every worker"),
    StrategySpec(name="ps-async", build=partial(build_param_server, asynchronous=True), uses_servers=True,
                 options=("servers", "staleness", "async_rule", "timeout_s", "compression"), check=_servers_check,
                 replicated=False, checkpointable=False, synchronous=False,
                 not_predicted="asynchronous: no step time to predict",
                 summary="parameter servers applying each gradient as it arrives (--staleness bounds the lag)"),
    StrategySpec(name="hybrid", build=HybridStrategy, replicated=False, sync_in_backward=True, periodic=True,
                 options=("sync_batchnorm", "sync_every"),
                 not_predicted="a ring every step plus a broadcast: never ahead of ring",
                 algorithm="ring", summary="ring all-reduce every step + rank 0's broadcast every --sync-every "
                     "steps (000 ch. 5)"),
    StrategySpec(name="local-sgd", build=LocalSGDStrategy, replicated=False, periodic=True, synchronous=False,
                 options=("sync_every", *LOCAL_SGD_OPTIONS), sends="average", averaging_algorithm=LOCAL_SGD_ALGORITHM,
                 summary="local steps; parameters averaged every --sync-every steps"),
    # ZeRO-1: an all-reduce of the gradients and an all-gather of the parameters (1.5x ddp's bytes); ZeRO-2: a
    # reduce-scatter and an all-gather (ddp's bytes); FSDP: two all-gathers and a reduce-scatter (1.5x)
    StrategySpec(name="zero1", build=partial(build_zero, stage=1), sharded=True, options=("shard_algorithm",),
                 check=_shard_algorithm_check, algorithm="native", sends="sharded",
                 sharded_collectives=("allreduce", "allgather"),
                 shards=("optimizer_state",),
                 summary="ZeRO-1: the optimizer state split over the ranks (all-reduce, shard step, all-gather)"),
    StrategySpec(name="zero2", build=partial(build_zero, stage=2), sharded=True, options=("shard_algorithm",),
                 check=_shard_algorithm_check, algorithm="native", sends="sharded", sharded_collectives=("allreduce",),
                 shards=("gradients", "optimizer_state"),
                 summary="ZeRO-2: optimizer state and gradients split (reduce-scatter, shard step, all-gather)"),
    StrategySpec(name="fsdp", build=build_fsdp, sharded=True, options=("fsdp_param_dtype",), algorithm="native",
                 sends="sharded", sharded_collectives=("allreduce", "allgather"),
                 shards=("parameters", "gradients", "optimizer_state"),
                 summary="PyTorch's FSDP2 (fully_shard): parameters, gradients and optimizer state split"),
    StrategySpec(name=AUTO_NAME, build=partial(AutoStrategy, strategies=STRATEGIES), replicated=False,
                 checkpointable=False, synchronous=False, check=auto_check, options=AUTO_OPTIONS,
                 not_predicted="chooses among the others",
                 summary="tries the predicted best methods on the job's links, keeps the fastest (docs/AUTO.md)"),
):
    register_strategy(_spec)


def strategy_spec(name: str) -> StrategySpec:
    """The record of strategy ``name``; an unknown name lists the valid ones."""
    if name not in STRATEGIES:
        raise choice_error("strategy", name, STRATEGIES)
    return STRATEGIES[name]


def check_options(strategy: str, options: SyncOptions, *, explicit: Iterable[str] | None = None) -> None:
    """The one rule for strategy options, for ``ddtrain train`` and ``prepare()`` alike: ConfigError naming the field.

    An option the strategy does not read (its ``StrategySpec.options``) is refused when it is set,
    naming the strategies that read it; then the strategy's own check of the values it reads
    (``StrategySpec.check``: the compressions parameter servers carry). "Set" means different from
    the default; ``explicit`` (the names ``prepare()`` was given) also counts a name given at its
    default. The command line cannot tell ``--servers 1`` from no flag, so there a default passes.
    The values themselves (ranges, local SGD's combinations) are checked by ``SyncOptions``.
    """
    spec = strategy_spec(strategy)
    named, defaults = set(explicit or ()), SyncOptions()
    for f in dataclasses.fields(SyncOptions):
        given = f.name in named or getattr(options, f.name) != getattr(defaults, f.name)
        if given and not spec.takes_option(f.name):
            readers = [other.name for other in STRATEGIES.values() if other.takes_option(f.name)]
            raise ConfigError(f.name, f"is read only by {', '.join(readers) or 'no strategy'}, "
                                      f"not by strategy {strategy!r}")
    if spec.check is not None:
        spec.check(options)


def wrap(strategy: str, model, optimizer, options: SyncOptions | None = None) -> Strategy:
    """Apply ``strategy`` to a model already on its device and an optimizer over its parameters."""
    spec = strategy_spec(strategy)
    options = options or SyncOptions()   # checked against the strategy by its makers (TrainConfig, prepare)
    # the sharded strategies run their machinery at world size 1 too where a process group exists (torchrun
    # --nproc-per-node 1): one shard, no traffic, but their layout, copies and FSDP's mixed precision, so that
    # speed and memory can be measured against ddp's bare model (benchmarks/gpu_sharding.py)
    if dist.is_initialized() and (dist.get_world_size() > 1 or spec.sharded):
        applied = spec.build(model, optimizer, options)
    else:
        applied = single_process(model, optimizer)
    applied.spec = spec
    if isinstance(applied.optimizer, torch.optim.Optimizer):   # every strategy's bytes, for the record (sync.memory)
        applied.memory = MemoryMeter(applied.module, applied.optimizer)
    # ``finish`` runs once: when the loop calls it, or else at ddtrain.shutdown() (a script on the
    # prepare path only calls that, and parameter servers and local SGD need their last word there)
    runtime.AT_SHUTDOWN.append(applied.finish)
    return applied


__all__ = ["STRATEGIES", "Strategy", "StrategySpec", "SyncOptions", "SyncStats", "check_options", "register_strategy",
           "strategy_spec", "wrap"]
