"""A script's state saved and resumed: ``ddtrain.save_state``, ``load_state``, ``stop_requested``, ``register_for_checkpointing``.

What ``prepare()`` returned is registered here (``register``: one ``Prepared`` per call): the
model, its optimizers, the LR schedulers given to ``prepare`` or created on one of its
optimizers (found when saving and loading: ``schedulers_of``), a ``GradScaler`` given to it,
the training loader and the strategy. ``save_state(D)`` writes all of it, with what
``register_for_checkpointing`` named, every rank's RNG states (torch CPU and CUDA, numpy,
Python's), the training loader's place in its epoch and the strategy's and gradient
compressor's state, as one file in ``ddtrain train``'s checkpoint format
(``reliability.checkpoint``: a header with checksums, the payload, atomic writes, per-rank
parts; ``kind: "state"`` in the header), so ``ddtrain checkpoint info`` reads it and the same
integrity checks refuse a damaged one. ``load_state(D)`` restores the newest whole file and
returns where it stood (``Resumed``: ``step``, ``epoch``), or None when D holds none; iterating
the prepared training loader in that epoch then yields only the batches not yet trained.

Stopping: ``stop_requested()`` is true on every rank once a stop signal (SIGTERM, SIGINT,
``DDTRAIN_PREEMPT_SIGNAL``'s) reached any rank, agreed at an optimizer step through the job's
store (``reliability.preemption``), the step of the last prepared model. With a checkpoint
directory (``prepare(checkpoint_dir=D)``, by default ``ddtrain run --checkpoint-dir``'s) a
script that never asks is stopped for it: once the step's own code has run (its loop asks the
training loader for the next batch) the state is saved and the process ends (``Preempted``;
exit status 75, or 0 where ddtrain's launcher reports it and exits 75);
and the saved state is loaded before the training loader's first iteration, the epochs it had
finished passing with no batches (``_deferred_load``).

Elastic: with a global batch (``prepare(global_batch_size=G)`` or ``ddtrain run
--global-batch-size G``) the training loader's order does not depend on the world size
(``PreparedLoader``), so a state saved by R workers loads on any R' that divides G: the
replicated state as it was, the loader's place counted in samples, the RNG streams of new
ranks derived from (seed, step, rank), a compressor's error feedback merged, per-rank replicas
by the strategy's rule (``reliability.checkpoint_elastic``, as ``ddtrain train`` does).
"""
from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ddtrain.distributed import job, launch, runtime
from ddtrain.errors import DDTrainError
from ddtrain.reliability import checkpoint, checkpoint_elastic
from ddtrain.reliability.consistency import ConfigMismatch, PeerStopped, differences
from ddtrain.reliability.preemption import Preemption, write_report
from ddtrain.version import __version__

__all__ = ["Preempted", "Resumed", "load_state", "register_for_checkpointing", "save_state", "stop_requested"]

DEFAULT_KEEP = 2    # state files kept: the newest, and one to fall back on if the newest is found damaged
RESUME_HINT = "run the same command again: the script's state is loaded from there (ddtrain.load_state)"
# what must agree between a saved state and the script loading it (world_size and batch_size only
# without a global batch: with one, the order and the update do not depend on the worker count)
FIELDS = ("models", "parameter_shapes", "strategy", "optimizers", "schedulers", "scaler", "objects", "train_samples",
          "seed", "global_batch_size", "grad_accum")
SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


@dataclass
class Prepared:
    """What one ``prepare()`` call set up, as ``save_state`` needs it."""

    model: weakref.ref              # the PreparedModel (weak: a model the script dropped leaves the registry)
    strategy: object                # the ddtrain.sync Strategy applied to it
    strategy_name: str
    compression: str
    optimizers: list                # the prepared optimizers (they share the user's objects' state)
    originals: list                 # the user's optimizer objects (a scheduler made before prepare() holds one)
    counter: object                 # prepared_optimizer.StepCounter: optimizer steps done
    loader: object | None           # the training PreparedLoader, if one was given
    schedulers: list                # LR schedulers given to prepare()
    scaler: object | None           # a GradScaler given to prepare()
    seed: int
    global_batch: int               # 0: none stated
    grad_accum: int


