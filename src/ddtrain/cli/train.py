"""``ddtrain train``: validate everything, then run here (inside a launcher) or start --nproc workers."""
from __future__ import annotations

import argparse
import time

import torch

from ddtrain.dist import launch
from ddtrain.dist import runtime
from ddtrain.observe import profiler
from ddtrain.config import TrainConfig, parse_kv
from ddtrain.errors import DDTrainError
from ddtrain.reliability.guard import PeerStopped
from ddtrain.sync import strategy_spec
from ddtrain.training.build import load_and_build, validate


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
    p.add_argument("--epochs", type=int, default=None,
                   help=f"passes over the training data (default {d.epochs}, or as many as --steps needs)")
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
    p.add_argument("--checkpoint-dir", default=None, help="write checkpoints here (rank 0; see docs/RELIABILITY.md)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="steps between checkpoints (0: at the end of every epoch)")
    p.add_argument("--keep", type=int, default=d.keep, help="newest checkpoints to keep")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest whole checkpoint in --checkpoint-dir")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts,
                   help="restart all workers this often after one fails (they resume from the last checkpoint)")
    p.add_argument("--on-nonfinite", default=d.on_nonfinite, choices=["stop", "skip"],
                   help="non-finite loss or gradients: stop naming step and rank, or skip the step on every rank")
    p.add_argument("--on-mismatch", default=d.on_mismatch, choices=["stop", "rebroadcast"],
                   help="replicas differ at a --check-every check: stop, or copy rank 0's parameters to all")
    profiler.add_arguments(p)


def config_from_args(args) -> TrainConfig:
    d_epochs = TrainConfig().epochs
    return TrainConfig(model=args.model, data=args.data, strategy=args.strategy, epochs=args.epochs if args.epochs is not None else (0 if args.steps else d_epochs),
                       steps=args.steps, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                       weight_decay=args.weight_decay, optimizer=args.optimizer, seed=args.seed,
                       val_fraction=args.val_fraction, sharding=args.sharding,
                       loader_workers=args.loader_workers, data_on_device=args.data_on_device, amp=args.amp,
                       channels_last=args.channels_last, compile=args.compile,
                       model_args=parse_kv(args.model_arg, "--model-arg"),
                       data_args=parse_kv(args.data_arg, "--data-arg"), sync_every=args.sync_every,
                       servers=args.servers, staleness=args.staleness, check_every=args.check_every,
                       log_every=args.log_every, quiet=args.quiet, out=args.out, save=args.save,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, keep=args.keep,
                       resume=args.resume, max_restarts=args.max_restarts, on_nonfinite=args.on_nonfinite,
                       on_mismatch=args.on_mismatch)


def main(args) -> int:
    config = config_from_args(args)
    if not 0 < args.timeout < float("inf"):
        raise DDTrainError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if launch.inside_launcher():
        runtime.init(backend=args.backend, timeout_s=args.timeout)
        data, model = load_and_build(config)
        from ddtrain.training.loop import fit
        try:
            fit(model, data, config, callbacks=profiler.callbacks(args, config))
        except PeerStopped:  # rank 0 reports it, once; give it a moment to, then stop quietly
            time.sleep(1.0)
            return launch.PEER_STOPPED_EXIT
        runtime.shutdown()
        return 0
    if args.nproc < 1:
        raise DDTrainError(f"--nproc must be at least 1, got {args.nproc}")
    servers = strategy_spec(config.strategy).extra_ranks(config.servers)
    if servers and args.nproc - servers < 1:
        raise DDTrainError(f"--strategy {config.strategy} with --servers {servers} needs --nproc of at least "
                           f"{servers + 1} (one worker)")
    if args.backend == "nccl" and torch.cuda.device_count() < args.nproc:
        raise DDTrainError(f"--backend nccl needs a GPU per worker: {args.nproc} workers, "
                           f"{torch.cuda.device_count()} GPU(s) visible")
    validate(config, args.nproc - servers)
    profiler.validate(args)
    argv = ["train", *launch.strip_option(args.argv, "--nproc")]
    return launch.run_local(args.nproc, argv, max_restarts=config.max_restarts,
                            env={"DDTRAIN_TIMEOUT_S": str(args.timeout)})
