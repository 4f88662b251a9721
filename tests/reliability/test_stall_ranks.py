"""A stall report names exactly the rank that is elsewhere or silent, and none of the ranks waiting beside it.

With 2 ranks the missing one is always "the other", so these run 3 and 4 ranks: ranks are made
to fail deliberately (one skips the collective, staying alive; one freezes, its heartbeat
stopping; or DDTRAIN_FAULT makes one skip in ``ddtrain train``) and every rank that timed out
must name exactly those ranks and none of the ranks waiting beside it.
"""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from ddtrain import comm
from ddtrain.reliability import stall
from multirank import RankError, run_ranks


def waiting_for(message: str) -> set[int]:
    """The ranks a stall message says it waits for (the part before the backend's own words in [...])."""
    head = message.split(" [", 1)[0]
    assert "; waiting for " in head, message
    return {int(r) for r in re.findall(r"\brank (\d+)", head.split("; waiting for ", 1)[1])}


def one_skips_one_freezes(skipper: int, frozen: int, timeout_s: float):
    """The other ranks enter a ring all-reduce at step 7; ``skipper`` stays alive elsewhere (its
    heartbeat on); ``frozen`` is at the same step and operation but silent (its heartbeat stopped)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    if rank == frozen:
        stall.Heartbeat._run = lambda self: None     # publishes its mark once, then falls silent
    stall.mark(7, "ring all-reduce of the gradients")  # the mark that one publication carries
    with stall.watched(what="strategy ring, backend gloo", timeout_s=timeout_s, period_s=0.2):
        if rank in (skipper, frozen):
            if rank == skipper:
                stall.mark(7, "a data-dependent branch that skips the all-reduce")
            time.sleep(timeout_s + 2)  # alive, but not in the collective
            return "away"
        time.sleep(0.5)                # every rank's mark published at least once before anyone waits
        comm.all_reduce(torch.ones(1000), "ring", timeout_s=timeout_s)


@pytest.mark.slow  # 10 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_the_skipping_and_the_frozen_rank_are_named_and_their_waiting_peers_are_not():
    timeout_s = 7.0       # longer than the 5 s after which a mark counts as stale
    with pytest.raises(RankError) as caught:
        run_ranks(one_skips_one_freezes, 4, 2, 1, timeout_s)
    errors = caught.value.errors
    assert sorted(errors) == [0, 3], errors          # the two ranks that waited, and only they, report
    for rank, error in errors.items():
        message = error.splitlines()[0]
        assert message.startswith("StallError: stalled at step 7 in ring all-reduce of the gradients"), message
        assert waiting_for(message) == {1, 2}, (rank, message)
        assert "rank 2 (at step 7: a data-dependent branch that skips the all-reduce" in message, message
        assert re.search(r"rank 1 \(silent for \d+ s; last at step 7: ring all-reduce", message), message


@pytest.mark.slow  # 15 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_ddtrain_train_on_3_ranks_names_only_the_rank_the_fault_made_skip():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDTRAIN_FAULT": "rank=1,step=3,kind=skip"}
    env.pop("RANK", None)
    result = subprocess.run([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits",
                             "--nproc", "3", "--epochs", "1", "--batch-size", "32", "--timeout", "5"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0, result.stderr
    stalls = [line for line in result.stderr.splitlines() if "stalled at step 3" in line]
    assert stalls, result.stderr
    for line in stalls:
        assert not line.startswith("[rank 1]"), line
        assert waiting_for(line) == {1}, line
    assert "Traceback" not in result.stderr
