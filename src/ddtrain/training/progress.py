"""Rank 0's console output: progress while an epoch runs, one Keras-style line per epoch.

On a terminal the progress is a tqdm bar (rate, elapsed time and ETA; ``pip install tqdm``, in
the ``progress`` extra); in a log file or CI, where a redrawn bar is noise and silence for
minutes looks like a hang, it is a plain line every ``PLAIN_EVERY_S`` seconds with the same
figures. Without tqdm a terminal gets the plain lines too.

The rate and the ETA come from the steady steps: a bar's first step is left out of them (it
holds the compile under ``--compile``, and the loader processes' start), so a four-minute
compile no longer predicts hours (issue 30). ``phase(text)`` says what a long wait is before it
happens (``compiling the model``), on a log repeated every ``PLAIN_EVERY_S`` seconds until the
first step ends; the lines after it give the first step's time apart.
"""
from __future__ import annotations

import sys
import threading
import time

PLAIN_EVERY_S = 30.0     # seconds between plain progress lines (logs, CI)


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """Progress of ``total`` steps: a tqdm bar on a terminal, else a plain line every ``every_s`` seconds.

    ``update(done, note)`` takes the steps done so far and a note, or a function that makes it
    (called only when the note is shown: reading the loss waits for the device); ``close()`` ends
    it. Disabled (``enabled`` False) it does nothing, as on every rank but 0.
    """

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None, *, every_s: float = PLAIN_EVERY_S,
                 clock=time.perf_counter, plain_stream=None, unit: str = "step"):
        self.stream = stream or sys.stderr
        self.total, self.label, self.every_s, self.clock, self.unit = total, label, every_s, clock, unit
        self.enabled = enabled and total > 0
        self.start = self.last = clock()
        self.done, self.bar = 0, None
        self.first_done = self.first_at = None    # the first update: the steady rate is measured from it
        self.waiting, self._timer = None, None    # phase(): what the first step is waiting for
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        tqdm = _tqdm() if self.enabled and self.terminal else None
        if tqdm is not None:
            self.bar = tqdm(total=total, desc=label, file=self.stream, unit=unit, dynamic_ncols=True,
                            mininterval=0.2, leave=False)
        # plain lines go where the epoch lines go (stdout), so a log reads in order
        self.plain = plain_stream if plain_stream is not None else (self.stream if self.terminal else sys.stdout)

    def phase(self, text: str) -> None:
        """Say now what the coming first step waits for (``compiling the model``); repeated on a log until it ends."""
        if not self.enabled:
            return
        self.waiting = text
        if self.bar is not None:
            self.bar.set_postfix_str(text + "...", refresh=True)
            return
        self._say_waiting()

    def _say_waiting(self) -> None:
        if self.waiting is None:
            return
        self.plain.write(f"{self.label}: {self.waiting}... {_duration(self.clock() - self.start)} so far\n")
        self.plain.flush()
        if self.every_s < float("inf"):
            self._timer = threading.Timer(self.every_s, self._say_waiting)
            self._timer.daemon = True
            self._timer.start()

    def _first(self, done: int, now: float) -> None:
        """The first update: the steady rate starts here; tqdm's clock too (its rate then leaves the first step out)."""
        self.first_done, self.first_at = done, now
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.bar is not None:
            first = now - self.start
            self.bar.reset(total=self.total)
            if self.waiting:
                self.bar.set_postfix_str(f"first step {_duration(first)} ({self.waiting})", refresh=False)

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self.first_at is None and done > 0:
            self._first(done, now)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.done = done
            if note:
                self.bar.set_postfix_str(note() if callable(note) else note, refresh=False)
            return
        self.done = done
        if now - self.last >= self.every_s and done < self.total:
            self.last = now
            self.plain.write(self.line(now, note() if callable(note) else note) + "\n")
            self.plain.flush()

    def rate(self, now: float) -> float | None:
        """Steps per second over the steady steps (those after the first update); None before there are any."""
        if self.first_at is None or self.done <= self.first_done or now <= self.first_at:
            return None
        return (self.done - self.first_done) / (now - self.first_at)

    def line(self, now: float, note: str = "") -> str:
        """``Epoch 1/3: step 120/351 (34%) - 0:41 elapsed - 2.9 steps/s - ETA 1:19 - loss 1.9820``.

        Rate and ETA leave the first step out; after a ``phase`` its time is given apart
        (``first step 4:00 (compiling the model)``).
        """
        rate = self.rate(now)
        parts = [f"{self.label}: {self.unit} {self.done}/{self.total} ({100 * self.done / self.total:.0f}%)",
                 f"{_duration(now - self.start)} elapsed"]
        if self.waiting and self.first_at is not None:
            parts.append(f"first {self.unit} {_duration(self.first_at - self.start)} ({self.waiting})")
        if rate is not None:
            parts += [f"{rate:.2f} {self.unit}s/s", f"ETA {_duration((self.total - self.done) / rate)}"]
        if note:
            parts.append(note)
        return " - ".join(parts)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def epoch_line(epoch: int, epochs: int, logs: dict) -> str:
    """``Epoch 2/5 - 94 steps - 3.2s - loss: 0.4123 - accuracy: 0.8812 - val_loss: ... - 2941 samples/s``."""
    parts = [f"Epoch {epoch}/{epochs}", f"{logs['steps']} steps", f"{logs['time_s']:.1f}s",
             f"loss: {logs['train_loss']:.4f}"]
    if logs.get("train_accuracy") is not None:
        parts.append(f"accuracy: {logs['train_accuracy']:.4f}")
    if logs.get("val_loss") is not None:
        parts.append(f"val_loss: {logs['val_loss']:.4f}")
    if logs.get("val_accuracy") is not None:
        parts.append(f"val_accuracy: {logs['val_accuracy']:.4f}")
    parts.append(f"{logs['samples_per_s']:.0f} samples/s")
    return " - ".join(parts)
