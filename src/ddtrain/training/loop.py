"""The training loop: sharded data, one strategy, metrics averaged over ranks, a results record.
``fit`` is what ``ddtrain train`` runs; callers with their own loop use ``ddtrain.prepare``. A
step is one optimizer update over ``grad_accum`` micro-batches (communication on the last one
only); the recipe (optimizer, lr schedule, clipping, label smoothing: ``ddtrain.recipe``) and
the trackers (``observe.tracking``) come from the config. The
loop's state is a ``TrainState``; the reliability components own their schedule (a
``Checkpointer`` when there is a checkpoint directory, a ``NonfiniteGuard``, a ``ReplicaCheck``
on the workers of a distributed run) and fault injection is a callback installed only when
DDTRAIN_FAULT asks for one.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ddtrain.config import TrainConfig
from ddtrain.data import Data
from ddtrain.data.images import ProblemLog, summarise
from ddtrain.data.loading import ShardLoader
from ddtrain.data.sharding import ShardSampler
from ddtrain.distributed import runtime, storage
from ddtrain.observe import files, tracking
from ddtrain.reliability import checkpoint_elastic, consistency, faults, stall, watchdog
from ddtrain.distributed.job import restart_attempt
from ddtrain.errors import DDTrainError
from ddtrain.reliability.checkpoint import Checkpointer, path_for as checkpoint_path_for
from ddtrain.reliability.nonfinite import NonfiniteGuard
from ddtrain.reliability.preemption import Preemption, write_report
from ddtrain.reliability.replicas import ReplicaCheck
from ddtrain.sync import strategy_spec, wrap
from ddtrain import recipe
from ddtrain.training import balance, compiled
from ddtrain.training.balance import Balancer
from ddtrain.training.build import check_run
from ddtrain.training.callbacks import TrainState, bound
from ddtrain.training.evaluate import Meter, autocast, evaluate
from ddtrain.training.progress import PLAIN_EVERY_S, ProgressBar, epoch_line


def fit(model: nn.Module, data: Data, config: TrainConfig, *, optimizer=None, loss_fn=None,
        callbacks=()) -> dict:
    """Train ``model`` on ``data`` with ``config.strategy``; returns (and writes) the results record.

    ``callbacks``: objects with any of the hook methods of ``ddtrain.Callback``. The recipe's
    optimizer settings (``optimizer``, ``scale_lr``, ``decay_exclude``) apply when ``fit`` builds
    the optimizer; the schedule and the clipping also apply to an ``optimizer`` passed in.
    With a checkpoint directory, SIGTERM, SIGINT and ``preempt_signal`` stop every rank after
    the same step with a checkpoint (docs/RELIABILITY.md): the record's ``reliability.preempted``
    then says where, and no ``out`` or ``save`` file is written (the run is not over).
    """
    runtime.init()
    # the workers (ranks that train: not the parameter servers) fix the per-rank batch and the lr scaling
    workers = max(runtime.total_ranks() - strategy_spec(config.strategy).extra_ranks(config.sync.servers), 1) \
        if runtime.total_ranks() > 1 else 1
    preemption = None
    if config.reliability.checkpoint_dir:  # from here on a stop signal is only noted, then obeyed between steps
        preemption = Preemption(config.reliability.preempt_signals(), participants=workers).install()
    try:
        return _fit(model, data, config, optimizer, loss_fn, callbacks, workers, preemption)
    finally:
        if preemption is not None:
            preemption.restore()


def _fit(model, data, config, optimizer, loss_fn, callbacks, workers, preemption) -> dict:
    device = runtime.device()
    model = model.to(device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    asked_accum = config.recipe.grad_accum
    # batch_size: the per-rank micro-batch; a resume keeps the global batch (grad_accum re-chosen if it must)
    config = config.resolved(workers, resuming=bool(config.reliability.checkpoint_dir) and (
        config.reliability.resume or restart_attempt() > 0))
    if config.recipe.grad_accum != asked_accum:
        runtime.print0(f"note: grad_accum {asked_accum} does not divide the global batch of "
                       f"{config.recipe.global_batch_size} among {workers} workers; using grad_accum "
                       f"{config.recipe.grad_accum} (micro-batches of {config.recipe.batch_size}), the same training")
    per_epoch, plan = check_run(config, data, workers)   # batch, accumulation, warm-up, label smoothing
    trackers = tracking.trackers(config.tracking, runtime.rank())   # a missing library fails here, before training
    optimizer = optimizer or recipe.build_optimizer(config.recipe, model, workers)
    # once per process: the start-up comparison and every checkpoint header read this one
    fingerprint = consistency.fingerprint(config, model, data, runtime.total_ranks())
    consistency.check_startup(fingerprint)  # ranks that disagree refuse to start, naming rank and field
    strategy = wrap(config.strategy, model, optimizer, config.sync)
    distributed = runtime.is_distributed()
    torch.manual_seed(config.seed * 1000 + runtime.rank())  # per-rank dropout and augmentation
    scaler = torch.amp.GradScaler(device.type) if config.amp == "fp16" else None
    # with --global-batch-size the sample order is a function of (seed, epoch, step) only: a resume
    # on another worker count trains the same samples at every step
    sampler = ShardSampler(len(data.train), rank=strategy.worker_rank, world_size=strategy.workers,
                           seed=config.seed, policy=config.data.sharding,
                           global_batch=config.recipe.global_batch_size if config.recipe.global_batch_size else 0)
    on_device = config.data.data_on_device == "yes" or (config.data.data_on_device == "auto" and device.type == "cuda")
    # an image that cannot be decoded: one line the first time this rank meets it, counted in the record
    problems = ProblemLog(report=lambda p: runtime.eprint(f"data: {p.line()}"))
    loader = ShardLoader(data.train, sampler, config.recipe.batch_size, device, workers=config.data.loader_workers,
                         on_device=on_device, channels_last=config.channels_last, problems=problems)
    epochs = config.epochs or math.ceil(config.steps / per_epoch)
    if config.steps:
        epochs = min(epochs, math.ceil(config.steps / per_epoch)) if config.epochs else epochs
    schedule = clip = None
    if config.recipe.lr_schedule != "constant" or config.recipe.lr_warmup_steps or config.recipe.lr_warmup_epochs:
        schedule = recipe.Schedule(optimizer, plan)
    if config.recipe.clip_grad:
        clip = recipe.clip_gradients(optimizer, config.recipe.clip_grad)
    record = {"config": config.as_dict(), "world_size": runtime.total_ranks(), "workers": strategy.workers,
              "strategy": config.strategy, "role": strategy.role, "sharding": sampler.describe(),
              "global_batch_size": config.recipe.batch_size * strategy.workers * config.recipe.grad_accum,
              "updates_per_epoch": per_epoch, "epochs": [], "data_pipeline": loader.describe(),
              "versions": files.versions(runtime.backend(), device)}
    scanned = list(getattr(data.train, "scan_problems", ()))  # files left out before training (empty ones)
    for p in scanned:   # a warning: shown under --quiet too, like the lines for files that fail to decode
        runtime.print0(f"data: {p.line()}")
    info = record["reliability"] = {"attempt": restart_attempt(), "resumed_from": None, "checkpoints_written": 0,
                                    "nonfinite_skipped": [], "replica_checks": 0, "rebroadcasts": []}
    callbacks = [*callbacks, *trackers, *faults.injectors(runtime.rank())]
    state = TrainState(config=config, strategy=strategy, model=strategy.module, optimizer=optimizer, scaler=scaler,
                       device=device, data=data, record=record, fingerprint=fingerprint, callbacks=callbacks,
                       epochs=epochs, schedule=schedule, updates_per_epoch=per_epoch, preemption=preemption)
    options = config.reliability
    state.nonfinite = NonfiniteGuard(options.on_nonfinite, module=strategy.module, scaler=scaler, device=device,
                                     group=strategy.group, info=info)
    if config.data.balance != "none" and distributed and strategy.role == "worker" and strategy.workers > 1:
        state.balancer = Balancer(config.data.balance, workers=strategy.workers, worker_rank=strategy.worker_rank,
                                  global_batch=record["global_batch_size"], grad_accum=config.recipe.grad_accum,
                                  every=config.data.balance_every, group=strategy.group, device=device,
                                  lookahead=loader.lookahead(), updates_per_epoch=per_epoch)
        if state.balancer.unequal:
            loader.share_by(state.balancer.schedule, strategy.worker_rank, config.recipe.grad_accum)
        state.balancer.attach(strategy.module)
    if distributed and strategy.role == "worker":
        state.replicas = ReplicaCheck(strategy, check_every=config.sync.check_every,
                                      on_mismatch=options.on_mismatch, info=info)
    if options.checkpoint_dir:
        state.checkpointer = Checkpointer(options, strategy=strategy, strategy_name=config.strategy,
                                          optimizer=optimizer, scaler=scaler, fingerprint=fingerprint, record=record,
                                          info=info, max_steps=config.steps, epochs=epochs, seed=config.seed,
                                          schedule=recipe.schedule_record(config, plan),
                                          schedule_change=recipe.schedule_change,
                                          elastic=checkpoint_elastic.section(
                                              config, workers=strategy.workers,
                                              servers=runtime.total_ranks() - strategy.workers if distributed else 0,
                                              train_samples=len(data.train),
                                              resize_rule=checkpoint_elastic.rule(strategy.spec, config.sync.compression)))
        # a restart whose rank 0 moved to a node without the checkpoints must not start from step 0
        storage.check_shared(options.checkpoint_dir, attempt=info["attempt"],
                             max_restarts=storage.restarts_allowed(options.max_restarts))
        state.checkpointer.resume()  # resume=True, or a restart by torchrun: the newest whole checkpoint
        state.step, state.epoch = state.checkpointer.step, state.checkpointer.epoch
        if schedule is not None:
            schedule.jump_to(state.step)  # the optimizer's restored lr is the saved step's; the next is this
    from ddtrain.reliability.ownership import note_membership  # every (re)start's world size, across restarts (docs/ELASTIC.md)
    record["membership"] = note_membership(options.checkpoint_dir, step=state.step, world_size=runtime.total_ranks(),
                                           attempt=info["attempt"], resumed=info["resumed_from"] is not None,
                                           write=runtime.rank() == 0)
    for hook in bound(callbacks, "on_train_begin"):
        hook(state)
    # a wait that times out names the step, the operation and the ranks that are elsewhere
    what = f"strategy {config.strategy}, backend {runtime.backend()}"
    with stall.watched(what=what, timeout_s=runtime.timeout_s()), watchdog.guard(what, runtime.timeout_s()):
        if strategy.role == "server":
            stall.mark(None, "serving as a parameter server")
            strategy.serve()
        else:
            step_model = strategy.model
            if config.compile:
                planned = epochs * per_epoch if not config.steps else min(config.steps, epochs * per_epoch)
                planned = max(planned - state.step, 0)     # what is left of the run after a resume
                chosen, why = compiled.choose(config.compile_options, device, runtime.total_ranks(), planned)
                record["compile"] = {"options": chosen, "reason": why, "planned_steps": planned}
                step_model = compiled.compile_model(strategy.model, config.compile_options, device, planned,
                                                    static_shapes="parameters" in strategy.spec.shards)
            _train_epochs(state, step_model, loader,
                          loss_fn or recipe.loss_function(data.task, config.recipe.label_smoothing), distributed)
            if state.checkpointer is not None:
                state.checkpointer.finish()  # the last write is on disk (or its failure is raised on every rank)
    for handle in (schedule, clip):  # the optimizer may outlive the run (passed in by the caller)
        if handle is not None:
            handle.remove()
    if state.balancer is not None:
        state.balancer.detach()
        record["balance"] = state.balancer.record()   # every worker gathered the same numbers
    strategy.finish()
    strategy.update_stats()
    record["comm"] = _gather_stats(strategy, distributed)
    if hasattr(strategy, "run_record"):   # auto: its predictions, trials, switches and choice (docs/AUTO.md)
        record["auto"] = strategy.run_record()
    record["data_problems"] = _gather_problems(problems, scanned, distributed)
    record["final"] = {k: v for k, v in (record["epochs"][-1] if record["epochs"] else {}).items()
                       if k.startswith("val_")}
    # a run that skipped most of its steps, or ended at a non-finite loss, is no success (the record says why)
    failed = None
    if strategy.role != "server" and not info.get("preempted"):
        failed = state.nonfinite.finish(state.step - state.first_step,
                                        record["epochs"][-1] if record["epochs"] else None)
        if info["nonfinite_skipped_steps"] and not failed and runtime.rank() == 0:
            runtime.eprint(f"ddtrain: note: {info['nonfinite_skipped_steps']} step(s) had a non-finite loss or "
                           "gradients and were skipped (the record's reliability.nonfinite_skipped lists them)")
    for hook in bound(callbacks, "on_train_end"):
        hook(record, state)  # callbacks add to the record (the profile) before its one write
    if runtime.rank() == 0 and not info.get("preempted"):  # a preempted run is not over: its outputs come at its end
        if config.out:
            files.write_json(config.out, record)
        if config.save and not failed:
            files.save_model(strategy.module, config.save)
    if failed:
        said = f"; the record {config.out} says so" if config.out else ""
        kept = f", and --save {config.save} was not written" if config.save else ""
        raise (DDTrainError if runtime.rank() == 0 else consistency.PeerStopped)(
            f"training failed: {failed}{said}{kept}")
    return record


def _train_epochs(state: TrainState, step_model, loader, loss_fn, distributed: bool) -> None:
    config, strategy, device, data = state.config, state.strategy, state.device, state.data
    optimizer, scaler, amp = strategy.optimizer, state.scaler, config.amp
    checkpointer, nonfinite, replicas = state.checkpointer, state.nonfinite, state.replicas
    epoch_begin, step_begin, step_end, epoch_end = (bound(state.callbacks, name) for name in (
        "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end"))
    classify, max_steps, log_every = data.task == "classification", config.steps, config.log_every
    forward_backward = "forward+backward" + (" (the gradient all-reduce runs inside backward)"
                                             if strategy.spec.sync_in_backward else "")
    step, rank0 = state.step, runtime.rank() == 0 and not config.quiet
    compiling = config.compile
    balancer = state.balancer
    # unequal shares: each micro-batch's mean loss x its samples x R / G, so the average over the workers is the
    # global batch's mean gradient (equal shares: the factor is 1 and is left out)
    weigh = (lambda samples: balance.loss_weight(samples, strategy.workers, state.record["global_batch_size"])) \
        if balancer is not None and balancer.unequal else None
    k, per_epoch = config.recipe.grad_accum, state.updates_per_epoch
    # the first k-1 micro-batches' backward passes communicate nothing (the strategy's no_sync:
    # DDP's own for the DDP-based strategies; the others communicate in the optimizer step anyway)
    no_sync = getattr(strategy, "no_sync", None) or getattr(strategy.model, "no_sync", None) or contextlib.nullcontext
    preemption = state.preemption
    if preemption is not None and _stop_agreed(preemption, step):   # signalled before the first step: nothing to save
        _preempted(state, saved=False)
        return
    step_model.train()
    state.first_step = step    # this process's first step (a resumed run starts later)
    for epoch in range(state.epoch, state.epochs + 1):
        state.epoch = epoch
        loader.set_epoch(epoch)
        for hook in epoch_begin:
            hook(epoch, state)
        meter = Meter(device, classify)
        data_s = compute_s = optimizer_s = 0.0
        start = last = time.perf_counter()
        steps_done, took = checkpointer.enter_epoch(epoch, meter) if checkpointer is not None else (0, 0.0)
        start -= took  # a resumed epoch counts the time its first part took
        state.steps_done = steps_done
        loader.first_step = step - steps_done   # the shares of --balance speed are those of the global step
        if balancer is not None:
            balancer.start()
        # with --log-every the step lines already say how far it is: no plain progress lines besides
        left = min(per_epoch, steps_done + max_steps - step) if max_steps else per_epoch   # --steps may end it early
        bar = ProgressBar(left, f"Epoch {epoch}/{state.epochs}", enabled=rank0,
                          every_s=math.inf if log_every else PLAIN_EVERY_S)
        if compiling:   # torch.compile traces and compiles in the first step: minutes, said before it starts
            bar.phase("compiling the model (torch.compile, in the first step)")
            compiling = False
        # steps_done > 0 only in the epoch a checkpoint stopped in: its trained batches are drawn and dropped
        batches = checkpointer.batches(loader, steps_done * k) if steps_done else loader
        for group in _groups(batches, k) if k > 1 else ([b] for b in batches):
            if max_steps and step >= max_steps:
                break
            stall.mark(step, forward_backward)
            for hook in step_begin:
                hook(step, state)
            t_data = time.perf_counter()
            if k == 1:
                (x, y), = group
                with autocast(device, amp):
                    out = step_model(x)
                    loss = loss_fn(out.float(), y)
                nonfinite.check_loss(loss, step)
                weighted = loss * weigh(y.shape[0]) if weigh is not None else loss
                (scaler.scale(weighted) if scaler else weighted).backward()
                seen = [(loss, out, y)]
            else:
                loss, seen = _accumulate(group, step_model, loss_fn, no_sync, nonfinite, scaler, device, amp, step,
                                         weigh)
            t_compute = time.perf_counter()
            applied = nonfinite.step_ok(step)
            if not applied:  # non-finite and on_nonfinite="skip": every rank skips it
                pass
            elif scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            strategy.after_step(step)
            t_end = time.perf_counter()
            data_s += t_data - last
            compute_s += t_compute - t_data
            optimizer_s += t_end - t_compute
            begin, last = last, t_end
            for micro_loss, out, y in seen if applied else ():   # a skipped step's loss is no training loss
                meter.add(micro_loss, out, y, classify)
            step += 1
            steps_done += 1
            state.step, state.steps_done = step, steps_done
            if balancer is not None:   # every balance_every steps a collective: the same steps on every worker
                balancer.step_end(step, sum(y.shape[0] for _, y in group), step - steps_done)
            end_of_epoch = steps_done == per_epoch
            saved = checkpointer is not None and checkpointer.due(step, end_of_epoch)
            if saved:
                checkpointer.save(step, steps_done)
            if replicas is not None and replicas.due(step, end_of_epoch):
                replicas.check(step)
            bar.update(steps_done, lambda: f"loss {loss.item():.4f}")
            if rank0 and log_every and step % log_every == 0:
                runtime.print0(f"  step {step} - loss: {loss.item():.4f}")
            if step_end:  # the step's clock readings, measured once above
                logs = {"loss": loss, "begin_s": begin, "data_end_s": t_data, "compute_end_s": t_compute,
                        "end_s": t_end}
                for hook in step_end:
                    hook(step, logs, state)
            # every worker stops after the same step, any of them signalled (the last step ends the run anyway)
            if preemption is not None and not checkpointer.final and _stop_agreed(preemption, step):
                if not saved:
                    checkpointer.save(step, steps_done)
                _preempted(state, saved=True)
                return
        stall.mark(step, f"end of epoch {epoch} (metrics and validation)")
        strategy.end_epoch(epoch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        bar.close()
        train_loss, train_acc, n = meter.reduce(strategy.group, distributed)
        logs = {"epoch": epoch, "steps": steps_done, "time_s": elapsed, "train_loss": train_loss,
                "train_accuracy": train_acc, "samples_per_s": n / elapsed if elapsed > 0 else float("nan"),
                "step_split_s": {"data_s": round(data_s, 6), "compute_s": round(compute_s, 6),
                                 "optimizer_s": round(optimizer_s, 6)}}
        if data.val is not None:
            logs["val_loss"], logs["val_accuracy"] = evaluate(
                strategy.module, data.val, worker_rank=strategy.worker_rank, workers=strategy.workers,
                batch_size=config.recipe.batch_size, device=device, task=data.task, group=strategy.group,
                distributed=distributed, amp=amp, channels_last=config.channels_last, problems=loader.problems)
        state.record["epochs"].append(logs)
        if rank0:
            runtime.print0(epoch_line(epoch, state.epochs, logs))
        for hook in epoch_end:
            hook(epoch, logs, state)
        if max_steps and step >= max_steps:
            break


def _stop_agreed(preemption, step: int) -> bool:
    stall.mark(step, "preemption check (every worker, through the store)")
    return preemption.should_stop()


def _preempted(state: TrainState, saved: bool) -> None:
    """Every worker, after a stop agreed at ``state.step``: the checkpoint on disk, the record and the launcher told."""
    checkpointer, preemption, info = state.checkpointer, state.preemption, state.record["reliability"]
    checkpointer.finish()    # the write in flight (this one) done: a full disk stops here, with one message
    resumed = info.get("resumed_from")
    path = str(checkpoint_path_for(checkpointer.directory, state.step)) if saved else \
        (resumed["path"] if resumed else None)
    signal_name, signal_at = preemption.signal_name, preemption.first[1] if preemption.first else None
    info["preempted"] = {"step": state.step, "epoch": state.epoch, "checkpoint": path, "saved": saved,
                         "signal": signal_name, "signal_at": signal_at, "stopped_at": time.time()}
    if runtime.rank() == 0 or runtime.local_rank() == 0:   # each node's launcher reads its own node's report
        write_report(state.step, path, signal_name=signal_name, signal_at=signal_at, rank=runtime.rank(),
                     saved=saved)


def _groups(batches, k: int):
    """The loader's micro-batches ``k`` at a time (an incomplete last group is dropped)."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == k:
            yield group
            group = []


