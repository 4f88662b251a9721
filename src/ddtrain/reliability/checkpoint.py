"""Checkpoints: all a run needs to continue step for step, written atomically, read without running code.

One file per checkpoint, ``DIR/ckpt-00000120.pt`` for the state after 120 steps, holding every
rank's part: rank 0 gathers the parts (``gather_object``), alone writes and reads the files,
and on resume hands each rank its own part back (``scatter_object_list``). So the directory
only has to exist on rank 0's host, and a checkpoint is complete or absent, never half of
the ranks. A rank's part is its RNG states (torch CPU and CUDA, Python ``random``, numpy),
its running epoch metrics and its gradient compressor's state (error feedback, PowerSGD's Q,
DDP's buckets); the model, optimizer and gradient-scaler states are stored once when the
strategy keeps replicas identical (ddp and the all-reduce strategies), else once per rank;
the run's per-epoch history is in the payload, so that the header stays small however many
epochs a run has (issue 32). Files are written atomically and verified when read (``write``);
a file that is not a regular file (a FIFO, a folder) is damaged, never opened in a way that
blocks, and one that a rotation removed while it was read is ``Vanished``, not damaged.
``Checkpointer`` is the training loop's side (resume, when one is due, save). A save blocks
training only while the state is gathered and copied to host memory (a snapshot); rank 0
serialises, writes, flushes and renames the file on a thread of its own (``Writer``), one
write at a time, unless ``checkpoint_sync`` asks for all of it on the training thread.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import random
import re
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.distributed.job import requeue_count
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.observe import files
from ddtrain.reliability import checkpoint_elastic, ownership, regular_files, stall
from ddtrain.reliability.consistency import ConfigMismatch, PeerStopped

MAGIC = b"DDTRAIN-CHECKPOINT 1\n"
# 1: the header's checksum (header_sha256) was optional (files written before it have none) and the
# per-epoch history was in the header; 2: header_sha256 is required, the history is in the payload.
FORMAT = 2
# the longest header line ddtrain writes and reads (issue 32: the writer wrote headers the reader refused)
HEADER_LIMIT = 16 << 20
NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")


class Damaged(Exception):
    """A checkpoint file that cannot be trusted; the message says why."""


class Vanished(Exception):
    """A checkpoint file that was listed and is gone when opened (a rotation removed it): not damaged."""


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
    if len(line) > HEADER_LIMIT:   # never write what the reader refuses (the same limit)
        raise DDTrainError(f"checkpoint {path} was not written: its header would be {len(line):,} bytes, more than "
                           f"the {HEADER_LIMIT:,} a checkpoint header may have (largest fields: "
                           f"{', '.join(_largest_fields(header))}); keep large values in the payload")

    def _write(tmp):
        with open(tmp, "wb") as f:
            f.write(MAGIC + line)
            f.write(data)
    return files.atomic_write(path, _write)


def _largest_fields(header: dict) -> list[str]:
    sizes = sorted(((len(json.dumps(v)), k) for k, v in header.items()), reverse=True)[:3]
    return [f"{k} ({n:,} bytes)" for n, k in sizes]


def header_checksum(header: dict) -> str:
    """SHA-256 of the header without this checksum: a header edited by hand no longer matches."""
    rest = {k: v for k, v in header.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


# header fields a checkpoint has, and what each must be (checked when present): integers with their least value,
# then the types of the others; the sections' own fields below them. A header of other types is damaged (issue 32:
# a header with a field of the wrong type was a traceback further on, in the resume).
_FIELDS = {"step": (0, "a non-negative integer"), "epoch": (1, "a positive integer"),
           "step_in_epoch": (0, "a non-negative integer"), "world_size": (1, "a positive integer"),
           "payload_bytes": (0, "a non-negative integer"), "format": (1, "a positive integer")}
_KINDS = {"fingerprint": (dict, "an object"), "sha256": (str, "a hex string"), "header_sha256": (str, "a hex string"),
          "run": ((dict, type(None)), "an object"), "strategy": (str, "a string"), "kind": (str, "a string"),
          "schedule": (dict, "an object"), "elastic": (dict, "an object"), "epochs_done": (list, "a list")}


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


_COUNT = (_count, "a non-negative integer")
_COUNT_OR_NONE = (lambda v: v is None or _count(v), "a non-negative integer or null")
_TEXT = (lambda v: isinstance(v, str), "a string")
_TEXT_OR_NONE = (lambda v: v is None or isinstance(v, str), "a string or null")
_SECTIONS = {   # section -> {field: (test, what it must be)}; fields are optional (older versions wrote fewer)
    "elastic": {"workers": _COUNT, "servers": _COUNT, "grad_accum": _COUNT_OR_NONE, "global_batch_size": _COUNT_OR_NONE,
                "rule": _TEXT_OR_NONE, "data": _TEXT, "data_args": _TEXT, "sharding": _TEXT, "fixed": _TEXT,
                "worker_counts": (lambda v: isinstance(v, list) and all(_count(n) for n in v),
                                  "a list of non-negative integers")},
    "run": {"lineage": _TEXT_OR_NONE, "run_id": _TEXT_OR_NONE, "host": _TEXT_OR_NONE, "pid": _COUNT_OR_NONE},
    "fingerprint": {"parameter_shapes": (lambda v: isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and isinstance(p[1], list) for p in v),
        "a list of [name, shape, dtype] entries")},
}


def _shown(value) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(header: dict) -> None:
    for name, (least, what) in _FIELDS.items():
        value = header.get(name, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise Damaged(f"its header field {name!r} is {_shown(value)}, not {what}")
    for name, (kind, what) in _KINDS.items():
        if name in header and not isinstance(header[name], kind):
            raise Damaged(f"its header field {name!r} is {_shown(header[name])}, not {what}")
    for section, fields in _SECTIONS.items():
        values = header.get(section) or {}
        for name, (test, what) in fields.items():
            if name in values and not test(values[name]):
                raise Damaged(f"its header field {section}.{name} is {_shown(values[name])}, not {what}")
    if not all(isinstance(e, dict) for e in header.get("epochs_done", [])):
        raise Damaged("its header field 'epochs_done' is not a list of objects (one per epoch)")
    if header.get("format", 1) > FORMAT:
        raise Damaged(f"written by a newer ddtrain (checkpoint format {header['format']}; this one reads formats 1 "
                      f"to {FORMAT}): resume it with that version")


def _open(path):
    """``path`` opened for reading if it is a regular file (never blocking on a FIFO)."""
    try:
        return os.fdopen(regular_files.open_regular(path), "rb")
    except regular_files.NotRegular as exc:
        raise Damaged(f"not a checkpoint: it {exc}") from None
    except FileNotFoundError:
        raise Vanished("gone: it was removed while being read (a run writing this directory rotated it away)") from None
    except OSError as exc:
        raise Damaged(f"unreadable: {exc.strerror or exc}") from None


def _parse_header(f) -> tuple[dict, int]:
    """The header of the open checkpoint ``f`` and the payload's offset (where ``f`` is left); see ``read_header``."""
    size = os.fstat(f.fileno()).st_size
    magic = f.read(len(MAGIC))
    line = f.readline(HEADER_LIMIT + 1)
    offset = f.tell()
    if magic != MAGIC:
        raise Damaged("not a ddtrain checkpoint (bad magic line)" if size >= len(MAGIC) else f"truncated: {size} bytes")
    if not line.endswith(b"\n"):
        if len(line) > HEADER_LIMIT:
            raise Damaged(f"its header line is longer than {HEADER_LIMIT:,} bytes, the most a checkpoint header may "
                          "have: not a ddtrain checkpoint header")
        raise Damaged(f"truncated inside its header: {size} bytes")
    try:
        header = json.loads(line)
    except RecursionError:
        raise Damaged("its header line is JSON nested too deeply to be a checkpoint header (no ddtrain writes "
                      "one): edited or not a ddtrain checkpoint") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise Damaged(f"its header line is not valid JSON ({getattr(exc, 'msg', exc)}, at character "
                      f"{getattr(exc, 'pos', '?')}): edited by hand or corrupted") from None
    if not isinstance(header, dict) or "payload_bytes" not in header or "sha256" not in header:
        raise Damaged("its header has no payload length and checksum: not a whole ddtrain checkpoint header")
    if "header_sha256" in header:
        try:
            same = header["header_sha256"] == header_checksum(header)
        except (ValueError, RecursionError):
            same = False
        if not same:
            raise Damaged("its header was changed after writing (header checksum mismatch): checkpoints cannot be "
                          "edited by hand; resume from the file as written, or start afresh")
    _check_fields(header)
    if "header_sha256" not in header and header.get("format", 1) >= 2:
        raise Damaged("its header has no checksum (header_sha256), which every checkpoint of its format has: the "
                      "field was deleted, so the header cannot be trusted (edited by hand?); resume from a "
                      "checkpoint as written, or start afresh")
    expected = offset + header["payload_bytes"]
    if size != expected:
        raise Damaged(f"{'truncated' if size < expected else 'too long'}: {size} of {expected} bytes")
    return header, offset


