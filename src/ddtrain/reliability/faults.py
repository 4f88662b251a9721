"""Deliberate faults, for testing what users see when things break (never set in normal use).

``DDTRAIN_FAULT="rank=1,step=3,kind=raise"`` makes rank 1 fail at the start of step 3 (counted
over the whole run). Kinds:

* ``raise``: an exception; ``exit``: ``os._exit(3)``; ``kill``: SIGKILL to itself;
* ``hang``: sleeps inside the step, holding up its peers;
* ``skip``: skips the step's collectives and every later one, staying alive (its heartbeat
  goes on), as a rank stuck in a data-dependent branch would: its peers wait for it;
* ``nan``: this step's forward pass on that rank returns NaN (a numerical fault, once);
* ``corrupt``: adds noise to that rank's first parameter (a silent divergence of replicas);
* ``term``: SIGTERM to itself, training going on (a scheduler's stop signal reaching that rank only).

A fault fires only in the first attempt of a job (``restart_attempt()`` 0), so
restarted workers run clean. ``fit`` installs a ``FaultInjector`` callback only when a fault is
set (``injectors()``); the parameter servers call ``maybe_inject`` themselves.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from ddtrain.errors import DDTrainError
from ddtrain.distributed.job import restart_attempt

KINDS = ("raise", "exit", "kill", "hang", "skip", "nan", "corrupt", "term")


class InjectedFault(RuntimeError):
    """Raised by a ``kind=raise`` fault."""


def _parse(text: str) -> dict:
    usage = f"environment variable DDTRAIN_FAULT={text!r}: expected rank=R,step=S,kind=K (K one of {', '.join(KINDS)})"
    items = [item.strip() for item in text.split(",") if item.strip()]
    if any("=" not in item for item in items):
        raise DDTrainError(usage)
    spec = dict(item.split("=", 1) for item in items)
    unknown = sorted(set(spec) - {"rank", "step", "kind"})
    if unknown:
        raise DDTrainError(f"{usage}; unknown key {unknown[0]!r}")
    try:
        rank, step = int(spec["rank"]), int(spec["step"])
    except (KeyError, ValueError):
        raise DDTrainError(usage) from None
    if rank < 0 or step < 0:
        raise DDTrainError(f"{usage}; rank and step must be >= 0")
    kind = spec.get("kind", "raise")
    if kind not in KINDS:
        raise DDTrainError(f"environment variable DDTRAIN_FAULT kind {kind!r}: valid: {', '.join(KINDS)}")
    return {"rank": rank, "step": step, "kind": kind}


def from_env() -> dict | None:
    """The fault DDTRAIN_FAULT asks for, or None; DDTrainError (one line) for a value that is not one."""
    text = os.environ.get("DDTRAIN_FAULT", "")
    return _parse(text) if text.strip() else None


# Parsed once per process; a bad value is reported by the command line before anything runs
# (cli.main checks the environment), and raised here only when a fault is looked up.
try:
    _fault, _fault_error = from_env(), None
except DDTrainError as _exc:
    _fault, _fault_error = None, _exc


class FaultInjector:
    """A training-loop callback firing the fault at the start of its step (after the step's stall mark)."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_step_begin(self, step, state):
        if _fault is not None and _fault["step"] == step and _fault["kind"] in ("raise", "exit", "kill", "term"):
            # a checkpoint still being written in the background is finished first: the fault then has a
            # known last checkpoint to resume from (killed mid-write, a loaded CI run resumed 2 steps further
            # back than its test expected, 2026-11-28); a real crash can lose the write in flight, which a
            # resume handles (the newest whole checkpoint)
            writer = getattr(getattr(state, "checkpointer", None), "writer", None)
            if writer is not None:
                writer.wait()
        maybe_inject(step, self.rank, state.model)


def injectors(rank: int) -> list:
    """The callbacks ``fit`` adds: a ``FaultInjector`` when DDTRAIN_FAULT names this rank, else none."""
    if _fault_error is not None:
        raise _fault_error
    return [FaultInjector(rank)] if _fault is not None and _fault["rank"] == rank else []


def maybe_inject(step: int, rank: int, module=None) -> None:
    """Called at the start of every training step; does nothing unless DDTRAIN_FAULT matches."""
    if _fault_error is not None:
        raise _fault_error
    if _fault is None or _fault["rank"] != rank or _fault["step"] != step:
        return
    if restart_attempt() > 0:
        return
    kind = _fault["kind"]
    if kind == "raise":
        raise InjectedFault(f"rank {rank} deliberately failed at step {step} (DDTRAIN_FAULT)")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if kind == "nan":
        handle = module.register_forward_hook(lambda _m, _inputs, out: (handle.remove(), out * float("nan"))[1])
        return
    if kind == "corrupt":
        import torch
        with torch.no_grad():
            next(module.parameters()).add_(1e-3)
        return
    if kind == "skip":
        from ddtrain.reliability import stall
        stall.mark(step, "skipping every collective from here on (DDTRAIN_FAULT kind=skip)")
        print(f"[rank {rank}] DDTRAIN_FAULT: skipping the collectives of step {step} and after", file=sys.stderr,
              flush=True)
    time.sleep(10 ** 6)