@dataclass(frozen=True)
class Resumed:
    """Where a loaded state stood: ``step`` optimizer steps done, ``epoch`` the epoch in progress (the loader's, from 0)."""

    step: int
    epoch: int
    path: str
    world_size_was: int


class Preempted(SystemExit):
    """The end of a process stopped by a signal with its state saved (``prepare(checkpoint_dir=...)``)."""


class _Session:
    """This process's registry: the prepared things, the registered objects, the stop signals, the automatic mode."""

    def __init__(self):
        self.entries: list[Prepared] = []
        self.objects: list = []
        self.preemption: Preemption | None = None
        self.directory: str | None = None    # prepare(checkpoint_dir=...): save at a stop, load at the start
        self.every = 0                       # prepare(checkpoint_every=N)
        self.loaded = False                  # a state was loaded (or found absent): not again
        self.asked = False                   # the script calls stop_requested(): it stops itself
        self.saved_epoch: int | None = None  # the epoch a deferred load waits for (-1: nothing to load)
        self.due: str | None = None          # "save" or "stop", agreed at the last step, done at the loader's next batch


_session = _Session()


def forget() -> None:
    """Drop the registry and put back the signal handlers (``ddtrain.shutdown()`` calls this)."""
    global _session
    if _session.preemption is not None:
        _session.preemption.restore()
    _session = _Session()


def register(entry: Prepared, *, checkpoint_dir: str | None = None, checkpoint_every: int = 0) -> None:
    """``prepare()``'s call: remember ``entry``; with ``checkpoint_dir``, save on a stop signal and load at the start."""
    s = _session
    s.entries = [e for e in s.entries if e.model() is not None] + [entry]
    if forget not in runtime.AT_SHUTDOWN:
        runtime.AT_SHUTDOWN.append(forget)
    entry.counter.after.append(lambda: _boundary(entry))
    if not checkpoint_dir:
        return
    if s.directory and os.path.abspath(s.directory) != os.path.abspath(checkpoint_dir):
        raise DDTrainError(f"prepare(checkpoint_dir={checkpoint_dir!r}): an earlier prepare() of this process "
                           f"named {s.directory!r}; one script keeps its state in one directory")
    s.directory, s.every = str(checkpoint_dir), checkpoint_every or s.every
    _preemption()
    if entry.loader is not None:
        entry.loader.after_batch = _when_due
        if not s.loaded:   # without a training loader the script calls load_state itself
            entry.loader.before_iteration = _deferred_load


def register_for_checkpointing(*objects) -> None:
    """Save and load ``objects`` (anything with ``state_dict()`` and ``load_state_dict()``) with the state, in this order."""
    for obj in objects:
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise DDTrainError(f"register_for_checkpointing(): a {type(obj).__name__} has no state_dict() and "
                               "load_state_dict() to save and load it by")
        if not any(obj is o for o in _session.objects):
            _session.objects.append(obj)


# ---- stopping -------------------------------------------------------------------------------

def _preemption() -> Preemption:
    s = _session
    if s.preemption is None:
        workers = s.entries[-1].strategy.workers if s.entries else runtime.world_size()
        s.preemption = Preemption(participants=workers, name="state").install()
    return s.preemption


def stop_requested() -> bool:
    """True on every rank once a stop signal reached any rank, agreed at the last prepared model's optimizer step.

    The first call installs the signal handlers (``prepare(checkpoint_dir=...)`` does at once) and
    tells ``prepare`` that the script stops by itself: save the state and leave the loop. Without
    a prepared optimizer the call itself is the point where the ranks agree (every rank calls it
    at the same points then).
    """
    s = _session
    s.asked = True
    fresh = s.preemption is None
    preemption = _preemption()
    if not any(e.model() is not None for e in s.entries):
        return preemption.should_stop()
    return preemption.stopped and not fresh


