"""Spans of time on this rank (data, compute, optimizer, communication) for timelines.

Off by default and then free: ``enabled()`` is one attribute read. ``start()`` turns it on;
the training loop and the communication layer then ``add`` spans with ``time.perf_counter``
times, and ``events()`` returns them (ddtrain.observe.timeline merges ranks onto one clock).
"""
from __future__ import annotations

import time
from contextlib import contextmanager

_events: list[dict] | None = None


def enabled() -> bool:
    return _events is not None


def start() -> None:
    global _events
    _events = []


def stop() -> list[dict]:
    global _events
    events, _events = _events or [], None
    return events


def events() -> list[dict]:
    return list(_events or [])


def add(name: str, start_s: float, end_s: float, category: str = "train", **args) -> None:
    if _events is not None:
        _events.append({"name": name, "cat": category, "start_s": start_s, "end_s": end_s, "args": args})


@contextmanager
def span(name: str, category: str = "train", **args):
    if _events is None:
        yield
        return
    begin = time.perf_counter()
    try:
        yield
    finally:
        add(name, begin, time.perf_counter(), category, **args)
