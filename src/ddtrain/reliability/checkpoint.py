"""Checkpoints: all a run needs to continue step for step, written atomically, read without running code.

One file per checkpoint, ``DIR/ckpt-00000120.pt`` for the state after 120 steps, holding every
rank's part: rank 0 gathers the parts (``gather_object``), alone writes and reads the files,
and on resume hands each rank its own part back (``scatter_object_list``). So the directory
only has to exist on rank 0's host, and a checkpoint is complete or absent, never half of
the ranks. A rank's part is its RNG states (torch CPU and CUDA, Python ``random``, numpy)
and its running epoch metrics; the model, optimizer and gradient-scaler states are stored
once when the strategy keeps replicas identical (ddp and the all-reduce strategies), else
once per rank; files are written atomically and verified when read (``write``).
``Checkpointer`` is the training loop's side (resume, when one is due, save).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError
from ddtrain.observe import files
from ddtrain.reliability import checkpoint_elastic, ownership, stall
from ddtrain.reliability.consistency import ConfigMismatch, PeerStopped

MAGIC = b"DDTRAIN-CHECKPOINT 1\n"
FORMAT = 1
NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class Damaged(Exception):
    """A checkpoint file that cannot be trusted; the message says why."""


def path_for(directory, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def listing(directory) -> list[tuple[int, Path]]:
    """(step, path) of every file named like a checkpoint, newest first (not yet verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), directory / name) for name in os.listdir(directory) if (m := NAME.match(name))]
    return sorted(found, reverse=True)


# ---- one file -------------------------------------------------------------------------------

