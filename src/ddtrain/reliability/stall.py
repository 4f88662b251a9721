"""Never hang silently: where every rank is, so that a rank whose wait timed out can say whom it waits for.

The training loop marks what it is doing (``mark(step, operation)``: two assignments, no
communication). A daemon thread per rank publishes that mark to the job's store (the
torch.distributed key-value store that every launcher already provides) about once a
second. Every wait has a deadline: the process group's timeout for the native collectives
(Gloo raises; NCCL's watchdog aborts) and ``ddtrain.comm``'s own deadline for the hand-written
ones. When a wait fails, ``explain`` reads the other ranks' marks and turns the backend's
message into one line naming the operation, the step, and the rank(s) that did not join:
those at another step or operation, and those whose mark went stale (a frozen process).
Before that, each rank's heartbeat thread also watches the next rank's heartbeat: one that has
not changed for ``SILENT_S`` seconds (a stopped or frozen process) is named in one warning
line while the job goes on waiting up to its deadline.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time

import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.distributed.job import default_store, restart_attempt

TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
                   "connection refused", "socket closed")

_here = {"step": None, "op": "start-up"}
# A peer's heartbeat unchanged this long is reported (once) while the wait goes on; with a 1 s
# heartbeat and a 1 s watch a stopped rank is named within 30 s of stopping.
SILENT_S = 27.0
SILENT_ENV = "DDTRAIN_SILENT_S"  # another threshold (seconds), e.g. for tests


class StallError(DDTrainError):
    """A wait passed its deadline; the message names the operation, the step and the missing rank(s)."""


def mark(step, op: str) -> None:
    """Record what this rank is doing now (read by the heartbeat thread; no communication)."""
    _here["step"], _here["op"] = step, op


def where() -> tuple:
    return _here["step"], _here["op"]


def _key(rank: int) -> str:
    return f"ddtrain/where/{restart_attempt()}/{rank}"


def _store():
    try:
        return default_store()
    except Exception:  # a torch without the accessor
        return None


def silent_after() -> float:
    """Seconds of heartbeat silence before a peer is reported: ``DDTRAIN_SILENT_S`` or ``SILENT_S``."""
    text = os.environ.get(SILENT_ENV, "").strip()
    if not text:
        return SILENT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        if not dist.is_initialized() or dist.get_rank() == 0:  # once per job, not once per rank
            print(f"ddtrain: warning: {SILENT_ENV}={text!r} is not a positive number of seconds; using {SILENT_S:g}",
                  file=sys.stderr, flush=True)
        return SILENT_S
    return value


class Heartbeat:
    """Publishes this rank's mark to the store every ``period_s`` and watches the next rank's.

    The next rank (``rank + 1``, wrapping round) has exactly one watcher, so a silent rank is
    named once per job; the same line names it again when it is heard from.
    """

    def __init__(self, period_s: float = 1.0, *, timeout_s: float | None = None):
        self.period_s, self.timeout_s = period_s, timeout_s
        self.store = _store() if dist.is_initialized() else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.peer = (self.rank + 1) % world if world > 1 else None
        self.silent_s = silent_after()
        self._seen, self._reported = None, False   # (peer's record, when it last changed), a warning printed
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> Heartbeat:
        if self.store is not None and self._thread is None:
            try:
                self._publish()
            except Exception:  # no usable store: run without heartbeats rather than fail the job
                self.store = None
                return self
            self._thread = threading.Thread(target=self._run, name="ddtrain-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _publish(self) -> None:
        step, op = where()
        self.store.set(_key(self.rank), json.dumps({"step": step, "op": op, "time": time.time()}))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._publish()
                self._watch()
            except Exception:  # the store went away: the job is ending, nothing to report to
                return

    def _watch(self) -> None:
        if self.peer is None:
            return
        key = _key(self.peer)
        text = self.store.get(key) if self.store.check([key]) else None
        now = time.monotonic()
        if self._seen is None or text != self._seen[0]:
            if self._reported:
                self._say(f"note: rank {self.peer} is heard from again after {now - self._seen[1]:.0f} s of silence")
            self._seen, self._reported = (text, now), False
            return
        silent = now - self._seen[1]
        if silent < self.silent_s or self._reported:
            return
        self._reported = True
        last = json.loads(text) if text else None
        where_ = f"last at step {last['step']}: {last['op']}" if last else "never heard from since the start"
        deadline = f"the {self.timeout_s:g} s deadline (--timeout)" if self.timeout_s else "its deadline"
        self._say(f"warning: rank {self.peer} has been silent for {silent:.0f} s ({where_}): it may be stopped "
                  f"(SIGSTOP, Ctrl-Z, a debugger) or frozen; the job keeps waiting for it up to {deadline}")

    def _say(self, text: str) -> None:
        sys.stderr.write(f"[rank {self.rank}] ddtrain: {text}\n")
        sys.stderr.flush()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)
            self._thread = None


def peer_marks(ranks) -> dict:
    """{rank: {"step", "op", "time"} or None} for the given global ranks, from the store (no waiting)."""
    store, out = _store(), {}
    for r in ranks:
        out[r] = None
        if store is None:
            continue
        try:
            if store.check([_key(r)]):
                out[r] = json.loads(store.get(_key(r)))
        except Exception:
            pass
    return out


def missing_peers(me: int, ranks, stale_s: float) -> list[str]:
    """Describe each rank of ``ranks`` that is not where this rank is (or went silent)."""
    step, op = where()
    now, notes = time.time(), []
    for r, m in peer_marks([r for r in ranks if r != me]).items():
        if m is None:
            notes.append(f"rank {r} (never heard from)")
            continue
        age = now - m["time"]
        at = f"step {m['step']}: {m['op']}"
        if age > stale_s:
            notes.append(f"rank {r} (silent for {age:.0f} s; last at {at})")
        elif (m["step"], m["op"]) != (step, op):
            notes.append(f"rank {r} (at {at}, heard {age:.1f} s ago)")
    return notes


def is_timeout(exc: BaseException) -> bool:
    from ddtrain.comm.p2p import CommError
    text = str(exc).lower()
    return isinstance(exc, CommError) or any(w in text for w in TIMEOUT_WORDS)


def explain(exc: BaseException, *, what: str, timeout_s: float, group=None, stale_s: float = 5.0):
    """A StallError for a timed-out wait (naming step, operation and missing ranks), else None."""
    if isinstance(exc, StallError) or not is_timeout(exc):
        return None
    if any(w in str(exc).lower() for w in LOST_PEER_WORDS):
        return None
    step, op = where()
    me = dist.get_rank() if dist.is_initialized() else 0
    ranks = dist.get_process_group_ranks(group) if group is not None and dist.is_initialized() \
        else list(range(dist.get_world_size() if dist.is_initialized() else 1))
    notes = missing_peers(me, ranks, stale_s)
    waiting = "; waiting for " + ", ".join(notes) if notes else \
        "; every rank reports the same step and operation, so one of them is stuck inside it"
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return StallError(f"stalled at step {step} in {op} ({what}): no answer within the {timeout_s:g} s "
                      f"deadline{waiting} [{detail[:200]}]")


@contextlib.contextmanager
def watched(*, what: str, timeout_s: float, group=None, period_s: float = 1.0):
    """Publish this rank's marks while the block runs; turn timed-out waits inside it into StallErrors."""
    beat = Heartbeat(period_s, timeout_s=timeout_s).start() if dist.is_initialized() and dist.get_world_size() > 1 \
        else None
    try:
        yield
    except Exception as exc:
        clearer = explain(exc, what=what, timeout_s=timeout_s, group=group, stale_s=max(5.0, 5 * period_s))
        if clearer is not None:
            raise clearer from exc
        raise
    finally:
        if beat is not None:
            beat.stop()
