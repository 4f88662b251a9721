"""Progress: a tqdm bar with rate and ETA on a terminal, a plain line every PLAIN_EVERY_S seconds in a log (issue 16, 22)."""
import io

import pytest

from ddtrain.training.progress import ProgressBar


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_log_gets_a_plain_line_every_interval_with_rate_and_eta():
    clock, log = Clock(), io.StringIO()
    bar = ProgressBar(100, "Epoch 1/2", stream=log, plain_stream=log, every_s=30, clock=clock)
    calls = []
    for step in range(1, 101):
        clock.now = step * 1.0                      # one step a second
        bar.update(step, lambda: calls.append(step) or f"loss {1 / step:.4f}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines == ["Epoch 1/2: step 30/100 (30%) - 0:30 elapsed - 1.00 steps/s - ETA 1:10 - loss 0.0333",
                     "Epoch 1/2: step 60/100 (60%) - 1:00 elapsed - 1.00 steps/s - ETA 0:40 - loss 0.0167",
                     "Epoch 1/2: step 90/100 (90%) - 1:30 elapsed - 1.00 steps/s - ETA 0:10 - loss 0.0111"]
    assert calls == [30, 60, 90]                    # the note (a device sync) only when a line is written


def test_a_terminal_gets_a_tqdm_bar_and_a_disabled_bar_writes_nothing():
    pytest.importorskip("tqdm")
    term = Terminal()
    bar = ProgressBar(50, "Epoch 1/1", stream=term)
    for step in range(1, 51):
        bar.update(step, "loss 0.5")
    bar.bar.refresh()                               # tqdm redraws at most every 0.2 s; this loop is faster
    text = term.getvalue()
    bar.close()
    assert "Epoch 1/1" in text and "50/50" in text and "step/s" in text and "loss 0.5" in text, text
    quiet = io.StringIO()
    off = ProgressBar(50, "Epoch 1/1", enabled=False, stream=quiet, plain_stream=quiet, every_s=0)
    off.update(10, "loss")
    assert quiet.getvalue() == ""
