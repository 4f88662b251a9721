"""The progress watchdog: the path that names an NCCL hang before NCCL's own abort, run on Gloo.

On NCCL a rank that skips a collective leaves its peers blocked without an exception, and NCCL's
watchdog would abort them with a generic message at the process group's timeout. ddtrain's
watchdog fires first, at the deadline, and names the step, the operation and the rank that is
elsewhere. ``DDTRAIN_WATCHDOG=1`` runs exactly that path on Gloo (whose own timeout is then
padded like NCCL's), with three ranks, so "which rank" is not simply "the other one".
"""
import os
import subprocess
import sys
import time

import pytest


def ddtrain_env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_watchdog_names_the_rank_that_skipped_within_the_deadline():
    deadline = 6
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits",
                             "--nproc", "3", "--epochs", "1", "--batch-size", "32", "--timeout", str(deadline)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ddtrain_env(DDTRAIN_FAULT="rank=2,step=3,kind=skip", DDTRAIN_WATCHDOG="1"))
    lines, fired = [], None
    for line in proc.stderr:
        lines.append(line.rstrip())
        if fired is None and "DDTRAIN_FAULT: skipping" in line:
            fired = time.monotonic()
    code = proc.wait(timeout=120)
    ended = time.monotonic()
    stderr = "\n".join(lines)
    assert code != 0 and fired is not None, stderr
    # the padded backend timeout (deadline + 30 s) would come far later: the watchdog ended the job
    assert ended - fired <= deadline + 10, f"{ended - fired:.1f} s\n{stderr}"
    stalls = [line for line in lines if "stalled" in line]
    assert len(stalls) == 1, stderr
    assert "no progress within the 6 s deadline; waiting for rank 2 (at step 3: skipping every collective" \
        in stalls[0], stalls[0]
    assert "stalled at step 3 in forward+backward" in stalls[0], stalls[0]
    assert "rank 0 (" not in stalls[0] and "rank 1 (" not in stalls[0], stalls[0]  # only the one elsewhere
    assert "Traceback" not in stderr
