"""Rank 0's console output: progress while an epoch runs, one Keras-style line per epoch.

On a terminal the progress is a tqdm bar (rate, elapsed time and ETA; ``pip install tqdm``, in
the ``progress`` extra); in a log file or CI, where a redrawn bar is noise and silence for
minutes looks like a hang, it is a plain line every ``PLAIN_EVERY_S`` seconds with the same
figures. Without tqdm a terminal gets the plain lines too.
"""
from __future__ import annotations

import sys
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
                 clock=time.perf_counter, plain_stream=None):
        self.stream = stream or sys.stderr
        self.total, self.label, self.every_s, self.clock = total, label, every_s, clock
        self.enabled = enabled and total > 0
        self.start = self.last = clock()
        self.done, self.bar = 0, None
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        tqdm = _tqdm() if self.enabled and self.terminal else None
        if tqdm is not None:
            self.bar = tqdm(total=total, desc=label, file=self.stream, unit="step", dynamic_ncols=True,
                            mininterval=0.2, leave=False)
        # plain lines go where the epoch lines go (stdout), so a log reads in order
        self.plain = plain_stream if plain_stream is not None else (self.stream if self.terminal else sys.stdout)

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.done = done
            if note:
                self.bar.set_postfix_str(note() if callable(note) else note, refresh=False)
            return
        self.done = done
        now = self.clock()
        if now - self.last >= self.every_s and done < self.total:
            self.last = now
            self.plain.write(self.line(now, note() if callable(note) else note) + "\n")
            self.plain.flush()

    def line(self, now: float, note: str = "") -> str:
        """``Epoch 1/3: step 120/351 (34%) - 0:41 elapsed - 2.9 steps/s - ETA 1:19 - loss 1.9820``."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.label}: step {self.done}/{self.total} ({100 * self.done / self.total:.0f}%)",
                 f"{_duration(elapsed)} elapsed", f"{rate:.2f} steps/s"]
        if rate > 0:
            parts.append(f"ETA {_duration((self.total - self.done) / rate)}")
        if note:
            parts.append(note)
        return " - ".join(parts)

    def close(self) -> None:
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
