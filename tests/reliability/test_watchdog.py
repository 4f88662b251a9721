"""The progress watchdog: the path that names an NCCL hang before NCCL's own abort, run on Gloo.

On NCCL a rank that skips a collective leaves its peers blocked without an exception, and NCCL's
watchdog would abort them with a generic message at the process group's timeout. ddtrain's
watchdog fires first, at the deadline, and names the step, the operation and the rank that is
elsewhere. ``DDTRAIN_WATCHDOG=1`` runs exactly that path on Gloo (whose own timeout is then
padded like NCCL's), with three ranks, so "which rank" is not simply "the other one".
"""
import pytest

from helpers import run_skip_fault


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
