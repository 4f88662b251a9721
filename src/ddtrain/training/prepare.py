"""The minimal-change path: the user's model, optimizer(s) and loaders in, PyTorch's own kinds of objects out.

    model, optimizer, train_loader, test_loader = ddtrain.prepare(model, optimizer, train_loader, test_loader,
                                                                  strategy="ring")

- the model: a ``PreparedModel`` for every strategy and world size, with ``.module``,
  ``no_sync()`` and the bare model's ``state_dict()`` keys (``prepared_model``);
- the optimizer (or a list of them): an instance of a subclass of the user's optimizer class
  whose ``step()`` also runs the strategy (``prepared_optimizer``), so schedulers accept it;
- the loaders: DataLoaders over this rank's share, batches on the device (``prepared_loader``);
  the first is the training loader, the others evaluation loaders; the samples left over when
  R does not divide the data set are padded as DistributedSampler pads them (``remainder``);
- LR schedulers and a ``GradScaler`` among them: returned as they are, saved with the state.

What it returns is registered for ``ddtrain.save_state``/``load_state`` (``training.state``);
``checkpoint_dir`` (default: ``ddtrain run --checkpoint-dir``'s) saves the state at a stop
signal and loads it before the training loader's first iteration, by itself; ``global_batch_size``
(default: ``ddtrain run --global-batch-size``'s) makes the training order independent of the
number of workers, so that the state loads at another world size.

A learning-rate schedule sized from ``len(train_loader)`` before ``prepare`` counts the whole
data set's batches, R times the prepared loader's: ``prepare`` refuses it (``schedules``), and
the fix is to create it after ``prepare``.

``prepare`` may be called once per model (a GAN's generator and discriminator). Parameter-server
ranks serve inside ``prepare`` and then leave the process (their strategy's documented exit).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import weakref

import torch
from torch.utils.data import DataLoader

from ddtrain.data.sharding import check_remainder, share_size
from ddtrain.distributed import job, runtime
from ddtrain.errors import DDTrainError
from ddtrain.sync import SyncOptions, check_options, strategy_spec, wrap
from ddtrain.training import schedules, state
from ddtrain.training.metrics import Placement
from ddtrain.training.prepared_loader import PreparedLoader
from ddtrain.training.prepared_model import PreparedModel, unwrap
from ddtrain.training.prepared_optimizer import StepCounter, prepare_optimizer

STRATEGY_ENV = "DDTRAIN_STRATEGY"   # the default strategy (ddtrain run --strategy); an argument given wins

__all__ = ["prepare", "prepare_loader", "unwrap"]


_announced: tuple[str, str] | None = None   # (parameter-server strategy, who named it) when init set the roles


def init(*, strategy: str | None = None, servers: int = 1, **kwargs):
    """``ddtrain.init``: join the launcher's job (``dist.runtime.init``'s arguments pass through).

    A parameter-server strategy named here (or by ``DDTRAIN_STRATEGY``, which ``ddtrain run
    --strategy`` sets) makes ``ddtrain.world_size()``/``rank()`` count workers from this call on,
    as Horovod-style scripts need before they build their optimizer (``lr * world_size()``):
    the last ``servers`` ranks will be the servers. ``prepare`` confirms it and adds the
    workers' process group (``ddtrain.worker_group()`` is None until then).
    """
    global _announced
    env = runtime.init(**kwargs)
    name = strategy or os.environ.get(STRATEGY_ENV)
    total = runtime.total_ranks()
    if name and total > 1 and strategy_spec(name).uses_servers:
        _announced = (name, "ddtrain.init(strategy=...)" if strategy else f"{STRATEGY_ENV} (ddtrain run --strategy)")
        if not 1 <= servers < total:
            raise DDTrainError(f"init(servers={servers}): a job of {total} ranks needs between 1 and {total - 1} "
                               "parameter servers (at least one rank must train)")
        runtime.set_roles(list(range(total - servers)), list(range(total - servers, total)), None)
    return env


def _confirm_roles(strategy: str) -> None:
    """Roles ``init`` set for a parameter-server strategy stand only if ``prepare`` trains with one."""
    global _announced
    if _announced is not None and runtime.world_size() == runtime.total_ranks():
        _announced = None          # a shutdown since cleared the roles it set (a script run twice in one process)
    if _announced is None or strategy_spec(strategy).uses_servers:
        return
    named, by = _announced
    _announced = None
    runtime.clear_roles()   # every rank trains: world_size() counts them all again
    if by.startswith("ddtrain.init"):
        raise DDTrainError(f"prepare(strategy={strategy!r}) but {by} named {named!r}: world_size() counted only "
                           "workers until now; name the same strategy in both")
    runtime.print0(f"ddtrain: warning: {by} asked for {named}, but the script's prepare() names {strategy!r}, "
                   f"which wins; world_size() counts every rank again")


def sync_options(strategy: str, options: dict) -> SyncOptions:
    """``options`` as SyncOptions, checked by the rule ``ddtrain train`` uses (``ddtrain.sync.check_options``).

    An option given by name counts as set even at its default value (``servers=1`` for ddp is
    refused), which the command line cannot tell; the messages name the fields.
    """
    options = dict(options)
    if "broadcast_buffers" in options:       # DDP's spelling; the CLI switch is --no-broadcast-buffers
        options["no_broadcast_buffers"] = not options.pop("broadcast_buffers")
    valid = {f.name for f in dataclasses.fields(SyncOptions)}
    for name in options:
        if name not in valid:
            raise DDTrainError(f"prepare(): unknown option {name}=; valid: broadcast_buffers, "
                               f"{', '.join(sorted(valid - {'no_broadcast_buffers'}))}")
    settings = SyncOptions(**options)
    check_options(strategy, settings, explicit=options)
    return settings


def _check_optimizers(model: torch.nn.Module, optimizers: list) -> None:
    """Every parameter an optimizer updates must be one of ``model``'s (else its steps change nothing the strategy syncs)."""
    owned = {id(p) for p in model.parameters()}
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DDTrainError(f"prepare(): optimizer must be a torch.optim.Optimizer (or a list of them), "
                               f"got {type(optimizer).__name__}")
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in owned)
        if foreign:
            where = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
            raise DDTrainError(f"prepare(): {where} updates {foreign} tensor(s) that are not parameters of the model "
                               f"passed with it; create the optimizer from this model's parameters "
                               f"(model.parameters()), after any layer replacement")