def write(path, header: dict, payload: dict) -> Path:
    """Write ``payload`` (tensors and plain containers) under ``header``, atomically.

    File format: the line ``DDTRAIN-CHECKPOINT 1``, one line of JSON (step, epoch, step in the
    epoch, world size, the run's fingerprint, and the payload's byte length and SHA-256), then
    the payload as ``torch.save`` wrote it. A file that is shorter or longer than its header
    says, or whose bytes do not hash to it, is reported as damaged and skipped; the payload is
    read with ``torch.load(weights_only=True)``, so a checkpoint holds tensors and plain
    containers only and can never execute code. Files are written to a temporary name, flushed
    to disk, then renamed: a crash mid-write leaves the previous checkpoints as they were.
    """
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = {**header, "format": FORMAT, "payload_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    header = json.loads(json.dumps(header, sort_keys=True, default=str))  # as it will read back
    header["header_sha256"] = header_checksum(header)
    line = json.dumps(header, sort_keys=True).encode() + b"\n"

    def _write(tmp):
        with open(tmp, "wb") as f:
            f.write(MAGIC + line)
            f.write(data)
    return files.atomic_write(path, _write)


def header_checksum(header: dict) -> str:
    """SHA-256 of the header without this checksum: a header edited by hand no longer matches."""
    rest = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


# header fields a training checkpoint has, and what each must be (checked when present)
_FIELDS = {"step": (0, "a non-negative integer"), "epoch": (1, "a positive integer"),
           "step_in_epoch": (0, "a non-negative integer"), "world_size": (1, "a positive integer"),
           "payload_bytes": (0, "a non-negative integer")}


def _check_fields(header: dict) -> None:
    for name, (least, what) in _FIELDS.items():
        value = header.get(name, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise Damaged(f"its header field {name!r} is {json.dumps(value)}, not {what}")
    for name, kind, what in (("fingerprint", dict, "an object"), ("sha256", str, "a hex string"),
                             ("run", dict, "an object")):
        if name in header and not isinstance(header[name], kind) and not (name == "run" and header[name] is None):
            raise Damaged(f"its header field {name!r} is {json.dumps(header[name])[:60]}, not {what}")


def read_header(path) -> tuple[dict, int]:
    """The header and the payload's offset; raises Damaged if the file is not whole or was edited."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
            line = f.readline(1 << 20)
            offset = f.tell()
        size = os.path.getsize(path)
    except OSError as exc:
        raise Damaged(f"unreadable: {exc.strerror or exc}") from None
    if magic != MAGIC:
        raise Damaged("not a ddtrain checkpoint (bad magic line)" if size >= len(MAGIC) else f"truncated: {size} bytes")
    if not line.endswith(b"\n"):
        raise Damaged(f"truncated inside its header: {size} bytes")
    try:
        header = json.loads(line)
    except ValueError as exc:  # UnicodeDecodeError too
        raise Damaged(f"its header line is not valid JSON ({getattr(exc, 'msg', exc)}, at character "
                      f"{getattr(exc, 'pos', '?')}): edited by hand or corrupted") from None
    if not isinstance(header, dict) or "payload_bytes" not in header or "sha256" not in header:
        raise Damaged("its header has no payload length and checksum: not a whole ddtrain checkpoint header")
    if "header_sha256" in header and header["header_sha256"] != header_checksum(header):
        raise Damaged("its header was changed after writing (header checksum mismatch): checkpoints cannot be "
                      "edited by hand; resume from the file as written, or start afresh")
    _check_fields(header)
    expected = offset + header["payload_bytes"]
    if size != expected:
        raise Damaged(f"{'truncated' if size < expected else 'too long'}: {size} of {expected} bytes")
    return header, offset


def read(path) -> tuple[dict, dict]:
    """(header, payload) of a whole, uncorrupted checkpoint; raises Damaged otherwise."""
    header, offset = read_header(path)
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    if len(data) != header["payload_bytes"]:
        raise Damaged(f"truncated while reading: {offset + len(data)} of {offset + header['payload_bytes']} bytes")
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise Damaged("checksum mismatch (the bytes changed after writing)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain containers
        raise Damaged(f"refused by torch.load(weights_only=True): {_refusal(exc)}") from None
    return header, payload


def _refusal(exc: BaseException) -> str:
    """The one sentence of torch.load's refusal that says what was refused (not its advice to turn checks off)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "GLOBAL" in line or "Unpickler error" in line or "Unsupported" in line:
            return line.split("Unpickler error: ", 1)[-1] + " (a checkpoint holds tensors and plain values only)"
    first = lines[0] if lines else type(exc).__name__
    return first if len(first) <= 160 else first[:first.rfind(" ", 0, 160)] + " ..."


def newest(directory, *, warn=None, quarantine: bool = False):
    """(path, header, payload) of the newest whole checkpoint in ``directory``, or None.

    Damaged files are skipped with a warning naming them (``warn(message)``); with
    ``quarantine`` they are renamed to ``*.damaged`` so that later rotation never mistakes
    them for the newest.
    """
    skipped = []
    for _, path in listing(directory):
        try:
            header, payload = read(path)
        except Damaged as exc:
            skipped.append(path)
            if warn:
                warn(f"checkpoint {path} is damaged ({exc}); trying the previous one")
            continue
        if quarantine:
            for bad in skipped:
                os.replace(bad, bad.with_name(bad.name + ".damaged"))
        return path, header, payload
    return None


def rotate(directory, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints and any temporary files of crashed writes."""
    removed = []
    for _, path in listing(directory)[keep:]:
        path.unlink(missing_ok=True)
        removed.append(path)
    for name in os.listdir(directory):
        if name.startswith(".ckpt-") and name.endswith(".tmp"):
            (Path(directory) / name).unlink(missing_ok=True)
    return removed


def check_dir(config, fingerprint: dict) -> None:
    """Before any worker starts: --checkpoint-dir usable and ours alone, and --resume has something of ours that fits.

    The launching process takes the directory's lock here and holds it until it exits (the
    workers it starts belong to the same run); a directory another run holds is refused.
    """
    directory = config.reliability.checkpoint_dir
    if not directory:
        return
    if Path(directory).exists() and not Path(directory).is_dir():
        raise DDTrainError(f"--checkpoint-dir '{directory}' is a file, not a directory")
    files.check_writable(Path(directory) / "ckpt", "--checkpoint-dir")
    ownership.check_free(directory)  # a running run's directory: say so before anything else
    found = listing(directory)
    if not config.reliability.resume:
        if found:
            raise DDTrainError(f"--checkpoint-dir {directory} already holds checkpoints (newest: {found[0][1].name}); "
                               "pass --resume to continue from it, or choose an empty directory")
        _take(directory)
        ownership.start_lineage(directory)
        return
    if not found:
        raise DDTrainError(f"--resume: no checkpoint in {directory}")
    damaged = []
    for _, path in found:  # the cheap test (header and length) here; rank 0 verifies the checksum
        try:
            header, _ = read_header(path)
        except Damaged as exc:
            damaged.append(f"{path.name} ({exc})")
            continue
        now = checkpoint_elastic.section(config, workers=fingerprint["world_size"], servers=0,
                                         train_samples=fingerprint["train_samples"], resize_rule=None)
        checkpoint_elastic.check(header, fingerprint, now, path)  # another worker count only where it can
        _take(directory)
        ownership.ensure_lineage(directory)
        theirs = ownership.check_lineage(header, directory, path, resume_any=config.reliability.resume_any)
        if theirs:
            ownership.start_lineage(directory, theirs, origin=header.get("run"))
            print(f"ddtrain: note: --resume-any: continuing from {path}, written by run "
                  f"{header['run'].get('run_id', '?')}; this directory now follows its lineage {theirs}",
                  file=sys.stderr, flush=True)
        return
    raise DDTrainError(f"--resume: every checkpoint in {directory} is damaged: {'; '.join(damaged)}")


def _take(directory) -> None:
    """The launching process holds the directory until it exits (its workers are the same run)."""
    previous = ownership.claim(directory, "launcher")
    import atexit
    atexit.register(ownership.release, directory, "launcher")
    if previous:
        print(f"ddtrain: note: --checkpoint-dir {directory} was held by {ownership.describe(previous)}, which ended "
              "without releasing it; this run takes it over", file=sys.stderr, flush=True)


# ---- what a rank contributes ----------------------------------------------------------------

def rng_state() -> dict:
    """This process's random number generators, as tensors and plain values."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def to_cpu(value):
    """A copy of nested state with every tensor on the CPU (what travels and what is saved)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


# ---- collectives: every rank calls these at the same step -----------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save(directory, step: int, header: dict, part: dict, shared: dict | None, *, keep: int,
         group=None) -> Path | None:
    """Gather every rank's ``part`` to rank 0, which writes them with ``shared`` and rotates.

    ``shared`` (model, optimizer, scaler states) is only read on rank 0. ``group``: the ranks
    that train (the workers; parameter servers are serving and keep no part of their own).
    """
    part = to_cpu(part)
    rank = dist.get_rank() if _distributed() else 0
    if _distributed():
        parts = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=group)
    else:
        parts = [part]
    if rank != 0:
        return None
    payload = {"format": FORMAT, "step": step, "shared": to_cpu(shared), "ranks": parts}
    path = write(path_for(directory, step), {**header, "world_size": len(parts)}, payload)
    rotate(directory, keep)
    return path


def check_payload(payload, header: dict, path) -> None:
    """Raise DDTrainError naming the file when a readable payload is not what ``save`` writes."""
    def bad(what):
        return DDTrainError(f"checkpoint {path} cannot be resumed from: {what} (it was not written by ddtrain's "
                            "training loop, or was edited); remove it or resume from another")
    if not isinstance(payload, dict) or not isinstance(payload.get("ranks"), list):
        raise bad("its payload has no list of per-rank parts ('ranks')")
    ranks = payload["ranks"]
    if len(ranks) != header.get("world_size", len(ranks)):
        raise bad(f"its payload has {len(ranks)} per-rank parts but its header says world_size={header['world_size']}")
    for r, part in enumerate(ranks):
        if not isinstance(part, dict) or not {"rng", "rng_epoch", "meter"} <= part.keys():
            raise bad(f"rank {r}'s part lacks its RNG states or metric sums")
    state = payload.get("shared") if payload.get("shared") is not None else (ranks[0] if ranks else {})
    if not (isinstance(state, dict) and isinstance(state.get("model"), dict) and isinstance(state.get("optimizer"), dict)):
        raise bad("it holds no model and optimizer state")


def restore(directory, *, required: bool, warn, check=None, reshape=None):
    """Every rank's part of the newest whole checkpoint: (header, shared, my part), or None if none.

    Rank 0 finds and verifies the file (``check(header)`` may raise DDTrainError for an
    incompatible one) and sends each rank its part; every rank raises the same error. A
    checkpoint of another world size has its parts made into this one's by
    ``reshape(header, parts, shared)`` (``checkpoint_elastic.reshape``; None: no need).
    """
    rank = dist.get_rank() if _distributed() else 0
    verdict, parts = None, None
    if rank == 0:
        try:
            found = newest(directory, warn=warn, quarantine=True) if Path(directory).is_dir() else None
            if found is None and required:
                raise DDTrainError(f"resume (--resume): no whole checkpoint in {directory}")
            if found is not None:
                path, header, payload = found
                if check:
                    check({**header, "path": str(path)})
                check_payload(payload, header, path)
                ranks = payload["ranks"]
                verdict = {"path": str(path), "header": header}
                parts = reshape(header, ranks, payload["shared"]) if reshape is not None else None
                if parts is None:   # written by this world size: each rank its own part
                    parts = [(payload["shared"], part) for part in ranks]
        except DDTrainError as exc:
            verdict = {"error": str(exc)}
    if _distributed():
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    if verdict is not None and "error" in verdict:
        raise DDTrainError(verdict["error"])
    if verdict is None:
        return None
    if _distributed():
        mine = [None]
        dist.scatter_object_list(mine, parts if rank == 0 else None, src=0)
        shared, part = mine[0]
    else:
        shared, part = parts[0]
    return {**verdict["header"], "path": verdict["path"]}, shared, part


# ---- the training loop's checkpoints --------------------------------------------------------

class Checkpointer:
    """Resume (``resume``, or a restart by torchrun), ``due(step, end_of_epoch)`` and ``save(step, steps_done)``.

    Resuming is step-for-step exact: the checkpoint holds the state after step S together with
    the RNG states at the start of S's epoch and after S. On resume the loop re-enters that
    epoch (``enter_epoch`` says how many of its steps were trained and how long they took), sets
    the epoch-start RNG state, draws and discards the batches already trained (``batches``: so a
    DataLoader's worker seeds come out as before), sets the after-S state, and goes on.
    """

    def __init__(self, options, *, strategy, strategy_name: str, optimizer, scaler, fingerprint: dict, record: dict,
                 info: dict, max_steps: int, epochs: int, elastic: dict | None = None, seed: int = 0,
                 schedule: dict | None = None, schedule_change=None):
        self.directory, self.every, self.keep, self.resume_asked = (options.checkpoint_dir, options.checkpoint_every,
                                                                    options.keep, options.resume)
        self.strategy, self.module, self.optimizer, self.scaler = strategy, strategy.module, optimizer, scaler
        self.strategy_name = strategy_name
        self.fingerprint, self.record, self.info = fingerprint, record, info
        self.max_steps, self.epochs = max_steps, epochs
        self.step, self.epoch = 0, 1            # where the loop starts
        self._skip, self._part = 0, None        # steps of self.epoch already trained, and this rank's part
        self._meter, self._epoch_now, self._rng_epoch, self._epoch_t0 = None, 1, None, time.perf_counter()
        self.resume_any, self._final = getattr(options, "resume_any", False), False
        self.elastic, self.seed = elastic, seed  # this run's checkpoint_elastic.section (None: fixed size only)
        # the lr schedule (the loop's ``recipe.schedule_record``), kept in every header, and
        # ``schedule_change(saved record, updates)``: how resuming a checkpoint would change it (None: it would not)
        self.schedule, self.schedule_change = schedule, schedule_change
        self.allow_schedule_change = getattr(options, "resume_schedule_change", False)

    def claim(self) -> None:
        """Collective: rank 0 takes the directory's lock (refused, on every rank, if another run holds it)."""
        verdict = None
        if runtime.rank() == 0:
            try:
                previous = ownership.claim(self.directory, "rank0")
                if previous:
                    runtime.eprint(f"ddtrain: note: --checkpoint-dir {self.directory} was held by "
                                   f"{ownership.describe(previous)}, which ended without releasing it; taken over")
                ownership.ensure_lineage(self.directory)
            except (DDTrainError, OSError) as exc:
                verdict = str(exc) if isinstance(exc, DDTrainError) else \
                    f"--checkpoint-dir {self.directory}: cannot take its lock ({exc.strerror or exc})"
        if _distributed():
            box = [verdict]
            dist.broadcast_object_list(box, src=0)
            verdict = box[0]
        if verdict is not None:
            raise (DDTrainError if runtime.rank() == 0 else PeerStopped)(verdict)

    def _check(self, header: dict) -> None:
        checkpoint_elastic.check(header, self.fingerprint, self.elastic, header.get("path", self.directory))
        change = self._schedule_changed(header)
        if change and not self.allow_schedule_change:
            raise ConfigMismatch(
                f"checkpoint {header.get('path', self.directory)} was trained on another learning-rate schedule than "
                f"this run's: {change}; resumed, the run would follow neither schedule (an uninterrupted run with "
                "these settings trains another one). Resume with the checkpoint's settings, or pass "
                "--resume-schedule-change (resume_schedule_change=True) to continue on this run's schedule")
        theirs = ownership.check_lineage(header, self.directory, header.get("path", self.directory),
                                         resume_any=self.resume_any)
        if theirs:
            ownership.start_lineage(self.directory, theirs, origin=header.get("run"))

    def _schedule_changed(self, header: dict) -> str | None:
        saved = header.get("schedule")
        if self.schedule_change is None or self.schedule is None or not isinstance(saved, dict):
            return None   # a checkpoint written before schedules were recorded: nothing to compare
        return self.schedule_change(saved, self.schedule, header["step"])

    def resume(self) -> None:
        """Take the directory; load the newest whole checkpoint when ``resume`` is set or torchrun restarted us."""
        self.claim()
        attempt = self.info["attempt"]
        if not (self.resume_asked or attempt > 0):
            return
        got = restore(self.directory, required=self.resume_asked,
                      warn=lambda message: runtime.eprint(f"ddtrain: warning: {message}"),
                      check=self._check, reshape=self._reshape)
        if got is None:
            runtime.print0(f"restart {attempt}: no checkpoint in {self.directory} yet, starting from step 0")
            return
        header, shared, part = got
        state = shared if shared is not None else part
        try:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.strategy.load_state_dict(part.get("strategy") or {})   # after the model: local-sgd re-anchors on it
            set_rng_state(part["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            detail = "; ".join(lines[:3]) if lines else type(exc).__name__
            raise (DDTrainError if runtime.rank() == 0 else PeerStopped)(  # one message, from rank 0
                f"checkpoint {header['path']} cannot be resumed from: its state does not fit this model and "
                f"optimizer ({detail[:300]}); it was edited, or written by another program") from None
        self.step, self.epoch, self._skip = header["step"], header["epoch"], header["step_in_epoch"]
        self._part = part
        self.record["epochs"] = list(header.get("epochs_done", []))
        self.info["resumed_from"] = {"path": header["path"], "step": self.step, "epoch": self.epoch,
                                     "step_in_epoch": self._skip}
        why = f"restart {attempt}" if attempt else "--resume"
        runtime.print0(f"{why}: resumed from {header['path']} at step {self.step} "
                       f"(epoch {self.epoch}, {self._skip} of its steps done)")
        change = self._schedule_changed(header)
        if change:   # allowed by resume_schedule_change, or _check had refused it
            self.info["resumed_from"]["schedule_changed"] = change
            runtime.print0(f"note: --resume-schedule-change: the learning-rate schedule changes at update {self.step} "
                           f"({change})")
        theirs = header.get("elastic") or {}
        if self.elastic and theirs.get("workers", self.elastic["workers"]) != self.elastic["workers"]:
            self.info["resumed_from"]["workers_was"] = theirs["workers"]
            runtime.print0(f"resume at another world size: {theirs['workers']} workers (--grad-accum "
                           f"{theirs['grad_accum']}) -> {self.elastic['workers']} (--grad-accum "
                           f"{self.elastic['grad_accum']}), global batch {theirs['global_batch_size']} kept; "
                           f"{checkpoint_elastic.RULES.get(theirs['rule'], theirs['rule'])}")

    def _reshape(self, header: dict, parts: list, shared) -> list:
        """Rank 0: the checkpoint's per-rank parts made into this world's, or None when they are this world's already.

        Same worker count and one part per rank: each rank its own part (bit for bit). Otherwise
        (other worker count, or parameter servers, which keep no part) ``checkpoint_elastic.reshape``.
        """
        theirs = header.get("elastic")
        world = dist.get_world_size() if _distributed() else 1
        if len(parts) == world and (theirs or {}).get("workers", world) == (self.elastic or {}).get("workers", world):
            return None
        if not (theirs and self.elastic):
            raise DDTrainError(f"checkpoint {header.get('path')} has {len(parts)} per-rank parts and no elastic "
                               "section: it resumes only at its own world size")
        return checkpoint_elastic.reshape(parts, shared, elastic=theirs, workers=self.elastic["workers"],
                                          seed=self.seed, step=header["step"], capture=rng_state,
                                          apply=set_rng_state)

    def enter_epoch(self, epoch: int, meter) -> tuple[int, float]:
        """(steps of ``epoch`` already trained, the seconds they took): non-zero only in a resumed epoch."""
        done, took = 0, 0.0
        if epoch == self.epoch and self._skip and self._part is not None:
            done, took = self._skip, float(self._part.get("epoch_time_s", 0.0))
            meter.sums.copy_(self._part["meter"].to(meter.sums.device))
        self._epoch_t0 = time.perf_counter() - took
        self._meter, self._epoch_now = meter, epoch
        self._rng_epoch = rng_state()
        return done, took

    def batches(self, loader, skip: int):
        """The loader's batches of this epoch, without the ``skip`` ones the resumed checkpoint already trained."""
        it = iter(loader)
        part, self._part, self._skip = self._part, None, 0
        set_rng_state(part["rng_epoch"])
        self._rng_epoch = part["rng_epoch"]
        for _ in range(skip):
            next(it, None)
        set_rng_state(part["rng"])
        return it

    def due(self, step: int, end_of_epoch: bool) -> bool:
        """The same steps on every rank: every ``checkpoint_every`` steps (else each epoch's end) and the last."""
        self._final = bool(self.max_steps and step >= self.max_steps) or (end_of_epoch and self._epoch_now >= self.epochs)
        if self.every and step % self.every == 0 or not self.every and end_of_epoch:
            return True
        return self._final

    def save(self, step: int, steps_done: int) -> None:
        """Collective: the state after ``step`` (``steps_done`` of them in this epoch), written by rank 0."""
        stall.mark(step, "checkpoint (gather to rank 0)")
        # one global state: replicas kept identical, or the parameter servers' (rank 0 fetches the
        # optimizer state from them: ``optimizer.state_dict()`` of a ps worker asks the servers)
        replicated = self.strategy.spec.replicated or bool(self.elastic and self.elastic.get("rule") == "servers")
        state = None
        if not replicated or runtime.rank() == 0:
            state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        part = {"rng": rng_state(), "rng_epoch": self._rng_epoch, "meter": self._meter.sums,
                "epoch_time_s": time.perf_counter() - self._epoch_t0, "strategy": self.strategy.state_dict()}
        if not replicated:
            part.update(state)
        header = {"step": step, "epoch": self._epoch_now, "step_in_epoch": steps_done,
                  "strategy": self.strategy_name, "run": ownership.tag(self.directory) if runtime.rank() == 0 else None,
                  "fingerprint": self.fingerprint, "epochs_done": self.record["epochs"]}
        if self.schedule is not None:
            header["schedule"] = self.schedule
        if self.elastic:
            header["elastic"] = self.elastic
        path = save(self.directory, step, header, part, state if replicated and runtime.rank() == 0 else None,
                    keep=self.keep, group=self.strategy.group)
        self.info["checkpoints_written"] += 1
        if path is not None:
            self.info["last_checkpoint"] = str(path)
        if self._final and runtime.rank() == 0:  # nothing more goes into the directory: let the next run in
            ownership.release(self.directory, "rank0")
