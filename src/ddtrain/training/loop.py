"""The training loop: sharded data, one strategy, metrics averaged over ranks, a results record.

``fit`` is what ``ddtrain train`` runs; callers with their own loop use ``ddtrain.prepare``.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ddtrain.reliability import guard
from ddtrain.observe import files
from ddtrain.dist import runtime
from ddtrain.reliability import stall
from ddtrain.observe import tracing
from ddtrain.config import TrainConfig
from ddtrain.data import Data
from ddtrain.data.loading import ShardLoader
from ddtrain.data.sharding import ShardSampler
from ddtrain.training.evaluate import Meter, autocast, evaluate, loss_function
from ddtrain.reliability.keeper import Keeper
from ddtrain.training.progress import ProgressBar, epoch_line
from ddtrain.sync import wrap


def build_optimizer(config: TrainConfig, params) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def fit(model: nn.Module, data: Data, config: TrainConfig, *, optimizer=None, loss_fn=None,
        callbacks=()) -> dict:
    """Train ``model`` on ``data`` with ``config.strategy``; returns (and writes) the results record."""
    runtime.init()
    device = runtime.device()
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = optimizer or build_optimizer(config, model.parameters())
    guard.check_startup(config, model, data)  # ranks that disagree refuse to start, naming rank and field
    synced = wrap(config.strategy, model, optimizer, config.sync)
    distributed = runtime.is_distributed()
    torch.manual_seed(config.seed * 1000 + runtime.rank())  # per-rank dropout and augmentation
    step_model = torch.compile(synced.model) if config.compile else synced.model
    loss_fn = loss_fn or loss_function(data.task)
    classify = data.task == "classification"
    scaler = torch.amp.GradScaler(device.type) if config.amp == "fp16" else None
    state = {"config": config, "model": synced.module, "optimizer": optimizer, "synced": synced}
    sampler = ShardSampler(len(data.train), rank=synced.worker_rank, world_size=synced.workers,
                           seed=config.seed, policy=config.sharding)
    on_device = config.data_on_device == "yes" or (config.data_on_device == "auto" and device.type == "cuda")
    loader = ShardLoader(data.train, sampler, config.batch_size, device, workers=config.loader_workers,
                         on_device=on_device, channels_last=config.channels_last)
    epochs = config.epochs or math.ceil(config.steps / loader.steps)
    if config.steps:
        epochs = min(epochs, math.ceil(config.steps / loader.steps)) if config.epochs else epochs
    record = {"config": config.as_dict(), "world_size": runtime.world_size(), "workers": synced.workers,
              "strategy": config.strategy, "role": synced.role, "sharding": sampler.describe(),
              "global_batch_size": config.batch_size * synced.workers, "epochs": [],
              "versions": files.versions(runtime.backend(), device)}
    state["keeper"] = keeper = Keeper(config, synced, optimizer, scaler, record, data, epochs=epochs)
    keeper.resume()  # --resume, or a restart by torchrun: continue from the newest whole checkpoint
    for cb in callbacks:
        cb.on_train_begin(state)
    # a wait that times out names the step, the operation and the ranks that are elsewhere
    what = f"strategy {config.strategy}, backend {runtime.backend()}"
    with stall.watched(what=what, timeout_s=runtime.timeout_s()):
        if synced.role == "server":
            stall.mark(None, "serving as a parameter server")
            synced.serve()
        else:
            _train_epochs(step_model, synced, loader, data, config, epochs, loss_fn, classify, scaler,
                          device, distributed, callbacks, state, record)
    synced.finish()
    synced.update_stats()
    record["comm"] = _gather_stats(synced, distributed)
    record["final"] = {k: v for k, v in (record["epochs"][-1] if record["epochs"] else {}).items()
                       if k.startswith("val_")}
    if runtime.rank() == 0:
        if config.out:
            files.write_json(config.out, record)
        if config.save:
            files.save_model(synced.module, config.save)
    for cb in callbacks:
        cb.on_train_end(record, state)
    return record


def _train_epochs(step_model, synced, loader, data, config, epochs, loss_fn, classify, scaler, device,
                  distributed, callbacks, state, record):
    keeper = state["keeper"]
    step, rank0 = keeper.step, runtime.rank() == 0 and not config.quiet
    step_model.train()
    for epoch in range(keeper.epoch, epochs + 1):
        loader.set_epoch(epoch)
        for cb in callbacks:
            cb.on_epoch_begin(epoch, state)
        meter, split = Meter(device, classify), {"data_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}
        bar = ProgressBar(loader.steps, f"Epoch {epoch}/{epochs}", enabled=rank0)
        start = last = time.perf_counter()
        start -= keeper.time_done(epoch)  # a resumed epoch counts the time its first part took
        steps_done = keeper.begin_epoch(epoch, meter)  # > 0 only in the epoch a checkpoint stopped in
        for x, y in keeper.batches(loader):
            if config.steps and step >= config.steps:
                break
            for cb in callbacks:
                cb.on_step_begin(step, state)
            keeper.begin_step(step)
            t_data = time.perf_counter()
            with autocast(device, config.amp):
                out = step_model(x)
                loss = loss_fn(out.float(), y)
            keeper.check_loss(loss, step)
            (scaler.scale(loss) if scaler else loss).backward()
            t_compute = time.perf_counter()
            if not keeper.step_ok(step):  # non-finite and --on-nonfinite skip: every rank skips it
                pass
            elif scaler:
                scaler.step(synced.optimizer)
                scaler.update()
            else:
                synced.optimizer.step()
            synced.optimizer.zero_grad(set_to_none=True)
            synced.after_step(step)
            t_end = time.perf_counter()
            split["data_s"] += t_data - last
            split["compute_s"] += t_compute - t_data
            split["optimizer_s"] += t_end - t_compute
            if tracing.enabled():
                tracing.add("data", last, t_data, step=step)
                tracing.add("forward+backward", t_data, t_compute, step=step)
                tracing.add("optimizer+sync", t_compute, t_end, step=step)
            last = t_end
            meter.add(loss, out, y, classify)
            step += 1
            steps_done += 1
            keeper.after_step(step, steps_done)  # checkpoint and replica check when due
            bar.update(steps_done, f"loss {loss.item():.4f}" if bar.enabled else "")
            if rank0 and config.log_every and step % config.log_every == 0:
                runtime.print0(f"  step {step} - loss: {loss.item():.4f}")
            for cb in callbacks:
                cb.on_step_end(step, {"loss": loss}, state)
        synced.end_epoch(epoch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        bar.close()
        train_loss, train_acc, n = meter.reduce(synced.group, distributed)
        logs = {"epoch": epoch, "steps": steps_done, "time_s": elapsed, "train_loss": train_loss,
                "train_accuracy": train_acc, "samples_per_s": n / elapsed if elapsed > 0 else float("nan"),
                "step_split_s": {k: round(v, 6) for k, v in split.items()}}
        if data.val is not None:
            logs["val_loss"], logs["val_accuracy"] = evaluate(
                synced.module, data.val, worker_rank=synced.worker_rank, workers=synced.workers,
                batch_size=config.batch_size, device=device, task=data.task, group=synced.group,
                distributed=distributed, amp=config.amp, channels_last=config.channels_last)
        record["epochs"].append(logs)
        if rank0:
            runtime.print0(epoch_line(epoch, epochs, logs))
        for cb in callbacks:
            cb.on_epoch_end(epoch, logs, state)
        if config.steps and step >= config.steps:
            break


def _gather_stats(synced, distributed) -> list[dict]:
    mine = {"rank": runtime.rank(), "role": synced.role, **synced.stats.as_dict()}
    if not distributed:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
