"""Never hang silently: where every rank is, so that a rank whose wait timed out can say whom it waits for.

The training loop marks what it is doing (``mark(step, operation)``: two assignments, no
communication). A daemon thread per rank publishes that mark to the job's store (the
torch.distributed key-value store that every launcher already provides) about once a
second. Every wait has a deadline: the process group's timeout for the native collectives
(Gloo raises; NCCL's watchdog aborts) and ``ddtrain.comm``'s own deadline for the hand-written
ones. When a wait fails, ``explain`` reads the other ranks' marks and turns the backend's
message into one line naming the operation, the step, and the rank(s) that did not join:
those at another step or operation, and those whose mark went stale (a frozen process).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import torch.distributed as dist

from ddtrain.errors import DDTrainError

TIMEOUT_WORDS = ("timed out", "timeout", "deadline")
LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
                   "connection refused", "socket closed")

_here = {"step": None, "op": "start-up"}


class StallError(DDTrainError):
    """A wait passed its deadline; the message names the operation, the step and the missing rank(s)."""


def mark(step, op: str) -> None:
    """Record what this rank is doing now (read by the heartbeat thread; no communication)."""
    _here["step"], _here["op"] = step, op


def where() -> tuple:
    return _here["step"], _here["op"]


def _key(rank: int) -> str:
    return f"ddtrain/where/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no default group, or a torch without the accessor
        return None


class Heartbeat:
    """Publishes this rank's mark to the store every ``period_s`` until stopped."""

    def __init__(self, period_s: float = 1.0):
        self.period_s = period_s
        self.store = _store() if dist.is_initialized() else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "Heartbeat":
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
            except Exception:  # the store went away: the job is ending, nothing to report to
                return

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
    beat = Heartbeat(period_s).start() if dist.is_initialized() and dist.get_world_size() > 1 else None
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
