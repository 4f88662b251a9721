"""A launch's processes and folders, found and ended: nothing a job started outlives it (issue 32).

A launcher marks every process of its job with a token in the environment (``TOKEN_ENV``, inherited by
the workers and by whatever they start) and notes each worker's pid: torchrun starts each worker in a
session of its own, so the worker's session holds its children even where a script gave them another
environment. ``end_job`` ends all of them when the job ends, however it ended (a failed rank's
``subprocess.Popen(['sleep', '300'])`` included). ``SignalWatch`` sees the launcher's stop signals even
while its main thread is blocked inside torch's C++ (a rendezvous waiting for a node that never comes),
and ends the job at once when the signals repeat. ``claim_folder``/``sweep_folders`` bound what
launchers leave in the temporary directory (the log folders of failed jobs, the folders of launchers
that were killed).
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import uuid

TOKEN_ENV = "DDTRAIN_JOB_TOKEN"     # one value per launch (run_local): every process of the job carries it
OWNER_FILE = ".ddtrain-owner"       # in a launcher's folder: "PID START" of the launcher that made it
KEPT_FILE = ".ddtrain-kept"         # in a failed job's log folder: named in its message, kept for the user
KEEP_FAILED = 10                    # the newest failed jobs' log folders kept; older ones go at the next launch
KEEP_DAYS = 7.0                     # a kept (or ownerless) folder older than this goes at the next launch
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def new_token() -> str:
    return uuid.uuid4().hex


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pid: int) -> bool:
    """Alive and not a zombie (``os.kill(pid, 0)`` succeeds on a zombie nobody has reaped)."""
    fields = _stat(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not os.path.isdir("/proc")
    return fields[0] not in ("Z", "X")


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where unknown): a pid reused later differs."""
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else ""


def job_processes(token: str, sessions=(), exclude=()) -> list[int]:
    """Running processes that carry ``token`` in their environment or belong to one of ``sessions``."""
    sessions, found = set(sessions), []
    skip = {os.getpid(), *exclude}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    marker = f"{TOKEN_ENV}={token}".encode()
    for entry in entries:
        if not entry.isdigit() or int(entry) in skip:
            continue
        pid = int(entry)
        fields = _stat(pid)
        if fields is None or fields[0] in ("Z", "X"):
            continue
        if int(fields[3]) in sessions:   # the session id
            found.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def end_job(token: str, sessions=(), grace_s: float = 3.0) -> list[int]:
    """End every process of the job (SIGTERM, then SIGKILL after ``grace_s``); the pids that were running."""
    found = job_processes(token, sessions)
    for pid in found:
        _signal(pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    end = time.monotonic() + grace_s
    while grace_s > 0 and time.monotonic() < end and any(running(pid) for pid in found):
        time.sleep(0.05)
    for pid in job_processes(token, sessions):   # what ignored SIGTERM, and what was started meanwhile
        _signal(pid, signal.SIGKILL)
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe(pids: list[int]) -> str:
    """'pid 12: sleep 300, pid 13: ...' for a note."""
    out = []
    for pid in pids[:3]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:60]
        except OSError:
            command = "?"
        out.append(f"pid {pid}: {command}")
    return ", ".join(out) + (f" and {len(pids) - 3} more" if len(pids) > 3 else "")