def _boundary(entry: Prepared) -> None:
    """After each optimizer step of ``entry``: at the last prepared model's, the agreed stop and the periodic save.

    The save itself waits for the rest of the step's code (``scheduler.step()``, the script's
    counters): it is done when the training loader is asked for its next batch (``_when_due``);
    without a training loader, here.
    """
    s = _session
    if not s.entries or entry is not s.entries[-1]:
        return
    stop = s.preemption is not None and s.preemption.should_stop()
    if not s.directory or s.asked:
        return
    if stop:
        s.due = "stop"
    elif s.every and entry.counter.steps % s.every == 0:
        s.due = "save"
    if s.due and not any(e.loader is not None for e in s.entries):
        _when_due(None)


def _when_due(loader) -> None:
    """The training loader's next batch is asked for: the save (and stop) agreed at the last step, if one is due."""
    s = _session
    due, s.due = s.due, None
    if due == "save":
        save_state(s.directory)
    elif due == "stop":
        _stop(s.entries[-1])


def _stop(entry: Prepared) -> None:
    """Every rank, at the step all agreed on: save (``save_state`` tells the launcher), or say it, and end the process."""
    s = _session
    path = save_state(s.directory)
    preemption, rank = s.preemption, runtime.rank()
    signal_name, signal_at = preemption.signal_name, preemption.first[1] if preemption.first else None
    step = entry.counter.steps
    code = launch.PREEMPTED_EXIT
    if os.environ.get(launch.PREEMPT_REPORT_ENV):   # ddtrain's launcher says it and exits 75
        code = 0
    elif rank == 0:   # started by torchrun or srun: nobody else will say it
        import time
        report = {"step": step, "checkpoint": str(path), "saved": True, "signal": signal_name,
                  "signal_at": signal_at, "written_at": time.time(), "rank": 0}
        launch.report_preemption(report, launch.PreemptPolicy(resume_hint=RESUME_HINT))
    raise Preempted(code)


# ---- what is saved --------------------------------------------------------------------------

def _live(what: str) -> list[Prepared]:
    """The registered prepare() calls whose model is alive; refuses what cannot be saved."""
    entries = [e for e in _session.entries if e.model() is not None]
    if not entries:
        raise DDTrainError(f"{what}(): nothing prepared yet; call ddtrain.prepare(model, optimizer, loader) first")
    for e in entries:
        spec = e.strategy.spec
        if spec is not None and (spec.uses_servers or not spec.checkpointable):
            raise DDTrainError(f"{what}(): strategy {e.strategy_name!r} keeps its state on parameter-server ranks, "
                               "which serve inside prepare() on this path; use ddtrain train --checkpoint-dir for it")
    return entries


def _directory(directory, what: str) -> str:
    directory = directory or _session.directory or job.checkpoint_dir()
    if not directory:
        raise DDTrainError(f"{what}(): no directory given, and no checkpoint directory set (prepare(checkpoint_dir=...), "
                           f"ddtrain run --checkpoint-dir, {job.CHECKPOINT_DIR_ENV})")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise DDTrainError(f"{what}(): {directory} is a file, not a directory")
    return str(directory)


