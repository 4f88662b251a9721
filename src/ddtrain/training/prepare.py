"""The minimal-change path: the user's model, optimizer(s) and loaders in, PyTorch's own kinds of objects out.

    model, optimizer, train_loader, test_loader = ddtrain.prepare(model, optimizer, train_loader, test_loader,
                                                                  strategy="ring")

- the model: a ``PreparedModel`` for every strategy and world size, with ``.module``,
  ``no_sync()`` and the bare model's ``state_dict()`` keys (``prepared_model``);
- the optimizer (or a list of them): an instance of a subclass of the user's optimizer class
  whose ``step()`` also runs the strategy (``prepared_optimizer``), so schedulers accept it;
- the loaders: DataLoaders over this rank's share, batches on the device (``prepared_loader``);
  the first is the training loader, the others evaluation loaders; the samples left over when
  R does not divide the data set are padded as DistributedSampler pads them (``remainder``).

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

import torch
from torch.utils.data import DataLoader

from ddtrain.data.sharding import check_remainder, share_size
from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError
from ddtrain.sync import SyncOptions, check_options, strategy_spec, wrap
from ddtrain.training import schedules
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
            remainder: str = "pad", eval_remainder: str | None = None, **options):
    """``(model, optimizer, *loaders)`` set up for ``strategy`` on this rank (see the module doc).

    ``optimizer``: one optimizer, a list of them (returned as a list), or None. ``seed``: the
    seed every rank shares for the loaders' shuffles. ``remainder``: what happens to the samples
    left over when the number of ranks R does not divide a loader's: "pad" (DistributedSampler's
    default: the first ones are repeated), "drop" (``DistributedSampler(drop_last=True)``);
    ``eval_remainder`` the same for the evaluation loaders (default: ``remainder``), where
    "uneven" also gives every sample exactly once (shards differing by one sample).
    ``options``: SyncOptions fields (``find_unused_parameters=True``, ``sync_every=4``,
    ``servers=2``...) and ``broadcast_buffers``.
    Without loaders the third value is None (``model, optimizer, _ = prepare(model, optimizer)``).
    """
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
        if loader is not None and not isinstance(loader, DataLoader):
            raise DDTrainError(f"prepare(): loaders must be torch.utils.data.DataLoader, got {type(loader).__name__}")
    if loaders and loaders[0] is not None:
        # before any rank serves: every rank, servers included, reaches the same verdict from the sizes alone
        workers = runtime.total_ranks() - strategy_spec(strategy).extra_ranks(settings.servers) \
            if runtime.total_ranks() > 1 else 1
        schedules.check_sizes(optimizers, loaders[0], prepared_batches(loaders[0], workers, remainder), workers)
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
    prepared_loaders = [None if loader is None else
                        PreparedLoader(loader, rank=synced.worker_rank, world_size=synced.workers, device=device,
                                       seed=seed, training=index == 0, strategy=synced,
                                       remainder=remainder if index == 0 else eval_remainder)
                        for index, loader in enumerate(loaders)] or [None]
    return (PreparedModel(model, synced), prepared_optimizer, *prepared_loaders)
