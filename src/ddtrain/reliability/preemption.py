"""Stopping for a preemption: signal handlers that only take note, and one step at which every rank stops.

Schedulers ask a job to stop with a signal and kill it a grace period later: SLURM at a time
limit, a preemption or ``scontrol requeue`` (SIGTERM, SIGKILL KillWait seconds later; with
``sbatch --signal=USR1@N`` a USR1 N seconds before the limit), Kubernetes evictions and spot
reclaims (SIGTERM, SIGKILL after terminationGracePeriodSeconds). ``Preemption`` installs
handlers for such signals that only count them: a handler runs between two bytecodes of
whatever the main thread was doing (a file write, a collective), so it does no I/O, takes no
lock and talks to no other rank. The loop calls ``should_stop()`` at step boundaries; there the
ranks learn whether *any* of them was signalled, so that all stop after the same step, one
checkpoint is written, and the job exits with ``PREEMPTED_EXIT`` (75). A second signal during
the save only counts once more: the write goes on (and is atomic in any case: observe.files).

How the ranks agree: through the job's key-value store (``default_store()``), one counter per
check that every participating rank adds to (1, plus ``_SIGNALLED`` if it was signalled); the
last to arrive publishes the total, which all of them read. A check is a meeting of all ranks,
so it is not made at every boundary: rank 0 times the boundaries and publishes with each check
how many boundaries to let pass before the next, so that the ranks meet about every
``check_every_s`` (0.2 s) of training; all of them read the same number, so they check at the
same boundaries, and a signal is obeyed within about that time (plus the step in flight). Not a collective of the training
group, which may be a NCCL group busy on another stream, and which the parameter servers (ranks
that never run a step: they stop when the workers finish) are not part of; not a new Gloo group,
whose creation every rank including the servers would have to join at the same point. The store
costs each rank three or four round trips per check whatever the number of ranks (560 µs per
check on 3 ranks sharing 2 cores, where an all-reduce of one int over Gloo took 1,227 µs:
results/preemption/check_cost.json), and needs no group. Every wait has a deadline (the job's ``--timeout``).
"""
from __future__ import annotations

import datetime
import math
import os
import signal
import threading
import time

from ddtrain.distributed.job import default_store, restart_attempt
from ddtrain.distributed.launch import PREEMPT_REPORT_ENV, PREEMPTED_EXIT
from ddtrain.errors import DDTrainError

__all__ = ["PREEMPTED_EXIT", "ALWAYS", "Preemption", "parse_signals", "write_report"]

ALWAYS = ("SIGTERM", "SIGINT")           # what schedulers (and Ctrl-C) send to stop a job: always handled
EXTRA_SIGNALS_ENV = "DDTRAIN_PREEMPT_SIGNAL"   # what --preempt-signal adds, for the workers of `ddtrain run`
_SIGNALLED = 1 << 32                      # added to a check's counter by a signalled rank (> any rank count)
CHECK_EVERY_S = 0.2                       # seconds of training between two checks of the ranks
# the default check_every_s when set: 0 checks at every step boundary (tests whose steps take a
# millisecond would otherwise finish before a check, the spacing being up to MOST_BOUNDARIES steps)
CHECK_EVERY_ENV = "DDTRAIN_PREEMPT_CHECK_S"
MOST_BOUNDARIES = 1000                    # boundaries between two checks at most, however short the steps
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_serial: dict[str, int] = {}              # per name: Preemption objects made in this process (the same on every rank)