def prepare_loader(loader: DataLoader, *, training: bool = False, seed: int = 0, remainder: str = "pad") -> PreparedLoader:
    """A loader prepared on its own (an evaluation loader by default), sharded among the training ranks."""
    runtime.init()
    prepared_before = Placement.workers is not None
    return PreparedLoader(loader, rank=Placement.worker_rank if prepared_before else runtime.rank(),
                          world_size=Placement.workers if prepared_before else runtime.world_size(),
                          device=runtime.device(), seed=seed, training=training, remainder=remainder)


def prepared_batches(loader: DataLoader, workers: int, remainder: str) -> int | None:
    """``len()`` the training loader will have once prepared among ``workers`` ranks (None: no length)."""
    try:
        samples = share_size(len(loader.sampler), 0, workers, remainder)
    except TypeError:
        return None
    if loader.batch_size is None:
        return None
    return samples // loader.batch_size if loader.drop_last else math.ceil(samples / loader.batch_size)


def prepare(model: torch.nn.Module, optimizer=None, *loaders: DataLoader, strategy: str | None = None, seed: int = 0,
            checkpoint_dir: str | None | bool = None, checkpoint_every: int = 0, global_batch_size: int | None = None,
            grad_accum: int = 1, remainder: str = "pad", eval_remainder: str | None = None, balance: str = "none",
            **options):
    """``(model, optimizer, *loaders)`` set up for ``strategy`` on this rank (see the module doc).

    ``optimizer``: one optimizer, a list of them (returned as a list), or None. ``loaders``:
    DataLoaders (the first trains), and LR schedulers or a GradScaler to save with the state.
    ``seed``: the seed every rank shares for the loaders' shuffles. ``checkpoint_dir``: where the
    state is saved at a stop signal and loaded from at the start (None: ``ddtrain run
    --checkpoint-dir``'s, ``DDTRAIN_CHECKPOINT_DIR``; False: never), also every
    ``checkpoint_every`` optimizer steps. ``global_batch_size``: samples per optimizer step over
    all workers (None: ``ddtrain run --global-batch-size``'s; 0: none), each rank's training batch
    then G / (workers x ``grad_accum``), ``grad_accum`` being the micro-batches per step.
    ``remainder``: what happens to the samples left over when the number of ranks R does not
    divide a loader's: "pad" (DistributedSampler's default: the first ones are repeated), "drop"
    (``DistributedSampler(drop_last=True)``); ``eval_remainder`` the same for the evaluation
    loaders (default: ``remainder``), where "uneven" also gives every sample exactly once (shards
    differing by one sample). With a global batch the training loader drops the samples after
    the last whole global batch instead. ``options``: SyncOptions fields
    (``find_unused_parameters=True``, ``sync_every=4``, ``servers=2``...) and ``broadcast_buffers``.
    Without loaders the third value is None (``model, optimizer, _ = prepare(model, optimizer)``).
    ``balance``: only "none" so far (``ddtrain train --balance`` has "speed" and "measure"; docs/BALANCE.md
    says what the prepare path still lacks).
    """
    if balance != "none":
        raise DDTrainError(f"prepare(balance={balance!r}) is not supported yet: the prepared loader shares a fixed "
                           "per-rank batch; ddtrain train --balance (and ddtrain.fit) balance unequal workers "
                           "(docs/BALANCE.md, 'prepare()')")
    runtime.init()
    strategy = strategy or os.environ.get(STRATEGY_ENV) or "ddp"   # `ddtrain run --strategy S` sets the variable
    _confirm_roles(strategy)
    settings = sync_options(strategy, options)
    eval_remainder = eval_remainder or remainder
    check_remainder(remainder, training=True)
    check_remainder(eval_remainder, training=False)
    optimizers = [] if optimizer is None else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if isinstance(model, PreparedModel):
        raise DDTrainError("prepare(): the model was already prepared; pass the bare model (ddtrain.unwrap(model))")
    _check_optimizers(model, optimizers)
    for loader in loaders:
        if loader is not None and not isinstance(loader, (DataLoader, *state.SCHEDULERS, torch.amp.GradScaler)):
            raise DDTrainError(f"prepare(): after the optimizer come DataLoaders (and LR schedulers or a GradScaler "
                               f"to save with the state), got {type(loader).__name__}")
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise DDTrainError(f"prepare(): grad_accum must be a positive number of micro-batches, got {grad_accum!r}")
    global_batch = job.global_batch_size() if global_batch_size is None else global_batch_size
    if not isinstance(global_batch, int) or global_batch < 0:
        raise DDTrainError(f"prepare(): global_batch_size must be a positive number of samples, got {global_batch!r}")
    directory = (job.checkpoint_dir() if checkpoint_dir is None else checkpoint_dir) or None
    if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise DDTrainError(f"prepare(): checkpoint_every must be a non-negative number of steps, got {checkpoint_every!r}")
    if checkpoint_every and not directory:
        raise DDTrainError("prepare(): checkpoint_every needs a checkpoint directory (checkpoint_dir=..., or ddtrain run "
                           "--checkpoint-dir)")
    if directory and os.path.exists(directory) and not os.path.isdir(directory):
        raise DDTrainError(f"prepare(): checkpoint_dir {directory} is a file, not a directory")
    data_loaders = [x for x in loaders if isinstance(x, DataLoader)]
    if data_loaders and not global_batch:
        # before any rank serves: every rank, servers included, reaches the same verdict from the sizes alone
        workers = runtime.total_ranks() - strategy_spec(strategy).extra_ranks(settings.servers) \
            if runtime.total_ranks() > 1 else 1
        schedules.check_sizes(optimizers, data_loaders[0], prepared_batches(data_loaders[0], workers, remainder),
                              workers)
    device = runtime.device()
    model.to(device)                  # in place: the optimizers' parameters stay the model's
    synced = wrap(strategy, model, optimizers[0] if len(optimizers) == 1 else optimizers or None, settings)
    if synced.role == "server":
        synced.serve()
        synced.finish()
        runtime.shutdown()
        sys.exit(0)
    Placement.group, Placement.workers, Placement.worker_rank = synced.group, synced.workers, synced.worker_rank
    counter = StepCounter(synced, len(optimizers))
    prepared = [prepare_optimizer(opt, counter, index) for index, opt in enumerate(optimizers)]
    prepared_optimizer = (prepared if isinstance(optimizer, (list, tuple)) else prepared[0]) if prepared else None
    first = next((i for i, loader in enumerate(loaders) if isinstance(loader, DataLoader)), None)
    prepared_loaders = [PreparedLoader(loader, rank=synced.worker_rank, world_size=synced.workers, device=device,
                                       seed=seed, training=index == first, strategy=synced,
                                       global_batch=global_batch, grad_accum=grad_accum,
                                       remainder=remainder if index == first else (eval_remainder or remainder))
                        if isinstance(loader, DataLoader) else loader
                        for index, loader in enumerate(loaders)] or [None]
    if first is not None and global_batch and prepared_loaders[first].batch_size != loaders[first].batch_size:
        runtime.print0(f"ddtrain: note: prepare(): a global batch of {global_batch} over {synced.workers} worker(s) x "
                       f"grad_accum {grad_accum}: each worker's batch is {prepared_loaders[first].batch_size} (the "
                       f"training loader's batch_size {loaders[first].batch_size} is not used)")
    prepared_model = PreparedModel(model, synced)
    state.register(state.Prepared(
        model=weakref.ref(prepared_model), strategy=synced, strategy_name=strategy, compression=settings.compression,
        optimizers=prepared, originals=optimizers, counter=counter,
        loader=prepared_loaders[first] if first is not None else None,
        schedulers=[x for x in loaders if isinstance(x, state.SCHEDULERS)],
        scaler=next((x for x in loaders if isinstance(x, torch.amp.GradScaler)), None), seed=seed,
        global_batch=global_batch, grad_accum=grad_accum), checkpoint_dir=directory, checkpoint_every=checkpoint_every)
    return (prepared_model, prepared_optimizer, *prepared_loaders)
