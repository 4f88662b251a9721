"""One run per checkpoint directory: a lock naming its owner, and the lineage every checkpoint belongs to.

Two lock files in the directory, each held with ``fcntl.flock`` for the life of its process
(the kernel drops the lock when the process ends, however it ends, so a dead run's lock is
free by itself): ``.ddtrain-lock`` by the launching process (``ddtrain train --nproc``) and
``.ddtrain-lock-rank0`` by the worker that writes the checkpoints. Each names its holder (run
id, launch id, host, pid, start time, command). A process of another run finds either held and is
refused with that name; the processes of one run (the launcher, its workers, torchrun's restarts of
them) share the run id ``DDTRAIN_RUN_ID``, which the first of them sets and the others inherit, and
the launch id ``DDTRAIN_LAUNCH_ID`` (issue 32: two launches that share an exported run id, a sweep
script's, are still two runs; the launchers of the nodes of one multi-node job share one). The lock
files are opened without following a symbolic link and without blocking, and must be regular files
(``regular_files``): a link, a FIFO or a folder in their place is refused naming it.
``.ddtrain-lineage`` names the run that started the directory; every checkpoint records it,
and ``--resume`` continues only from checkpoints of that lineage unless ``--resume-any`` says so.
``.ddtrain-membership`` lists the world sizes the run trained at and from which step (``note_membership``).
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from ddtrain.distributed.launch import MEMBERSHIP_REASON_ENV  # set by the launcher that restarted the workers
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.reliability.regular_files import NotRegular, open_regular, read_regular

RUN_ID_ENV = "DDTRAIN_RUN_ID"
LAUNCH_ID_ENV = "DDTRAIN_LAUNCH_ID"
LOCKS = {"launcher": ".ddtrain-lock", "rank0": ".ddtrain-lock-rank0"}
LINEAGE = ".ddtrain-lineage"
MEMBERSHIP = ".ddtrain-membership"

_held: dict[str, int] = {}   # lock path -> open descriptor holding its flock, for this process's life


class DirectoryInUse(DDTrainError):
    """Another run holds the checkpoint directory; the message names it."""


def run_id() -> str:
    """This run's identity: ``DDTRAIN_RUN_ID`` if set (by the launching process), else a new one, exported."""
    rid = os.environ.get(RUN_ID_ENV, "").strip()
    if not rid:
        rid = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        os.environ[RUN_ID_ENV] = rid  # workers and torchrun's restarts of them inherit it: the same run
        os.environ[LAUNCH_ID_ENV] = _new_launch_id()  # a new run is a new launch (never one inherited by chance)
    return rid


def _new_launch_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def launch_id(nodes: int = 1) -> str:
    """This launch's identity: ``DDTRAIN_LAUNCH_ID`` if set (by the launching process), else a new one, exported.

    A run id may be shared by two launches (a sweep script that exported ``DDTRAIN_RUN_ID``):
    the launch id tells them apart. The launching process makes it (its host, pid and a random
    part) and its workers and torchrun's restarts of them inherit it. The launchers of the
    ``nodes`` > 1 nodes of one job derive one from their shared run id
    (``distributed.env.share_run_id``), so that each node's launcher counts as the same launch.
    """
    rid = run_id()   # first: a new run id comes with a new launch id (never one inherited by chance)
    lid = os.environ.get(LAUNCH_ID_ENV, "").strip()
    if not lid:
        lid = f"nodes-{rid}" if nodes > 1 else _new_launch_id()
        os.environ[LAUNCH_ID_ENV] = lid
    return lid


def _ours(owner: dict) -> bool:
    """The lock ``owner`` is a process of this run and launch (a record without a launch id: of this run)."""
    if owner.get("run_id") != run_id():
        return False
    theirs = owner.get("launch")
    return theirs is None or theirs == launch_id()


def _owner_record(role: str) -> dict:
    command = " ".join(["ddtrain", *sys.argv[1:]])
    return {"run_id": run_id(), "launch": launch_id(), "role": role, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "command": command if len(command) <= 200 else command[:197] + "..."}


def _read(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 1 << 16, 0).decode("utf-8", "replace")
        record = json.loads(text) if text.strip() else None
    except (OSError, ValueError, RecursionError):  # RecursionError: a record nested thousands deep
        return None
    return record if isinstance(record, dict) else None


def _open_lock(directory, path: Path, flags: int) -> int:
    """A descriptor of the lock file ``path``, never through a symbolic link, never blocking on a FIFO."""
    try:
        return open_regular(path, flags, follow=False)
    except NotRegular as exc:
        raise DDTrainError(f"--checkpoint-dir {directory}: its lock file {path} {exc}; ddtrain keeps its lock record "
                           f"only in a regular file of its own and never writes through a link: remove it "
                           f"(rm -r {path}) and start again") from None


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's process, or a record we cannot read: assume alive
    return True


