"""Rank 0's console output: a progress bar while an epoch runs, one Keras-style line per epoch."""
from __future__ import annotations

import sys
import time


class ProgressBar:
    """A one-line bar on stderr, redrawn at most 5 times a second; silent when not a terminal."""

    def __init__(self, total: int, label: str, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0 and self.stream.isatty()
        self.total, self.label, self.last, self.start = total, label, 0.0, time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last < 0.2 and done < self.total:
            return
        self.last = now
        width = 30
        filled = int(width * done / self.total)
        bar = "=" * max(filled - 1, 0) + (">" if filled < width else "=") + "." * (width - filled)
        self.stream.write(f"\r{self.label} {done:>{len(str(self.total))}}/{self.total} [{bar}] "
                          f"{now - self.start:5.1f}s {note}\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


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
