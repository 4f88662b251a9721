"""A worker or server that dies mid-step stops the others, with an error naming it, within the timeout (acceptance 6).

In the pool the failing rank raises (``DDTRAIN_FAULT`` kind ``raise``) and stays alive with its
connections open, so its peers learn of it only through their deadlines: the hardest case.
Through ``ddtrain train`` a worker is SIGKILLed mid-run, so its connections close at once.
"""
import os
import re
import subprocess
import sys
import time

import pytest

from ddtrain import TrainConfig, fit
from ddtrain.reliability import faults
from ddtrain.distributed import runtime
from ddtrain.sync.ps.worker import WORKER_MARGIN_S
from multirank import RankError, run_ranks
from helpers import tiny_data as _data, tiny_model as _model

TIMEOUT_S = 3.0


def train_with_fault(strategy, fault_rank, fault_step, staleness=4):
    """Train with a 3 s timeout while ``fault_rank`` raises at ``fault_step`` (its update count on a server)."""
    runtime.init()
    saved_fault, saved_timeout = faults._fault, runtime._state.timeout_s
    faults._fault = {"rank": fault_rank, "step": fault_step, "kind": "raise"}
    runtime._state.timeout_s = TIMEOUT_S
    try:
        model, shape = _model("mlp")
        bound = {"staleness": staleness} if strategy == "ps-async" else {}   # ps-sync reads no staleness (refused)
        config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy=strategy, epochs=2, batch_size=8, lr=0.1,
                                       seed=3, val_fraction=0.0, quiet=True, **bound)
        fit(model, _data(shape), config)
    except Exception as exc:
        exc.add_note(f"failed at {time.time():.3f}")   # when each rank gave up, for the timing check
        raise
    finally:
        faults._fault, runtime._state.timeout_s = saved_fault, saved_timeout


def first_lines(errors: dict) -> dict:
    return {rank: text.splitlines()[0] for rank, text in errors.items()}


def failed_at(errors: dict) -> dict:
    return {rank: float(re.search(r"failed at ([0-9.]+)", text).group(1)) for rank, text in errors.items()}


# ps-async with --staleness 0: worker 0 then waits on the server for worker 1's gradient. With
# more staleness it would run on alone to the epoch's end and wait for worker 1 in the loop's
# metrics all-reduce, where the process group's own timeout (60 s in this pool; --timeout in
# `ddtrain train`) and the stall report name the silent rank instead.
@pytest.mark.parametrize("strategy", ["ps-sync", "ps-async"])
def test_a_silent_worker_is_named_by_the_server_and_the_other_worker(strategy):
    with pytest.raises(RankError) as caught:
        run_ranks(train_with_fault, 3, strategy, 1, 2, 0, timeout_s=180)   # workers 0, 1; server 2
    lines, when = first_lines(caught.value.errors), failed_at(caught.value.errors)
    assert lines[1].startswith("InjectedFault: rank 1 deliberately failed at step 2"), lines
    assert f"{strategy}: parameter server rank 2: worker rank 1 failed or stopped answering" in lines[2], lines
    assert lines[0].startswith(f"DDTrainError: {strategy}: worker rank 1 failed or stopped answering "
                               "(reported by parameter server rank 2)"), lines
    # the server gives up one timeout after the silence began, the other worker right after it
    assert when[2] - when[1] <= TIMEOUT_S + 2 and when[0] - when[2] <= 2, when


@pytest.mark.slow  # 11 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_a_silent_server_is_named_by_every_worker():
    with pytest.raises(RankError) as caught:
        run_ranks(train_with_fault, 3, "ps-sync", 2, 3, timeout_s=180)
    lines, when = first_lines(caught.value.errors), failed_at(caught.value.errors)
    assert lines[2].startswith("InjectedFault: rank 2 deliberately failed at step 3"), lines
    for worker in (0, 1):
        assert "parameter server rank 2 did not answer step 3" in lines[worker], lines
        assert when[worker] - when[2] <= TIMEOUT_S + WORKER_MARGIN_S + 2, when


def test_a_killed_worker_stops_the_job_naming_it_within_the_timeout():
    deadline = 10
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDTRAIN_FAULT": "rank=1,step=3,kind=kill"}
    env.pop("RANK", None)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits",
                             "--nproc", "3", "--strategy", "ps-sync", "--epochs", "1", "--batch-size", "32",
                             "--timeout", str(deadline)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    named = [line for line in result.stderr.splitlines() if "rank 1" in line]
    assert named, result.stderr
    assert "Traceback" not in result.stderr
    print("\n".join(named))
    assert time.monotonic() - start <= 60
