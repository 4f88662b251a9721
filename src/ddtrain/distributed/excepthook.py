"""One traceback per distinct error across the ranks of a job (a user's script under torchrun, srun, mpirun).

When every rank raises the same exception (a typo, a wrong path, a shape mismatch), each prints
the same traceback and the user reads N interleaved copies of it. ``runtime.init`` installs this
hook in a job of several ranks: the first rank to report an error at a given place (the chain
of frames and the exception's type; the message may differ from rank to rank) prints its
traceback in full, and every other rank with the same error prints one line with its own
message, naming that rank. A rank whose error is different prints its own traceback in full.

The ranks agree through the job's store (``compare_set``: the first writer wins), which every
rank already reaches. If the store cannot be reached (its host, rank 0 or the launcher's agent,
is gone), the rank prints its traceback as Python would: a copy too many, never one too few.
"""
from __future__ import annotations

import datetime
import hashlib
import sys
import traceback

KEY_PREFIX = "ddtrain/excepthook/"
STORE_DEADLINE_S = 5.0     # the store answers in milliseconds; a store that does not is gone

_installed = False


def error_key(exc_type, tb) -> str:
    """Where the error happened: the exception's type and every frame's file, line and function."""
    frames = [f"{f.filename}:{f.lineno}:{f.name}" for f in traceback.extract_tb(tb)]
    text = "\n".join([exc_type.__qualname__, *frames])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def first_reporter(store, key: str, rank: int) -> int:
    """The rank that reported the error ``key`` first: ``rank`` itself if nobody did before it."""
    store.set_timeout(datetime.timedelta(seconds=STORE_DEADLINE_S))
    winner = store.compare_set(KEY_PREFIX + key, "", str(rank))
    return int(winner.decode() if isinstance(winner, bytes) else winner)


def install(rank: int, store_of) -> None:
    """Wrap ``sys.excepthook`` for this process; ``store_of()`` returns the job's store (or raises)."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            return previous(exc_type, exc, tb)
        try:
            first = first_reporter(store_of(), error_key(exc_type, tb), rank)
        except Exception:               # the store is gone: print in full, as Python would
            first = rank
        if first == rank:
            return previous(exc_type, exc, tb)
        line = "".join(traceback.format_exception_only(exc_type, exc)).strip().replace("\n", " ")
        print(f"[rank {rank}] {line} (the same error at the same place as rank {first}, "
              f"whose traceback is printed)", file=sys.stderr, flush=True)

    sys.excepthook = hook
    _installed = True