class SignalWatch:
    """The launcher's stop signals, seen by a thread (``signal.set_wakeup_fd``) whatever its main thread is doing.

    Python runs a signal handler only when the main thread returns to Python code; a main thread
    blocked in C++ (torch's store waiting for a node that never comes) would hear Ctrl-C only at
    its timeout. The wake-up file gets the signal's number at once, from C. ``stuck(signum)`` is
    called when, ``stuck_s`` after a stop signal that found no worker running, the launch is still
    running and none of its workers is (nothing to stop but the launcher itself). A signal that
    found workers running reached a main thread in torch's Python loop, which stops them and
    returns: only ``settle_s`` after the last of them ended is that launcher called stuck (a
    stopped job's workers can save and exit well within 1.5 s while a loaded machine's launcher
    takes longer to return: CI's exit 143 for 75). ``escalate(signum, count)`` at the
    ``kill_after``-th stop signal (the workers ignored the earlier ones). Only Python-handled
    signals reach the wake-up file: every stop signal of a launch has a handler (torchrun's, or
    ``run_local``'s).
    """

    def __init__(self, *, kill_after: int, stuck, escalate, workers_alive, stuck_s: float = 1.5,
                 settle_s: float = 30.0):
        self.kill_after, self.stuck, self.escalate, self.workers_alive = kill_after, stuck, escalate, workers_alive
        self.stuck_s, self.settle_s = stuck_s, settle_s
        self.count = 0
        self.done = threading.Event()
        self._fds: tuple[int, int] | None = None
        self._previous = -1
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False   # set_wakeup_fd is for the main thread only (a launch started from a thread has no terminal)
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except (ValueError, OSError):
            os.close(read)
            os.close(write)
            return False
        self._fds = (read, write)
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddtrain-signal-watch")
        self._thread.start()
        return True

    def _run(self) -> None:
        read = self._fds[0]
        while not self.done.is_set():
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data or self.done.is_set():
                return
            for number in data:
                if number not in [int(s) for s in STOP_SIGNALS]:
                    continue
                self.count += 1
                if self.count >= self.kill_after:
                    self.escalate(number, self.count)
                elif self.count == 1:
                    threading.Thread(target=self._check_stuck, args=(number, self.workers_alive()),
                                     daemon=True).start()

    def _check_stuck(self, number: int, alive_at_signal: bool) -> None:
        wait = self.stuck_s
        if alive_at_signal:   # torch's loop stops them (a preempted job's save: up to its grace) and then returns
            while self.workers_alive():
                if self.done.wait(0.2):
                    return
            wait = self.settle_s
        if not self.done.wait(wait) and not self.workers_alive():
            self.stuck(number)

    def close(self) -> None:
        self.done.set()
        if self._fds is None:
            return
        try:
            signal.set_wakeup_fd(self._previous)
        except (ValueError, OSError):
            pass
        read, write = self._fds
        try:
            os.write(write, b"\0")   # wakes the thread, which sees done set
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=2)
        for fd in (read, write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = None


def claim_folder(path: str) -> None:
    """Mark ``path`` as this launcher's (``sweep_folders`` removes it once this process is gone, unless kept)."""
    try:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            f.write(f"{os.getpid()} {start_time(os.getpid())}\n")
    except OSError:
        pass


def keep_folder(path: str) -> None:
    """Mark ``path`` as named in a failure message: kept (the newest ``KEEP_FAILED``, up to ``KEEP_DAYS``)."""
    try:
        with open(os.path.join(path, KEPT_FILE), "w") as f:
            f.write(f"{time.time()}\n")
    except OSError:
        pass


def _owner_running(path: str) -> bool | None:
    """Whether the launcher that made ``path`` still runs (None: no owner recorded)."""
    try:
        with open(os.path.join(path, OWNER_FILE)) as f:
            pid_text, _, started = f.read().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    return running(pid) and (not started or start_time(pid) in ("", started))


def sweep_folders(root: str, prefixes=("ddtrain-logs-", "ddtrain-preempt-"), now: float | None = None) -> list[str]:
    """Remove what earlier launchers left in ``root``; the paths removed.

    Gone: a folder whose launcher is no longer running and that no failure message named (the
    launcher was killed: ``kill -9``, a signal it does not handle); a kept folder beyond the newest
    ``KEEP_FAILED`` or older than ``KEEP_DAYS``; a folder with no owner (an older ddtrain's) older than
    ``KEEP_DAYS``. A folder of a launcher that still runs is never touched.
    """
    now = time.time() if now is None else now
    removed, kept = [], []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(tuple(prefixes)) or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            age_days = (now - os.stat(path).st_mtime) / 86400
        except OSError:
            continue
        owner = _owner_running(path)
        if owner:
            continue
        if os.path.exists(os.path.join(path, KEPT_FILE)):
            kept.append((os.stat(path).st_mtime, path, age_days))
        elif owner is False or age_days > KEEP_DAYS:
            removed.append(path)
    kept.sort(reverse=True)
    removed += [path for i, (_, path, age) in enumerate(kept) if i >= KEEP_FAILED or age > KEEP_DAYS]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
