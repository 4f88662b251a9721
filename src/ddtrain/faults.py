"""Deliberate faults, for testing what users see when things break (never set in normal use).

``DDTRAIN_FAULT="rank=1,step=3,kind=raise"`` makes rank 1 fail at the start of step 3 (counted
over the whole run). Kinds: ``raise`` (an exception), ``exit`` (``os._exit(3)``), ``kill``
(SIGKILL to itself), ``hang`` (sleep, holding up its peers). A fault fires only in the first
attempt of a job (``TORCHELASTIC_RESTART_COUNT`` 0), so restarted workers run clean.
"""
from __future__ import annotations

import os
import signal
import time

from .errors import DDTrainError

KINDS = ("raise", "exit", "kill", "hang")


class InjectedFault(RuntimeError):
    """Raised by a ``kind=raise`` fault."""


def _parse(text: str) -> dict:
    spec = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
    try:
        rank, step = int(spec["rank"]), int(spec["step"])
    except (KeyError, ValueError):
        raise DDTrainError(f"DDTRAIN_FAULT={text!r}: expected rank=R,step=S,kind=K") from None
    kind = spec.get("kind", "raise")
    if kind not in KINDS:
        raise DDTrainError(f"DDTRAIN_FAULT kind {kind!r}: valid: {', '.join(KINDS)}")
    return {"rank": rank, "step": step, "kind": kind}


_fault = _parse(os.environ["DDTRAIN_FAULT"]) if os.environ.get("DDTRAIN_FAULT") else None


def maybe_inject(step: int, rank: int) -> None:
    """Called at the start of every training step; does nothing unless DDTRAIN_FAULT matches."""
    if _fault is None or _fault["rank"] != rank or _fault["step"] != step:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    kind = _fault["kind"]
    if kind == "raise":
        raise InjectedFault(f"rank {rank} deliberately failed at step {step} (DDTRAIN_FAULT)")
    if kind == "exit":
        os._exit(3)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(10 ** 6)
