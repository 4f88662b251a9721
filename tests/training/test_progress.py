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


def test_a_compile_is_said_before_it_and_left_out_of_rate_and_eta():
    """Issue 30: a 240 s compiled first step made the ETA 3:14:05; the ETA now comes from the steady steps."""
    clock, log = Clock(), io.StringIO()
    bar = ProgressBar(351, "Epoch 1/3", stream=log, plain_stream=log, every_s=30, clock=clock)
    bar.phase("compiling the model")
    assert log.getvalue() == "Epoch 1/3: compiling the model... 0:00 so far\n"
    bar._timer.cancel()                             # the repeat is tested with a real clock below
    clock.now = 240.0
    bar.update(1)                                   # the compiled first step ends after four minutes
    for step in range(2, 160):
        clock.now = 240.0 + (step - 1) * 0.25       # then 4 steps a second
        bar.update(step)
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[1:] == [
        "Epoch 1/3: step 1/351 (0%) - 4:00 elapsed - first step 4:00 (compiling the model)",
        # (351 - 121) / 4 steps/s = 57.5 s; with the compile in the rate (121 / 270 s) it was 8:33
        "Epoch 1/3: step 121/351 (34%) - 4:30 elapsed - first step 4:00 (compiling the model) - 4.00 steps/s - ETA 0:58"]


def test_the_waiting_line_repeats_until_the_first_step_ends():
    import time
    log = io.StringIO()
    bar = ProgressBar(10, "Epoch 1/1", stream=log, plain_stream=log, every_s=0.05)
    bar.phase("compiling the model")
    time.sleep(0.3)
    bar.update(1)
    waiting = log.getvalue().count("compiling the model...")
    time.sleep(0.2)
    bar.close()
    assert waiting >= 3 and log.getvalue().count("compiling the model...") == waiting   # stopped at the first step


def test_a_terminal_bar_restarts_its_clock_after_the_first_step():
    pytest.importorskip("tqdm")
    clock, term = Clock(), Terminal()
    bar = ProgressBar(100, "Epoch 1/1", stream=term, clock=clock)
    bar.phase("compiling the model")
    assert "compiling the model..." in term.getvalue()
    bar.update(1)
    assert bar.bar.n == 1 and "first step" in bar.bar.postfix
    bar.update(50)
    assert bar.bar.n == 50
    bar.close()