def schedulers_of(entry: Prepared) -> list:
    """The LR schedulers of ``entry``: those given to prepare(), then those found on its optimizers, by class name.

    A scheduler holds its optimizer, the optimizer nothing of its scheduler, so the ones created
    on an optimizer are found among the objects that refer to it. Two of one class on the
    optimizers of one model could not be told apart between runs: they must be given to prepare().
    """
    given, found = list(entry.schedulers), []
    for optimizer in (*entry.optimizers, *entry.originals):
        for holder in gc.get_referrers(optimizer):
            for obj in gc.get_referrers(holder) if isinstance(holder, dict) else (holder,):   # Python < 3.11: __dict__
                if isinstance(obj, SCHEDULERS) and not any(obj is o for o in (*given, *found)):
                    found.append(obj)
    found.sort(key=lambda o: type(o).__name__)
    names = [type(o).__name__ for o in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DDTrainError(f"the optimizers of one prepared model have {len(names)} schedulers, "
                           f"{names.count(twice[0])} of them {twice[0]}: pass them to prepare() "
                           f"(model, optimizer, loader, scheduler, ...) so that each is saved and loaded as itself")
    return given + found


def fingerprint(entries: list[Prepared]) -> dict:
    """What a state must share with the script that loads it (and what ``checkpoint info`` shows)."""
    shapes, several = [], len(entries) > 1
    for index, e in enumerate(entries):
        prefix = f"model{index}." if several else ""
        shapes += [[prefix + name, list(p.shape), str(p.dtype).replace("torch.", "")]
                   for name, p in e.model().module.named_parameters()]
    first = next((e for e in entries if e.loader is not None), entries[-1])
    loader = first.loader
    samples = len(loader.dataset) if loader is not None and hasattr(loader.dataset, "__len__") else 0
    return {"ddtrain": __version__, "torch": str(torch.__version__), "world_size": entries[-1].strategy.workers,
            "models": len(entries), "parameter_shapes": shapes, "parameter_count": sum(
                p.numel() for e in entries for p in e.model().module.parameters()),
            "strategy": "+".join(e.strategy_name for e in entries),
            "optimizers": [[type(o).__name__ for o in e.originals] for e in entries],
            "schedulers": [[type(o).__name__ for o in schedulers_of(e)] for e in entries],
            "scaler": [e.scaler is not None for e in entries], "objects": [type(o).__name__ for o in _session.objects],
            "compression": [e.compression for e in entries], "train_samples": samples,
            "batch_size": loader.batch_size if loader is not None else 0, "seed": first.seed,
            "global_batch_size": first.global_batch, "grad_accum": first.grad_accum}


def section(entries: list[Prepared], train_samples: int) -> dict:
    """The header's ``elastic`` section (``checkpoint_elastic.section``'s fields): where the state can load."""
    first = next((e for e in entries if e.loader is not None), entries[-1])
    total, k, workers = first.global_batch, first.grad_accum, entries[-1].strategy.workers
    rules = [checkpoint_elastic.rule(e.strategy.spec, e.compression) for e in entries if e.strategy.spec is not None]
    out = {"global_batch_size": total, "grad_accum": k, "workers": workers, "servers": 0,
           "rule": next((r for r in rules if r != "identical"), "identical")}
    if not total:
        out["fixed"] = ("saved without a global batch (prepare(global_batch_size=G) or ddtrain run "
                        "--global-batch-size G): each worker's batch is the loader's")
        out["worker_counts"] = [workers]
    else:
        out["worker_counts"] = [r for r in checkpoint_elastic.worker_counts(total, train_samples or total)
                                if total % (r * k) == 0]
    return out


def _position(loader) -> dict | None:
    """A training loader's place: the epoch in progress (or next), its batches yielded, and in samples of all ranks."""
    if loader is None:
        return None
    pos = dict(loader.position)
    pos["samples"] = pos["batches"] * loader.batch_size * loader.world_size
    return pos


def _entry_state(e: Prepared) -> dict:
    return {"model": e.model().state_dict(), "optimizers": [o.state_dict() for o in e.optimizers],
            "schedulers": [s.state_dict() for s in schedulers_of(e)],
            "scaler": e.scaler.state_dict() if e.scaler is not None else None, "steps": e.counter.steps}


def save_state(directory=None, *, keep: int = DEFAULT_KEEP) -> Path:
    """Collective (every worker): save everything prepared to ``directory`` as ``ckpt-<step>.pt``; returns its path.

    ``directory``: default ``prepare(checkpoint_dir=...)``'s, else ``ddtrain run --checkpoint-dir``'s.
    Rank 0 writes the file atomically and keeps the ``keep`` newest; call it after the optimizer
    step (the loader's batches yielded so far count as trained). A failed write raises on every rank.
    """
    entries = _live("save_state")
    directory = _directory(directory, "save_state")
    if not isinstance(keep, int) or keep < 1:
        raise DDTrainError(f"save_state(): keep must be a positive number of files, got {keep!r}")
    s, rank0 = _session, runtime.rank() == 0
    replicated = all(e.strategy.spec is None or e.strategy.spec.replicated for e in entries)
    last = entries[-1]
    loader = next((e.loader for e in entries if e.loader is not None), None)
    state = None
    sharded = any(e.strategy.spec is not None and e.strategy.spec.sharded for e in entries)
    if not replicated or rank0 or sharded:   # sharded (zero, fsdp): state_dict() gathers, on every rank
        state = {"entries": [_entry_state(e) for e in entries], "objects": [o.state_dict() for o in s.objects]}
    part = {"rng": checkpoint.rng_state(), "rng_epoch": loader.rng_epoch if loader is not None else None,
            "loaders": [_position(e.loader) for e in entries], "strategies": [e.strategy.state_dict() for e in entries],
            "compressors": [e.strategy.compressor_state_dict() for e in entries]}
    if not replicated:
        part.update(state)
    step, position = last.counter.steps, _position(loader) or {"epoch": 0, "batches": 0}
    fp = fingerprint(entries)
    header = {"kind": checkpoint.STATE_KIND, "written_by": "ddtrain.save_state", "step": step,
              "epoch": position["epoch"] + 1, "step_in_epoch": position["batches"] // max(1, fp["grad_accum"]),
              "strategy": fp["strategy"], "run": None, "fingerprint": fp, "elastic": section(entries, fp["train_samples"])}
    parts = checkpoint.gather_parts(part, last.strategy.group)
    path = checkpoint.path_for(directory, step)
    verdict = None
    if rank0:
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            payload = {"format": checkpoint.FORMAT, "step": step, "shared": checkpoint.to_cpu(state) if replicated
                       else None, "ranks": parts}
            checkpoint.write_and_rotate(path, {**header, "world_size": len(parts)}, payload, keep=keep)
        except (DDTrainError, OSError) as exc:
            verdict = str(exc) if isinstance(exc, DDTrainError) else checkpoint.write_failure(path, exc)
    verdict = _agree(verdict, last.strategy.group)
    if verdict is not None:
        raise (DDTrainError if rank0 else PeerStopped)(f"save_state(): {verdict}")
    preemption = s.preemption
    if preemption is not None and preemption.stopped and (rank0 or runtime.local_rank() == 0):
        # a stop agreed: each node's launcher (ddtrain run) reads where the workers stopped and says it
        write_report(step, str(path), signal_name=preemption.signal_name,
                     signal_at=preemption.first[1] if preemption.first else None, rank=runtime.rank(), saved=True)
    return path


def _agree(verdict, group=None):
    """Rank 0's verdict on every rank."""
    if checkpoint._distributed():
        box = [verdict]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return verdict


# ---- loading --------------------------------------------------------------------------------

def load_state(directory=None) -> Resumed | None:
    """Collective: restore the newest whole state in ``directory`` into everything prepared; None when it has none.

    ``directory``: default ``prepare(checkpoint_dir=...)``'s, else ``ddtrain run --checkpoint-dir``'s
    (None when there is none either). Call it after ``prepare()`` and after creating the schedulers. A damaged file is named and
    the one before it loaded; a state of another model or run is refused, naming what differs.
    """
    entries = _live("load_state")
    if not (directory or _session.directory or job.checkpoint_dir()):
        _session.loaded = True
        return None     # no directory anywhere: nothing can have been saved (save_state would have refused)
    directory = _directory(directory, "load_state")
    s, rank0 = _session, runtime.rank() == 0
    s.loaded = True
    for e in entries:
        if e.loader is not None and e.loader.before_iteration is _deferred_load:
            e.loader.before_iteration = None
    fp = fingerprint(entries)
    now = section(entries, fp["train_samples"])
    damaged: list[str] = []

    def warn(message):
        damaged.append(message.split(" is damaged (", 1)[-1].rsplit("); trying", 1)[0])
        runtime.eprint(f"ddtrain: warning: {message}")

    files = checkpoint.listing(directory) if rank0 else []
    got = checkpoint.restore(
        directory, required=bool(files), warn=warn, check=lambda header: _check(header, fp, now),
        reshape=lambda header, parts, shared: _reshape(header, parts, shared, now, entries),
        missing=lambda: f"load_state(): every state file in {directory} is damaged, none loaded: " + "; ".join(
            f"{p.name} ({why})" for (_, p), why in zip(files, damaged)))
    if got is None:
        return None
    header, shared, part = got
    notes = _apply(entries, header, shared, part)
    position = (part["loaders"][0] if part["loaders"] else None) or {"epoch": 0, "batches": 0}
    for note in notes:
        runtime.print0(f"ddtrain: note: {note}")
    was = (header.get("elastic") or {}).get("workers", header.get("world_size", now["workers"]))
    runtime.print0(f"ddtrain: load_state: resumed from {header['path']} at step {header['step']} (epoch "
                   f"{position['epoch']}, {position['batches']} of its batches done)")
    if was != now["workers"]:
        runtime.print0(f"ddtrain: load_state: at another world size: {was} workers -> {now['workers']}, global batch "
                       f"{now['global_batch_size']} kept; "
                       f"{checkpoint_elastic.RULES.get(header['elastic']['rule'], header['elastic']['rule'])}")
    return Resumed(step=entries[-1].counter.steps, epoch=position["epoch"], path=header["path"], world_size_was=was)


def _check(header: dict, fp: dict, now: dict) -> None:
    """Rank 0: refuse a file that is no script state, or one of another model or run, or one this world cannot load."""
    path = header.get("path")
    if header.get("kind") != checkpoint.STATE_KIND:
        raise DDTrainError(f"load_state(): {path} is a checkpoint of ddtrain train, not a script's state "
                           "(ddtrain.save_state); give the script a directory of its own")
    theirs = header.get("elastic") or {}
    fields = FIELDS + (("world_size", "batch_size") if "fixed" in theirs or "fixed" in now else ())
    found = differences(fp, header.get("fingerprint") or {}, fields)
    if found:
        hint = "; create the LR schedulers before load_state" if any(f.startswith("schedulers") for f in found) else ""
        raise ConfigMismatch(f"load_state(): {path} was saved by another model or run: it has " + ", ".join(found)
                             + " (this script has the second value); load a state this script saved, or give it "
                             "another directory" + hint)
    was, here = theirs.get("workers"), now["workers"]
    if was != here and here not in theirs.get("worker_counts", []):
        raise ConfigMismatch(f"load_state(): {path} was saved by {was} workers and cannot load on {here}: its global "
                             f"batch of {theirs.get('global_batch_size')} divides among "
                             + ", ".join(map(str, theirs.get("worker_counts", []))) + " workers (x grad_accum "
                             f"{theirs.get('grad_accum', 1)})")


def _reshape(header: dict, parts: list, shared, now: dict, entries: list[Prepared]):
    """Rank 0: the saved per-rank parts made into this world's (None: the same world, each rank its own)."""
    theirs = header["elastic"]
    if theirs["workers"] == now["workers"] and len(parts) == now["workers"]:
        return None
    how = "average" if theirs.get("rule") == "average" else "rank0"
    merged = None
    if shared is None:   # per-rank replicas: one state by the strategy's rule
        merged = checkpoint_elastic.merged_state([{k: p[k] for k in ("entries", "objects")} for p in parts], how)
    compressors = [checkpoint_elastic.merged_compressor([(p["compressors"][i] or {}) for p in parts])
                   for i in range(len(parts[0]["compressors"]))]
    seed = next((e.seed for e in entries if e.loader is not None), entries[-1].seed)
    out = []
    for r in range(now["workers"]):
        if r < len(parts):
            part = {**parts[r]}
        else:
            rng = checkpoint_elastic.derived_rng(seed, header["step"], r, checkpoint.rng_state, checkpoint.set_rng_state)
            part = {**parts[0], "rng": rng, "rng_epoch": rng}
        part["compressors"] = compressors
        if merged is not None:
            part.update(merged)
        out.append((shared, part))
    return out


def _apply(entries: list[Prepared], header: dict, shared, part: dict) -> list[str]:
    """Every rank: load a state's parts into what is prepared; the notes to print."""
    state = shared if shared is not None else part
    path = header["path"]
    try:
        for e, saved in zip(entries, state["entries"]):
            e.model().load_state_dict(saved["model"])
            for optimizer, sd in zip(e.optimizers, saved["optimizers"]):
                optimizer.load_state_dict(sd)
            for scheduler, sd in zip(schedulers_of(e), saved["schedulers"]):
                scheduler.load_state_dict(sd)
            if e.scaler is not None and saved.get("scaler"):
                e.scaler.load_state_dict(saved["scaler"])
            e.counter.restore(int(saved["steps"]))
        for obj, sd in zip(_session.objects, state["objects"]):
            obj.load_state_dict(sd)
        notes = []
        for e, strategy_state, compressor_state in zip(entries, part["strategies"], part["compressors"]):
            e.strategy.load_state_dict(strategy_state or {})   # after the model: local-sgd re-anchors on it
            notes.append(e.strategy.load_compressor_state_dict(compressor_state or {}))
        checkpoint.set_rng_state(part["rng"])
        world_was = header.get("world_size")
        for e, position in zip(entries, part["loaders"]):
            if e.loader is not None and position is not None:
                _resume_loader(e.loader, position, part, world_was != e.loader.world_size)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        detail = "; ".join(lines[:3]) if lines else type(exc).__name__
        raise (DDTrainError if runtime.rank() == 0 else PeerStopped)(
            f"load_state(): {path} does not fit what this script prepared ({detail[:300]}); it was edited, or "
            "saved by another program") from None
    return [n for n in notes if n]


def _resume_loader(loader, position: dict, part: dict, resized: bool) -> None:
    batches = position["batches"]
    if resized and batches:   # the same samples at every size: the batches of this size that hold them
        per_step = loader.batch_size * loader.world_size
        if position["samples"] % per_step:
            raise ValueError(f"its loader stopped after {position['samples']} samples of epoch {position['epoch']}, "
                             f"not a whole number of this world's batches of {per_step}: save it after an "
                             "optimizer step")
        batches = position["samples"] // per_step
    in_epoch = bool(position.get("in_epoch")) and batches > 0
    loader.resume_at(position["epoch"], batches, part["rng_epoch"] if in_epoch else None,
                     part["rng"] if in_epoch else None)


def _deferred_load(loader, epoch: int) -> None:
    """Before each iteration of the training loader, in automatic mode, until the state is loaded.

    An unmodified script starts at its first epoch: the epochs the saved state had finished
    pass with no batches (their per-epoch code runs; what it changes of the saved things is
    replaced by the load), and the state is loaded when the epoch it was saved in begins.
    """
    s = _session
    if s.loaded:
        loader.before_iteration = None
        return
    if s.saved_epoch is None:
        s.saved_epoch = _saved_epoch(s.directory)
    if s.saved_epoch < 0:   # nothing saved yet: a fresh start
        s.loaded = True
        loader.before_iteration = None
        return
    if epoch < s.saved_epoch:
        loader.fast_forward_to = s.saved_epoch
        return
    load_state(s.directory)


def _saved_epoch(directory) -> int:
    """Collective: the epoch the newest whole state in ``directory`` was saved in (-1: none), rank 0's answer."""
    verdict = -1
    if runtime.rank() == 0 and Path(directory).is_dir():
        found = checkpoint.newest(directory)   # the file load_state will load (it names the damaged ones)
        if found is not None:
            verdict = int(found[1].get("epoch", 1)) - 1
        elif checkpoint.listing(directory):
            verdict = 0   # only damaged files: load_state says so at once
    return _agree(verdict)
