"""What a TrainConfig names, built: the dataset, the model, the optimizer; and the checks that need them.

``validate`` runs before any worker starts (names, paths, sizes, the checkpoint directory), so a
bad input fails once, in the launching process; ``load_and_build`` runs on every rank.
"""
from __future__ import annotations

import torch

from ddtrain.config import TrainConfig
from ddtrain.errors import ConfigError


def load_and_build(config: TrainConfig, *, meta: bool = False):
    """The dataset and the model the config names (the model on the meta device if ``meta``)."""
    from ddtrain.data import load_dataset
    from ddtrain.models import build_model
    from ddtrain.sync import STRATEGIES
    if config.strategy not in STRATEGIES:
        from ddtrain.errors import choice_error
        raise choice_error("strategy", config.strategy, STRATEGIES)
    try:
        data = load_dataset(config.data.data, val_fraction=config.data.val_fraction, seed=config.seed,
                            **config.data.data_args)
    except TypeError as exc:  # a data_args key the loader does not take
        raise ConfigError("data", f"{config.data.data}: {exc}") from None
    c, *hw = data.sample_shape
    kwargs = dict(num_classes=data.num_classes or 1, in_channels=c, input_size=tuple(hw) or (1, 1),
                  **config.model_args)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    if meta:
        with torch.device("meta"):
            return data, build_model(config.model, **kwargs)
    return data, build_model(config.model, **kwargs)


def check_run(config: TrainConfig, data, workers: int):
    """What a resolved config asks of its strategy and data on ``workers``, checked once for both paths; returns
    (updates per epoch, the schedule's Plan).

    ``validate`` runs it before any worker starts (``ddtrain train``), ``fit`` when it is called
    (a script): strategy options the strategy does not read, a per-rank batch larger than a rank's
    shard, more accumulation than an epoch has micro-batches, a warm-up not shorter than the run,
    label smoothing on a task without classes.
    The count is the loop's own (``ShardLoader.steps`` over the same ``ShardSampler``). First the
    strategy's options, by the rule ``prepare()`` uses too (``ddtrain.sync.check_options``).
    """
    from ddtrain.data.loading import steps_per_epoch
    from ddtrain.data.sharding import ShardSampler
    from ddtrain import recipe
    from ddtrain.sync import check_options
    check_options(config.strategy, config.sync)   # an option the strategy does not read, set, is refused
    r = config.recipe
    from ddtrain.sync import strategy_spec
    from ddtrain.training import balance
    balance.check(config.data.balance, synchronous=strategy_spec(config.strategy).synchronous,
                  strategy=config.strategy, global_batch=r.global_batch_size, workers=workers,
                  grad_accum=r.grad_accum, sharding=config.data.sharding)
    per_rank = len(data.train) // workers
    if r.batch_size > per_rank:
        where = f"{len(data.train)} training samples over {workers} worker(s) is {per_rank} each"
        if r.global_batch_size:
            raise ConfigError("global_batch_size", f"{r.global_batch_size} gives a per-rank batch of {r.batch_size} "
                              f"(global_batch_size / workers / grad_accum), larger than a rank's shard: {where}")
        raise ConfigError("batch_size", f"{r.batch_size} is larger than a rank's shard: {where}")
    sampler = ShardSampler(len(data.train), rank=0, world_size=workers, seed=config.seed,
                           policy=config.data.sharding, global_batch=r.global_batch_size)
    micro = steps_per_epoch(len(sampler), r.batch_size)
    per_epoch = recipe.updates_per_epoch(micro, r.grad_accum)
    if per_epoch < 1:
        raise ConfigError("grad_accum", f"{r.grad_accum} is more than the {micro} micro-batches of "
                          f"{r.batch_size} in an epoch of a rank's shard")
    plan = recipe.plan(r, per_epoch, epochs=config.epochs, steps=config.steps)   # the warm-up is shorter than the run
    if r.label_smoothing and data.task != "classification":
        raise ConfigError("label_smoothing", f"applies to classification; {data.name} is a {data.task} task")
    return per_epoch, plan


def validate(config: TrainConfig, workers: int) -> None:
    """Everything that can be checked before a worker starts: names, paths, sizes."""
    from ddtrain.observe import tracking
    if config.out and not config.out.endswith(".json"):
        raise ConfigError("out", f"{config.out!r} should name a .json file")
    config = config.resolved(workers)   # the global batch divides into workers x micro-batches
    data, model = load_and_build(config, meta=True)
    check_run(config, data, workers)
    tracking.check(config.tracking)   # the libraries are there and the outputs writable
    from ddtrain.reliability import checkpoint, outputs
    from ddtrain.reliability import consistency
    from ddtrain.observe import files
    for field, path in (("out", config.out), ("save", config.save)):
        files.check_writable(path, field)
    outputs.check(config)  # no output over an input, inside the data set, or over another output
    checkpoint.check_dir(config, consistency.fingerprint(config, model, data, workers))