def describe(owner: dict) -> str:
    who = "its launching process" if owner.get("role") == "launcher" else "its rank 0 worker"
    return (f"run {owner.get('run_id', '?')} ({who}, pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, "
            f"started {owner.get('started', '?')}: {owner.get('command', '?')})")


def _in_use(directory, owner: dict) -> DirectoryInUse:
    shared = ""
    if owner.get("run_id") == run_id():   # the same exported DDTRAIN_RUN_ID, another launch (issue 32)
        shared = (f"; both runs have {RUN_ID_ENV}={run_id()} (exported by a script?), but they are two launches: "
                  f"give each run its own {RUN_ID_ENV}, or unset it")
    return DirectoryInUse(f"--checkpoint-dir {directory} is in use by {describe(owner)}; wait for that run to end "
                          f"(or stop it: kill {owner.get('pid', '?')}), or choose another --checkpoint-dir{shared}")


def _try_lock(fd: int) -> bool | None:
    """True if this descriptor now holds the flock, False if another holds it, None if the filesystem has no flock."""
    import fcntl
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None  # ENOLCK, EOPNOTSUPP (some network filesystems): judge by the recorded pid instead


def _holder(directory, path: Path) -> dict | None:
    """The record of the live process holding ``path`` (None if free). Leaves it free."""
    if str(path) in _held or not os.path.lexists(path):
        return None
    try:
        fd = _open_lock(directory, path, os.O_RDONLY)
    except OSError:
        return None
    try:
        got = _try_lock(fd)
        owner = _read(fd)
        if got is None:  # no flock here: a record on this host with a live pid is a holder
            alive = owner and not owner.get("released") and (owner.get("host") != socket.gethostname()
                                                             or _pid_alive(owner.get("pid")))
            return owner if alive else None
        return None if got else (owner or {"run_id": "?", "pid": "?", "host": "?"})
    finally:
        os.close(fd)  # closing drops a flock we took only to test


def check_free(directory, *, nodes: int = 1) -> None:
    """Raise DirectoryInUse naming the owner when a process of another run or launch holds ``directory``.

    Creates nothing. ``nodes``: the nodes of this launch (their launchers are one launch).
    """
    launch_id(nodes)
    for name in LOCKS.values():
        owner = _holder(directory, Path(directory) / name)
        if owner is not None and not _ours(owner):
            raise _in_use(directory, owner)


def held_by_this_run(directory) -> bool:
    """True when a live process of this run (same DDTRAIN_RUN_ID: another node's launcher) holds ``directory``."""
    me = run_id()
    return any((owner := _holder(directory, Path(directory) / name)) is not None and owner.get("run_id") == me
               for name in LOCKS.values())


def claim(directory, role: str, *, nodes: int = 1) -> dict | None:
    """Hold ``directory``'s lock for ``role`` ("launcher" or "rank0") until this process ends or ``release``.

    Raises DirectoryInUse naming the owner when a process of another run (or another launch of
    the same run id) holds either lock; DDTrainError naming the lock file when it is not a
    regular file of its own (a symbolic link, a FIFO, a folder). Returns the record of a
    previous holder that ended without releasing it (a crashed run, whose lock is taken over),
    else None. ``nodes``: the nodes of this launch (``check_free``).
    """
    directory = Path(directory)
    check_free(directory, nodes=nodes)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCKS[role]
    if str(path) in _held:
        return None
    fd = _open_lock(directory, path, os.O_RDWR | os.O_CREAT)
    got = _try_lock(fd)
    previous = _read(fd)
    if got is False:
        os.close(fd)
        if previous and _ours(previous):
            return None  # another process of this launch holds it (a restart racing its predecessor's exit)
        raise _in_use(directory, previous or {})
    record = json.dumps(_owner_record(role)).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    _held[str(path)] = fd
    if previous and not previous.get("released") and not _ours(previous):
        return previous
    return None


