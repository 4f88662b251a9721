"""``ddtrain train``: validate everything, then run here (inside a launcher) or start --nproc workers."""
from __future__ import annotations

import argparse
import ast

import torch

from . import launch, runtime
from .config import TrainConfig
from .errors import DDTrainError


def parse_kv(items: list[str], flag: str) -> dict:
    """``["hidden=256,128", "dropout=0"]`` -> ``{"hidden": (256, 128), "dropout": 0}``."""
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise DDTrainError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word stays a string
        out[key.replace("-", "_")] = value
    return out


def _sync_every(text: str):
    return text if text == "epoch" else int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model name (see ddtrain.models.MODELS)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE", help="model option, e.g. hidden=256,128")
    p.add_argument("--data", default=d.data, help="data spec: digits, mnist:DIR, npz:FILE, ...")
    p.add_argument("--data-arg", action="append", metavar="KEY=VALUE", help="data loader option, e.g. resize=128")
    p.add_argument("--strategy", default=d.strategy, help="synchronisation strategy (see ddtrain.sync.STRATEGIES)")
    p.add_argument("--nproc", type=int, default=1, help="local worker processes to start (ignored under a launcher)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training data")
    p.add_argument("--steps", type=int, default=d.steps, help="stop after this many steps in all (0: no limit)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="samples per step on each rank")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--optimizer", default=d.optimizer, choices=["sgd", "adam"])
    p.add_argument("--seed", type=int, default=d.seed, help="seed for initialisation, shuffling and dropout")
    p.add_argument("--val-fraction", type=float, default=d.val_fraction, help="share held out for validation")
    p.add_argument("--sharding", default=d.sharding, choices=["balanced", "contiguous"])
    p.add_argument("--loader-workers", type=int, default=d.loader_workers, help="DataLoader processes per rank")
    p.add_argument("--data-on-device", default=d.data_on_device, choices=["auto", "yes", "no"],
                   help="keep in-memory datasets on the GPU (auto: when training on CUDA)")
    p.add_argument("--amp", default=d.amp, choices=["off", "bf16", "fp16"], help="mixed precision")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory layout")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--sync-every", type=_sync_every, default=d.sync_every,
                   help="hybrid/local-sgd: steps between parameter syncs, or 'epoch'")
    p.add_argument("--servers", type=int, default=d.servers, help="ps-sync/ps-async: parameter-server ranks")
    p.add_argument("--staleness", type=int, default=d.staleness, help="ps-async: most versions a gradient may lag")
    p.add_argument("--check-every", type=int, default=d.check_every, help="steps between divergence checks")
    p.add_argument("--log-every", type=int, default=d.log_every, help="print a line every N steps (0: per epoch)")
    p.add_argument("--quiet", action="store_true", help="no epoch lines or progress bar (errors only)")
    p.add_argument("--timeout", type=float, default=runtime.DEFAULT_TIMEOUT_S,
                   help="seconds any rank waits on another before failing")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="override the backend choice")
    p.add_argument("--out", default=None, help="write the results record (JSON) here")
    p.add_argument("--save", default=None, help="save the final model (.pt state dict or .safetensors)")


def config_from_args(args) -> TrainConfig:
    return TrainConfig(model=args.model, data=args.data, strategy=args.strategy, epochs=args.epochs,
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                       weight_decay=args.weight_decay, optimizer=args.optimizer, seed=args.seed,
                       val_fraction=args.val_fraction, sharding=args.sharding,
                       loader_workers=args.loader_workers, data_on_device=args.data_on_device, amp=args.amp,
                       channels_last=args.channels_last, compile=args.compile,
                       model_args=parse_kv(args.model_arg, "--model-arg"),
                       data_args=parse_kv(args.data_arg, "--data-arg"), sync_every=args.sync_every,
                       servers=args.servers, staleness=args.staleness, check_every=args.check_every,
                       log_every=args.log_every, quiet=args.quiet, out=args.out, save=args.save)


def load_and_build(config: TrainConfig, *, meta: bool = False):
    """The dataset and the model the config names (the model on the meta device if ``meta``)."""
    from .data import load_dataset
    from .models import build_model
    from .sync import STRATEGIES
    if config.strategy not in STRATEGIES:
        from .errors import choice_error
        raise choice_error("strategy", config.strategy, STRATEGIES)
    data = load_dataset(config.data, val_fraction=config.val_fraction, seed=config.seed, **config.data_args)
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
    from .data.sharding import ShardSampler
    if config.out and not config.out.endswith(".json"):
        raise DDTrainError(f"--out {config.out!r} should name a .json file")
    data, _ = load_and_build(config, meta=True)
    ShardSampler(len(data.train), rank=0, world_size=workers, policy=config.sharding)  # n >= workers
    per_rank = len(data.train) // workers
    if config.batch_size > per_rank:
        raise DDTrainError(f"--batch-size {config.batch_size} is larger than a rank's shard: {len(data.train)} "
                           f"training samples over {workers} worker(s) is {per_rank} each")


def main(args) -> int:
    config = config_from_args(args)
    if args.timeout <= 0:
        raise DDTrainError(f"--timeout must be positive, got {args.timeout}")
    if launch.inside_launcher():
        runtime.init(backend=args.backend, timeout_s=args.timeout)
        data, model = load_and_build(config)
        from .train import fit
        fit(model, data, config)
        runtime.shutdown()
        return 0
    if args.nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {args.nproc}")
    servers = config.servers if config.strategy.startswith("ps-") else 0
    if servers and args.nproc - servers < 1:
        raise DDTrainError(f"--strategy {config.strategy} with --servers {servers} needs --nproc of at least "
                           f"{servers + 1} (one worker)")
    validate(config, args.nproc - servers)
    argv = ["train", *launch.strip_option(args.argv, "--nproc")]
    return launch.run_local(args.nproc, argv, env={"DDTRAIN_TIMEOUT_S": str(args.timeout)})