def parse_signals(text: str, what: str = "--preempt-signal") -> tuple[str, ...]:
    """``"USR1"``, ``"SIGUSR1,USR2"`` or ``"10"`` -> ("SIGUSR1", ...); DDTrainError naming ``what`` for anything else."""
    out = []
    for item in (part.strip() for part in str(text or "").split(",")):
        if not item:
            continue
        name = item.upper()
        if name.isdecimal():
            try:
                name = signal.Signals(int(name)).name
            except ValueError:
                raise DDTrainError(f"{what} {item!r}: no signal has number {item}") from None
        elif not name.startswith("SIG"):
            name = "SIG" + name
        if name in _UNCATCHABLE:
            raise DDTrainError(f"{what} {item!r}: {name} cannot be caught, so no checkpoint could follow it")
        if not isinstance(getattr(signal, name, None), signal.Signals):
            valid = ", ".join(n[3:] for n in ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGTERM", "SIGINT"))
            raise DDTrainError(f"{what} {item!r} is not a signal of this system (for example: {valid})")
        if name not in out:
            out.append(name)
    return tuple(out)


class Preemption:
    """Note preemption signals; ``should_stop()``, at a step boundary, tells every participating rank the same answer.

    ``signals``: the signal names handled besides SIGTERM and SIGINT (``--preempt-signal``; by
    default those of ``DDTRAIN_PREEMPT_SIGNAL``). ``participants`` ranks (the workers, ranks 0 to
    participants-1; default: the whole job) call ``should_stop`` at every boundary (it asks the
    others only every ``check_every_s`` seconds or so; 0: at every boundary). Every
    process of the job should ``install()``, the parameter servers too (so that a signal does not
    kill them before the workers have saved), but only participants call ``should_stop``.
    Use as a context manager, or ``install()`` and ``restore()``.
    """

    def __init__(self, signals=None, *, participants: int | None = None, timeout_s: float | None = None,
                 check_every_s: float | None = None, name: str = "train"):
        import torch.distributed as dist
        extra = parse_signals(os.environ.get(EXTRA_SIGNALS_ENV, ""), EXTRA_SIGNALS_ENV) if signals is None \
            else parse_signals(",".join(signals) if not isinstance(signals, str) else signals)
        self.signals = tuple(dict.fromkeys((*ALWAYS, *extra)))
        grouped = dist.is_available() and dist.is_initialized()
        self.participants = participants if participants is not None else (dist.get_world_size() if grouped else 1)
        if not isinstance(self.participants, int) or self.participants < 1:
            raise DDTrainError(f"preemption: participants must be a positive number of ranks, got {self.participants!r}")
        if timeout_s is None:
            from ddtrain.distributed import runtime
            timeout_s = runtime.deadline_s()
        self.timeout_s = float(timeout_s)
        self.store = default_store() if self.participants > 1 else None
        if self.participants > 1 and self.store is None:
            raise DDTrainError("preemption: several participants need the job's store (call ddtrain.init() first)")
        serial = _serial[name] = _serial.get(name, 0) + 1
        self._prefix = f"ddtrain/preempt/{restart_attempt()}/{name}/{serial}"
        self.count = 0                   # signals received by this process (set by the handler only)
        self.first: tuple[int, float] | None = None   # (signal number, time.time()) of the first
        self.stopped = False             # agreed: every participant stops
        self.boundaries = self.checks = 0   # calls of should_stop, and those that asked the others
        if check_every_s is None:
            raw = os.environ.get(CHECK_EVERY_ENV, "")
            try:
                check_every_s = float(raw) if raw else CHECK_EVERY_S
            except ValueError:
                raise DDTrainError(f"environment variable {CHECK_EVERY_ENV}={raw!r} is not a number of seconds") from None
        if not check_every_s >= 0:
            raise DDTrainError(f"preemption: check_every_s must be >= 0 seconds, got {check_every_s!r}")
        self.check_every_s = float(check_every_s)
        self.leader = (dist.get_rank() if grouped else 0) == 0   # rank 0 times the boundaries for all
        self._next_check, self._clock = 1, None
        self._previous: dict[int, object] = {}

    # ---- this process ----------------------------------------------------------------------

    def _note(self, signum, frame) -> None:  # the handler: two assignments, nothing else
        self.count += 1
        if self.first is None:
            self.first = (signum, time.time())

    def install(self) -> Preemption:
        """Handle ``self.signals`` (in the main thread only: Python runs handlers there; elsewhere, nothing is installed)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return self
        for name in self.signals:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._note)
        return self

    def restore(self) -> None:
        """Put back the handlers ``install`` replaced."""
        for number, handler in self._previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _interval(self) -> int:
        """Rank 0: boundaries until the next check, so that checks come about every ``check_every_s`` seconds."""
        now = time.perf_counter()
        every = 1
        if self._clock is not None and self.check_every_s > 0:
            per_boundary = (now - self._clock[1]) / max(self.boundaries - self._clock[0], 1)
            every = MOST_BOUNDARIES if per_boundary <= 0 else \
                max(1, min(MOST_BOUNDARIES, math.ceil(self.check_every_s / per_boundary)))
        self._clock = (self.boundaries, now)
        return every

    def __enter__(self) -> Preemption:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def requested(self) -> bool:
        """This process received one of the signals (the others learn it at the next ``should_stop``)."""
        return self.count > 0

    @property
    def signal_name(self) -> str | None:
        """The first signal's name (``SIGTERM``), or None."""
        return signal.Signals(self.first[0]).name if self.first else None

    # ---- every participant ------------------------------------------------------------------

    def should_stop(self) -> bool:
        """Did any participant receive a signal? Every participant calls this at every boundary and gets one answer.

        Between checks (see ``check_every_s``) it answers False without asking anybody; once
        True it stays True (and asks nobody again). Raises DDTrainError when the others
        do not all arrive within the deadline (a rank failed or is stuck elsewhere).
        """
        if self.stopped:
            return True
        self.boundaries += 1
        if self.store is None:
            self.stopped = self.requested
            return self.stopped
        if self.boundaries < self._next_check:
            return False
        self.checks += 1
        key, n = f"{self._prefix}/{self.checks}", self.participants
        if self.leader:   # before its add: whoever arrives last finds it
            self.store.set(key + "/every", str(self._interval()))
        total = self.store.add(key, 1 + (_SIGNALLED if self.requested else 0))
        done = key + "/done"
        if total % _SIGNALLED == n:   # the last to arrive: all have added (the signalled ones their mark too)
            if self.checks > 1:       # everyone has read the previous check's answer before adding to this one
                previous = f"{self._prefix}/{self.checks - 1}"
                for old in (previous, previous + "/done", previous + "/every"):
                    self.store.delete_key(old)
            every = int(self.store.get(key + "/every"))
            self.store.set(done, f"{total} {every}")
        else:
            try:
                self.store.wait([done], datetime.timedelta(seconds=self.timeout_s))
            except Exception as exc:
                if "timeout" not in str(exc).lower():
                    raise
                arrived = self.store.add(key, 0) % _SIGNALLED
                raise DDTrainError(f"preemption check {self.checks}: only {arrived} of the {n} ranks arrived within "
                                   f"the {self.timeout_s:g} s deadline (--timeout); another rank failed or is stuck "
                                   "elsewhere") from None
            total, every = (int(v) for v in self.store.get(done).split())
        self._next_check = self.boundaries + every
        self.stopped = total >= _SIGNALLED
        return self.stopped


def write_report(step: int, checkpoint: str | None, *, signal_name: str | None, signal_at: float | None,
                 rank: int, saved: bool) -> None:
    """Tell this node's launcher (``ddtrain train --nproc``, ``ddtrain run``) where the job stopped; no-op without one.

    ``checkpoint``: the file holding step ``step`` (None: none yet); ``saved``: written by this stop.
    """
    path = os.environ.get(PREEMPT_REPORT_ENV)
    if not path:
        return
    from ddtrain.observe import files
    files.write_json(path, {"step": step, "checkpoint": checkpoint, "saved": saved, "signal": signal_name,
                            "signal_at": signal_at, "written_at": time.time(), "rank": rank})