def release(directory, role: str) -> None:
    """Mark ``role``'s lock on ``directory`` released and drop it (the process ending drops it too)."""
    path = Path(directory) / LOCKS[role]
    fd = _held.pop(str(path), None)
    if fd is None:
        return
    try:
        owner = _read(fd) or {}
        record = json.dumps({**owner, "released": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- lineage --------------------------------------------------------------------------------

def _small_json(path):
    """The JSON value of the small regular file ``path``; None when absent, not a regular file, or not JSON."""
    try:
        return json.loads(read_regular(path, 1 << 20))
    except (OSError, ValueError, NotRegular, RecursionError):  # never block on a FIFO put in its place
        return None


def lineage(directory) -> dict | None:
    """The directory's lineage record ({"lineage", "started", "host", "command"}), or None if it has none."""
    record = _small_json(Path(directory) / LINEAGE)
    return record if isinstance(record, dict) and isinstance(record.get("lineage"), str) else None


def start_lineage(directory, lineage_id: str | None = None, *, origin: dict | None = None) -> dict:
    """Name the directory's lineage: this run's id (a new directory), or the one ``--resume-any`` adopts."""
    from ddtrain.observe import files
    owner = _owner_record("launcher")
    record = {"lineage": lineage_id or owner["run_id"], "started": owner["started"], "host": owner["host"],
              "command": owner["command"], **({"adopted_from": origin} if origin else {})}
    text = json.dumps(record, indent=2) + "\n"
    files.atomic_write(Path(directory) / LINEAGE, lambda tmp: Path(tmp).write_text(text))
    return record


def ensure_lineage(directory) -> dict:
    return lineage(directory) or start_lineage(directory)


def tag(directory) -> dict:
    """What every checkpoint header records about the run that wrote it."""
    return {"lineage": (lineage(directory) or {}).get("lineage"), "run_id": run_id(), "host": socket.gethostname(),
            "pid": os.getpid()}


def check_lineage(header: dict, directory, path, *, resume_any: bool) -> str | None:
    """Raise unless the checkpoint ``path`` (its ``header``) belongs to ``directory``'s lineage.

    Returns the checkpoint's lineage when ``resume_any`` lets a foreign one through (the caller
    adopts it), else None. Checkpoints written before lineages existed carry none and pass.
    """
    theirs = (header.get("run") or {}).get("lineage")
    mine = (lineage(directory) or {}).get("lineage")
    if not theirs or not mine or theirs == mine:
        return None
    if resume_any:
        return theirs
    run = header.get("run") or {}
    raise ConfigError("resume", f"finds {path} written by another run (lineage {theirs}, run "
                                f"{run.get('run_id', '?')} on host {run.get('host', '?')}), not by this directory's run "
                                f"(lineage {mine}); continuing from it would mix two runs' histories. Pass resume_any "
                                "to continue from it anyway, or remove it")


# ---- membership ------------------------------------------------------------------------------

def membership(directory) -> list[dict]:
    """The membership changes recorded in ``directory`` (oldest first; [] if none)."""
    entries = _small_json(Path(directory) / MEMBERSHIP)
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def membership_reason(previous: dict | None, world_size: int, *, attempt: int, resumed: bool) -> str:
    """Why this attempt runs at ``world_size``: the launcher's words if it gave some, else what the sizes say."""
    said = os.environ.get(MEMBERSHIP_REASON_ENV, "").strip()
    if said:
        return said
    if previous is None or not (attempt or resumed):
        return "start"
    before = previous.get("world_size")
    if not attempt:  # a new launch on the checkpoints: whatever size the user chose
        return f"--resume at world size {world_size}" + (f" (was {before})" if before != world_size else "")
    if isinstance(before, int) and before > world_size:
        return f"restart {attempt}: {before - world_size} rank(s) gone, world size {before} -> {world_size}"
    if isinstance(before, int) and before < world_size:
        return f"restart {attempt}: {world_size - before} rank(s) joined, world size {before} -> {world_size}"
    return f"restart {attempt} at the same world size"


def note_membership(directory, *, step: int, world_size: int, attempt: int, resumed: bool,
                    write: bool) -> list[dict]:
    """Append this attempt's membership (step it trains from, world size, reason, time) and return the list.

    Every (re)start of the workers is one entry ``{"step", "world_size", "reason", "at", "attempt"}``;
    the list lives in the checkpoint directory, so it outlasts the processes of each attempt and the
    record (run.json) of the last attempt lists every change. A fresh run (not resumed, first
    attempt) starts a new list. Only the process with ``write`` (rank 0) writes the file.
    Without a checkpoint directory the list is this start alone.
    """
    fresh = not (attempt or resumed)
    entries = [] if directory is None or fresh else membership(directory)
    previous = entries[-1] if entries else None
    entry = {"step": int(step), "world_size": int(world_size),
             "reason": membership_reason(previous, world_size, attempt=attempt, resumed=resumed),
             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "attempt": int(attempt)}
    entries.append(entry)
    if directory is not None and write:
        from ddtrain.observe import files
        text = json.dumps(entries, indent=1) + "\n"
        try:
            files.atomic_write(Path(directory) / MEMBERSHIP, lambda tmp: Path(tmp).write_text(text))
        except OSError as exc:  # the record still carries the list; the next attempt starts a shorter one
            print(f"ddtrain: warning: cannot write {Path(directory) / MEMBERSHIP}: {exc.strerror or exc}",
                  file=sys.stderr, flush=True)
        if previous is not None and previous.get("world_size") != world_size:
            print(f"ddtrain: membership: world size {previous.get('world_size')} -> {world_size}, training on from "
                  f"step {step} ({entry['reason']})", flush=True)
    return entries