def verified(header: dict) -> bool:
    """The header carries its checksum (format 1 files written before header checksums do not: unverified)."""
    return "header_sha256" in header


def read_header(path) -> tuple[dict, int]:
    """The header and the payload's offset; raises Damaged if the file is not whole or was edited.

    Raises Vanished when the file is gone (listed, then removed by a rotation before it was opened).
    """
    with _open(path) as f:
        try:
            return _parse_header(f)
        except OSError as exc:
            raise Damaged(f"unreadable: {exc.strerror or exc}") from None


def read(path) -> tuple[dict, dict]:
    """(header, payload) of a whole, uncorrupted checkpoint; raises Damaged otherwise (Vanished: gone, not damaged).

    Header and payload are read through one descriptor: a rotation that removes the file once it
    is open changes nothing of what is read.
    """
    with _open(path) as f:
        try:
            header, offset = _parse_header(f)
            data = f.read(header["payload_bytes"] + 1)
        except OSError as exc:
            raise Damaged(f"unreadable: {exc.strerror or exc}") from None
    if len(data) != header["payload_bytes"]:
        raise Damaged(f"truncated while reading: {offset + len(data)} of {offset + header['payload_bytes']} bytes")
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise Damaged("checksum mismatch (the bytes changed after writing)")
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain containers
        raise Damaged(f"refused by torch.load(weights_only=True): {_refusal(exc)}") from None
    if not verified(header) and isinstance(payload, dict) and payload.get("step", header.get("step")) != header.get("step"):
        # a format-1 header without its checksum: the payload (under its SHA-256) still says where it was written
        raise Damaged(f"its header says step {header.get('step')} but its payload holds the state after step "
                      f"{_shown(payload.get('step'))}, and the header has no checksum (header_sha256): the header was "
                      "edited by hand; resume from a checkpoint as written, or start afresh")
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
        except Vanished:   # rotated away since the listing: neither whole nor damaged
            continue
        except Damaged as exc:
            skipped.append(path)
            if warn:
                warn(f"checkpoint {path} is damaged ({exc}); trying the previous one")
            continue
        if quarantine:
            for bad in skipped:
                try:
                    os.replace(bad, bad.with_name(bad.name + ".damaged"))
                except FileNotFoundError:
                    pass
        if not verified(header) and warn:
            warn(f"checkpoint {path} has no header checksum (a format-1 file written before header checksums); "
                 "its step agrees with its payload's, its payload is verified")
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
    """Before any worker starts: checkpoint_dir usable and ours alone, and resume has something of ours that fits.

    The launching process takes the directory's lock here and holds it until it exits (the
    workers it starts belong to the same run); a directory another run holds is refused.
    """
    directory = config.reliability.checkpoint_dir
    if not directory:
        return
    if Path(directory).exists() and not Path(directory).is_dir():
        raise ConfigError("checkpoint_dir", f"'{directory}' is a file, not a directory")
    files.check_writable(Path(directory) / "ckpt", "checkpoint_dir")
    nodes = config.dist.max_nodes
    ownership.check_free(directory, nodes=nodes)  # a running run's directory: say so before anything else
    found = listing(directory)
    if not config.reliability.resume:
        if found:
            raise ConfigError("checkpoint_dir", f"{directory} already holds checkpoints (newest: {found[0][1].name}); "
                              "pass resume to continue from it, or choose an empty directory", mentions=("resume",))
        _take(directory, nodes)
        ownership.start_lineage(directory)
        return
    if not found:
        raise ConfigError("resume", f"finds no checkpoint in {directory}")
    damaged = []
    for _, path in found:  # the cheap test (header and length) here; rank 0 verifies the checksum
        try:
            header, _ = read_header(path)
        except Vanished:
            continue
        except Damaged as exc:
            damaged.append(f"{path.name} ({exc})")
            continue
        now = checkpoint_elastic.section(config, workers=fingerprint["world_size"], servers=0,
                                         train_samples=fingerprint["train_samples"], resize_rule=None)
        checkpoint_elastic.check(header, fingerprint, now, path)  # another worker count only where it can
        _take(directory, nodes)
        ownership.ensure_lineage(directory)
        theirs = ownership.check_lineage(header, directory, path, resume_any=config.reliability.resume_any)
        if theirs:
            ownership.start_lineage(directory, theirs, origin=header.get("run"))
            print(f"ddtrain: note: --resume-any: continuing from {path}, written by run "
                  f"{header['run'].get('run_id', '?')}; this directory now follows its lineage {theirs}",
                  file=sys.stderr, flush=True)
        return
    raise ConfigError("resume", f"finds every checkpoint in {directory} damaged: {'; '.join(damaged)}")