def _accumulate(group, step_model, loss_fn, no_sync, nonfinite, scaler, device, amp, step, weigh=None):
    """Forward and backward of each micro-batch, the gradient communicated with the last one only.

    Each micro-batch's mean loss is weighted by its share of the group's samples, so the summed
    gradient is that of the mean loss over all of them: k micro-batches of B give the step of one
    batch of k*B. ``weigh`` (unequal shares, ``training.balance``): the weight of a micro-batch of
    n samples instead, n x R / G. Returns (the group's mean loss, [(loss, output, target) per micro-batch]).
    """
    total = sum(y.shape[0] for _, y in group)
    seen = []
    for i, (x, y) in enumerate(group):
        with no_sync() if i < len(group) - 1 else contextlib.nullcontext():
            with autocast(device, amp):
                out = step_model(x)
                loss = loss_fn(out.float(), y)
            nonfinite.check_loss(loss, step)
            share = loss * (weigh(y.shape[0]) if weigh is not None else y.shape[0] / total)
            (scaler.scale(share) if scaler else share).backward()
        seen.append((loss, out, y))
    mean = sum(loss.detach() * (y.shape[0] / total) for loss, _, y in seen)
    nonfinite.check_loss(mean, step)  # skip mode: one bad micro-batch marks the whole step
    return mean, seen


def _gather_problems(problems: ProblemLog, scanned: list, distributed: bool) -> dict:
    """The bad files every rank met (each counted once per use), and those the scan left out."""
    mine = problems.as_dict()
    everyone = [mine]
    if distributed:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    scan = ProblemLog(report=lambda p: None)
    scan.add(scanned)
    return summarise([*everyone, scan.as_dict()])


def _gather_stats(strategy, distributed) -> list[dict]:
    mine = {"rank": runtime.rank(), "role": strategy.role, **strategy.stats.as_dict()}
    if not distributed:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone
