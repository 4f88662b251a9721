"""The progress watchdog: the path that names an NCCL hang before NCCL's own abort, run on Gloo.

On NCCL a rank that skips a collective leaves its peers blocked without an exception, and NCCL's
watchdog would abort them with a generic message at the process group's timeout. ddtrain's
watchdog fires first, at the deadline, and names the step, the operation and the rank that is
elsewhere. ``DDTRAIN_WATCHDOG=1`` runs exactly that path on Gloo (whose own timeout is then
padded like NCCL's), with three ranks, so "which rank" is not simply "the other one".
"""
import time

import pytest

from helpers import run_skip_fault
from ddtrain.reliability import stall
from ddtrain.reliability.watchdog import ProgressWatchdog


@pytest.mark.slow
def test_watchdog_names_the_rank_that_skipped_within_the_deadline():
    deadline = 6
    # the padded backend timeout (deadline + 30 s) would come far later: the watchdog ends the job
    code, lines, took = run_skip_fault(3, 2, deadline, DDTRAIN_WATCHDOG="1")
    stderr = "\n".join(lines)
    assert code != 0, stderr
    assert took <= deadline + 10, f"{took:.1f} s\n{stderr}"
    stalls = [line for line in lines if "stalled" in line]
    assert len(stalls) == 1, stderr
    assert "no progress within the 6 s deadline; waiting for rank 2 (at step 3: skipping every collective" \
        in stalls[0], stalls[0]
    assert "stalled at step 3 in forward+backward" in stalls[0], stalls[0]
    assert "rank 0 (" not in stalls[0] and "rank 1 (" not in stalls[0], stalls[0]  # only the one elsewhere
    assert "Traceback" not in stderr


def test_a_healthy_run_longer_than_the_deadline_is_never_called_stalled():
    """The deadline is on the time since the last progress mark, not since the start: marks every 50 ms for three
    deadlines must not fire it (a clock never restarted would kill every long healthy job); then no mark for one
    deadline must. One process, the firing recorded instead of ending it."""
    deadline = 0.6
    fired = []
    watchdog = ProgressWatchdog(what="test", deadline_s=deadline, rank=0, ranks=[0], period_s=0.05)
    watchdog._fire = lambda step, op: fired.append((step, time.monotonic()))
    saved = stall.where()
    try:
        with watchdog:
            start = time.monotonic()
            step = 0
            while time.monotonic() - start < 3 * deadline:
                step += 1
                stall.mark(step, "forward+backward")
                last_mark = time.monotonic()
                time.sleep(0.05)
            assert fired == [], f"fired at step {fired[0][0]} after {fired[0][1] - start:.2f} s of healthy progress"
            stopped = time.monotonic()
            while not fired and time.monotonic() - stopped < 5 * deadline:
                time.sleep(0.02)
    finally:
        stall.mark(*saved)
    assert fired and fired[0][0] == step
    assert deadline <= fired[0][1] - last_mark < deadline + 1.0