def _take(directory, nodes: int = 1) -> None:
    """The launching process holds the directory until it exits (its workers are the same run)."""
    previous = ownership.claim(directory, "launcher", nodes=nodes)
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
    """A copy of nested state with every tensor on the CPU (what travels and what is saved): one copy per tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


# ---- collectives: every rank calls these at the same step -----------------------------------

def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_parts(part: dict, group=None) -> list | None:
    """Collective: every rank's ``part`` (copied to host memory) on rank 0, None on the others.

    ``group``: the ranks that train (the workers; parameter servers keep no part of their own).
    """
    part = to_cpu(part)
    if not _distributed():
        return [part]
    rank = dist.get_rank()
    parts = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(part, parts, dst=0, group=group)
    return parts if rank == 0 else None


def write_and_rotate(path, header: dict, payload: dict, *, keep: int) -> Path:
    """Rank 0: write one checkpoint file, then delete all but the ``keep`` newest; a failure is one DDTrainError.

    The error names the file, what the disk said and the checkpoints already there, which are
    whole: ``write`` is atomic, and rotation runs only after the new file is complete.
    """
    try:
        path = write(path, header, payload)
    except OSError as exc:
        raise DDTrainError(write_failure(path, exc)) from None
    rotate(path.parent, keep)
    return path


def write_failure(path, exc: BaseException) -> str:
    """One line for a checkpoint file that could not be written (a full disk, a lost mount)."""
    path = Path(path)
    why = f"{exc.strerror} [errno {exc.errno}]" if isinstance(exc, OSError) and exc.strerror else str(exc)
    kept = [p.name for _, p in listing(path.parent) if p != path]
    before = f"the checkpoints already in {path.parent} are whole (newest: {kept[0]})" if kept else \
        f"{path.parent} holds no earlier checkpoint"
    return f"checkpoint {path} could not be written: {why}; {before}"


class Writer:
    """Rank 0's checkpoint writes on a thread of their own, at most one in flight.

    ``submit(write, path)`` waits for the previous write, then runs ``write()`` on a new thread;
    ``wait()`` waits for the write in flight. Each wait has a deadline (``timeout_s``). A write
    that failed is raised once, by the next ``submit`` or ``wait``, as the DDTrainError it
    raised (``write_and_rotate``: one line naming the file and the directory).
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._path = None
        self._error: BaseException | None = None

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as exc:   # reported on the training thread, at the next save or the end
            self._error = exc

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write, path) -> None:
        self.wait()
        self._path = path
        self._thread = threading.Thread(target=self._run, args=(write,), name="ddtrain-checkpoint-write", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise DDTrainError(f"checkpoint {self._path} was still being written after {self.timeout_s:g} s "
                                   "(--timeout): the file system does not answer")
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            if isinstance(error, DDTrainError):
                raise error
            raise DDTrainError(write_failure(self._path, error)) from None


STATE_KIND = "state"   # the header's ``kind`` of a file ``ddtrain.save_state`` wrote (a script's state)


def check_payload(payload, header: dict, path) -> None:
    """Raise DDTrainError naming the file when a readable payload is not what ``save`` (or ``save_state``) writes."""
    if header.get("kind") == STATE_KIND:
        return _check_state_payload(payload, header, path)

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
    history = payload.get("epochs_done", [])
    if not (isinstance(history, list) and all(isinstance(e, dict) for e in history)):
        raise bad("its per-epoch history ('epochs_done') is not a list of objects")


def _check_state_payload(payload, header: dict, path) -> None:
    """``check_payload`` for a script's state (``ddtrain.training.state``): per-rank parts and every prepared model."""
    def bad(what):
        return DDTrainError(f"state file {path} cannot be loaded: {what} (it was not written by ddtrain.save_state, "
                            "or was edited); remove it or load another")
    ranks = payload.get("ranks") if isinstance(payload, dict) else None
    if not isinstance(ranks, list) or not ranks:
        raise bad("its payload has no list of per-rank parts ('ranks')")
    if len(ranks) != header.get("world_size", len(ranks)):
        raise bad(f"its payload has {len(ranks)} per-rank parts but its header says world_size={header['world_size']}")
    for r, part in enumerate(ranks):
        if not isinstance(part, dict) or not {"rng", "rng_epoch", "loaders"} <= part.keys():
            raise bad(f"rank {r}'s part lacks its RNG states or loader positions")
    state = payload.get("shared") if payload.get("shared") is not None else ranks[0]
    entries = state.get("entries") if isinstance(state, dict) else None
    if not (isinstance(entries, list) and entries and all(isinstance(e, dict) and isinstance(e.get("model"), dict)
                                                          for e in entries)):
        raise bad("it holds no model state")


def restore(directory, *, required: bool, warn, check=None, reshape=None, missing=None):
    """Every rank's part of the newest whole checkpoint: (header, shared, my part), or None if none.

    Rank 0 finds and verifies the file (``check(header)`` may raise DDTrainError for an
    incompatible one) and sends each rank its part; every rank raises the same error. A
    checkpoint of another world size has its parts made into this one's by
    ``reshape(header, parts, shared)`` (``checkpoint_elastic.reshape``; None: no need).
    ``missing()``: the message when ``required`` and no file is whole (default: ``--resume``'s).
    """
    rank = dist.get_rank() if _distributed() else 0
    verdict, parts = None, None
    if rank == 0:
        try:
            found = newest(directory, warn=warn, quarantine=True) if Path(directory).is_dir() else None
            if found is None and required:
                raise DDTrainError(missing() if missing is not None else
                                   f"resume (--resume): no whole checkpoint in {directory}")
            if found is not None:
                path, header, payload = found
                if check:
                    check({**header, "path": str(path)})
                check_payload(payload, header, path)
                ranks = payload["ranks"]
                if "epochs_done" in payload:   # format 2 keeps the per-epoch history in the payload
                    header = {**header, "epochs_done": payload["epochs_done"]}
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
        # rank 0 writes in the background unless checkpoint_sync; every rank knows which (they settle together)
        self.in_background = not getattr(options, "checkpoint_sync", False)
        self.writer: Writer | None = None   # rank 0's, made at its first save
        self._finished = False
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
        try:
            return self.schedule_change(saved, self.schedule, header["step"])
        except (TypeError, ValueError, KeyError, AttributeError, ArithmeticError):  # values of the wrong types
            raise DDTrainError(f"checkpoint {header.get('path', self.directory)} cannot be resumed from: its header's "
                               "'schedule' section is not one ddtrain writes (its values have the wrong types: "
                               "edited, or written by another program); remove it or resume from another") from None

    def resume(self) -> None:
        """Take the directory; load the newest whole checkpoint when ``resume`` is set or torchrun restarted us."""
        self.claim()
        attempt, requeued = self.info["attempt"], requeue_count()
        if not (self.resume_asked or attempt > 0 or requeued > 0):   # a SLURM requeue continues too
            return
        got = restore(self.directory, required=self.resume_asked,
                      warn=lambda message: runtime.eprint(f"ddtrain: warning: {message}"),
                      check=self._check, reshape=self._reshape)
        why = f"restart {attempt}" if attempt else "--resume" if self.resume_asked else f"SLURM requeue {requeued}"
        if got is None:
            runtime.print0(f"{why}: no checkpoint in {self.directory} yet, starting from step 0")
            return
        header, shared, part = got
        state = shared if shared is not None else part
        try:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.strategy.load_state_dict(part.get("strategy") or {})   # after the model: local-sgd re-anchors on it
            note = self.strategy.load_compressor_state_dict(part.get("compressor") or {})
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
        if note:
            runtime.print0(f"ddtrain: note: {note}")
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

    @property
    def final(self) -> bool:
        """The step ``due`` was last asked about is the run's last."""
        return self._final

    def save(self, step: int, steps_done: int) -> None:
        """Collective: the state after ``step`` (``steps_done`` of them in this epoch), written by rank 0.

        Training waits while the state is gathered and copied to host memory; the file is written
        in the background (``checkpoint_sync``: here). The time it waited is appended to
        ``info["checkpoint_stall_s"]``, and the part of it spent waiting for the previous write to
        finish (saves more often than a write takes) to ``info["checkpoint_write_wait_s"]``.
        """
        began = time.perf_counter()
        self._settle(step)  # at most one write in flight; the previous one's failure stops every rank here
        waited = time.perf_counter() - began
        stall.mark(step, "checkpoint (gather to rank 0)")
        # one global state: replicas kept identical, or the parameter servers' (rank 0 fetches the
        # optimizer state from them: ``optimizer.state_dict()`` of a ps worker asks the servers)
        replicated = self.strategy.spec.replicated or bool(self.elastic and self.elastic.get("rule") == "servers")
        rank0 = runtime.rank() == 0
        state = None
        if not replicated or rank0 or self.strategy.spec.sharded:   # sharded: state_dict() gathers, on every rank
            state = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        part = {"rng": rng_state(), "rng_epoch": self._rng_epoch, "meter": self._meter.sums,
                "epoch_time_s": time.perf_counter() - self._epoch_t0, "strategy": self.strategy.state_dict(),
                "compressor": self.strategy.compressor_state_dict()}
        if not replicated:
            part.update(state)
        header = {"step": step, "epoch": self._epoch_now, "step_in_epoch": steps_done,
                  "strategy": self.strategy_name, "run": ownership.tag(self.directory) if rank0 else None,
                  "fingerprint": self.fingerprint}
        if self.schedule is not None:
            header["schedule"] = self.schedule
        if self.elastic:
            header["elastic"] = self.elastic
        parts = gather_parts(part, self.strategy.group)   # the snapshot: every tensor copied to host memory
        if rank0:
            # the per-epoch history grows with the epochs: in the payload, the header stays small (issue 32:
            # 5,000 one-step epochs made headers the reader refused); as JSON values, as the header had them
            history = json.loads(json.dumps(copy.deepcopy(self.record["epochs"]), default=str))
            payload = {"format": FORMAT, "step": step, "shared": to_cpu(state) if replicated else None,
                       "ranks": parts, "epochs_done": history}
            path = path_for(self.directory, step)
            header = {**header, "world_size": len(parts)}
            if not self.in_background:
                write_and_rotate(path, header, payload, keep=self.keep)
            else:
                self.writer = self.writer or Writer(runtime.deadline_s())
                self.writer.submit(lambda: write_and_rotate(path, header, payload, keep=self.keep), path)
            self.info["last_checkpoint"] = str(path)   # in the background: its failure stops the run (settle)
        self.info["checkpoints_written"] += 1
        self.info.setdefault("checkpoint_stall_s", []).append(round(time.perf_counter() - began, 6))
        if self.in_background:
            self.info.setdefault("checkpoint_write_wait_s", []).append(round(waited, 6))

    def _settle(self, step=None) -> None:
        """Collective (the workers): wait for the write in flight on rank 0; its failure is raised on every rank."""
        if not self.in_background:
            return
        verdict = None
        if runtime.rank() == 0 and self.writer is not None:
            stall.mark(step, "checkpoint (waiting for the previous write)")
            try:
                self.writer.wait()
            except DDTrainError as exc:
                verdict = str(exc)
        if _distributed():
            box = [verdict]
            dist.broadcast_object_list(box, src=0, group=self.strategy.group)
            verdict = box[0]
        if verdict is not None:
            raise (DDTrainError if runtime.rank() == 0 else PeerStopped)(verdict)

    def finish(self) -> None:
        """Collective (the workers), when training ends or stops: the last write done (or its failure, on every rank).

        Rank 0 then lets the next run into the directory: nothing more goes into it. Called again, it does nothing.
        """
        if self._finished:
            return
        self._finished = True
        self._settle(None)
        if runtime.rank() == 0:
            ownership.release(self.directory, "rank0")
