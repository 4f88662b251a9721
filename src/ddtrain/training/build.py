"""What a TrainConfig names, built: the dataset, the model, the optimizer; and the checks that need them.

``validate`` runs before any worker starts (names, paths, sizes, the checkpoint directory), so a
bad input fails once, in the launching process; ``load_and_build`` runs on every rank.
"""
from __future__ import annotations

import torch

from ddtrain.config import TrainConfig
from ddtrain.errors import DDTrainError


def load_and_build(config: TrainConfig, *, meta: bool = False):
    """The dataset and the model the config names (the model on the meta device if ``meta``)."""
    from ddtrain.data import load_dataset
    from ddtrain.models import build_model
    from ddtrain.sync import STRATEGIES
    if config.strategy not in STRATEGIES:
        from ddtrain.errors import choice_error
        raise choice_error("strategy", config.strategy, STRATEGIES)
    try:
        data = load_dataset(config.data, val_fraction=config.val_fraction, seed=config.seed, **config.data_args)
    except TypeError as exc:  # a --data-arg the loader does not take
        raise DDTrainError(f"--data {config.data}: {exc}") from None
    c, *hw = data.sample_shape
    kwargs = dict(num_classes=data.num_classes or 1, in_channels=c, input_size=tuple(hw) or (1, 1),
                  **config.model_args)
    torch.manual_seed(config.seed)  # the same initial weights on every rank
    if meta:
        with torch.device("meta"):
            return data, build_model(config.model, **kwargs)
    return data, build_model(config.model, **kwargs)


def validate(config: TrainConfig, workers: int) -> None:
    """Everything that can be checked before a worker starts: names, paths, sizes."""
    from ddtrain.data.loading import steps_per_epoch
    from ddtrain.data.sharding import ShardSampler
    from ddtrain.errors import ConfigError
    from ddtrain.observe import tracking
    from ddtrain.training import recipe
    if config.out and not config.out.endswith(".json"):
        raise DDTrainError(f"--out {config.out!r} should name a .json file")
    config = recipe.resolve(config, workers)   # --global-batch-size divides into workers x micro-batches
    data, model = load_and_build(config, meta=True)
    sampler = ShardSampler(len(data.train), rank=0, world_size=workers, policy=config.sharding)  # n >= workers
    per_rank = len(data.train) // workers
    if config.batch_size > per_rank:
        flag = "per-rank batch (--global-batch-size / workers / --grad-accum)" if config.global_batch_size \
            else "--batch-size"
        raise DDTrainError(f"{flag} {config.batch_size} is larger than a rank's shard: {len(data.train)} "
                           f"training samples over {workers} worker(s) is {per_rank} each")
    micro = steps_per_epoch(len(sampler), config.batch_size)
    if micro < config.grad_accum:
        raise ConfigError("grad_accum", f"{config.grad_accum} is more than the {micro} micro-batches of "
                          f"{config.batch_size} in an epoch of a rank's shard")
    recipe.plan(config, recipe.updates_per_epoch(micro, config.grad_accum))   # warm-up shorter than the run
    if config.label_smoothing and data.task != "classification":
        raise ConfigError("label_smoothing", f"applies to classification; {config.data} is a {data.task} task")
    tracking.check(config.tracking)   # the libraries are there and the outputs writable
    from ddtrain.reliability import checkpoint, outputs
    from ddtrain.reliability import consistency
    from ddtrain.observe import files
    for flag, path in (("--out", config.out), ("--save", config.save)):
        files.check_writable(path, flag)
    outputs.check(config)  # no output over an input, inside the data set, or over another output
    checkpoint.check_dir(config, consistency.fingerprint(config, model, data, workers))
