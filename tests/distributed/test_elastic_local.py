"""``ddtrain train --nproc 2:3`` on one machine: a worker SIGKILLed at step 6 (after the checkpoint of
step 4) and the job goes on with 2 workers from step 4, without user action; its parameters equal a run
resized at step 4 on purpose (3 workers with --steps 4, then --resume on 2) and its record lists both
memberships. Slow tier: three launches (~20 s each on 2 loaded cores).
"""
from __future__ import annotations

import json

import pytest
import torch

from helpers import assert_same_parameters, ddtrain

TRAIN = ["train", "--model", "mlp", "--data", "digits", "--global-batch-size", "48", "--lr", "0.05",
         "--momentum", "0.9", "--seed", "1", "--checkpoint-every", "4"]
ENV = {"OMP_NUM_THREADS": "1", "DDTRAIN_TIMEOUT_S": "60"}


@pytest.mark.slow
def test_nproc_3_to_2_after_a_killed_worker_equals_a_resize_on_purpose(tmp_path):
    elastic = ddtrain(*TRAIN, "--nproc", "2:3", "--steps", "12", "--checkpoint-dir", str(tmp_path / "ck"),
                      "--save", str(tmp_path / "elastic.pt"), "--out", str(tmp_path / "elastic.json"),
                      env={**ENV, "DDTRAIN_FAULT": "rank=2,step=6,kind=kill"})
    assert elastic.returncode == 0, elastic.stderr[-3000:]
    assert "worker rank 2 was killed by SIGKILL; going on with 2 workers (--nproc 2:3) from the last checkpoint" \
        in elastic.stderr, elastic.stderr[-3000:]
    assert "ckpt-00000004.pt at step 4" in elastic.stdout + elastic.stderr
    first = ddtrain(*TRAIN, "--nproc", "3", "--steps", "4", "--checkpoint-dir", str(tmp_path / "ck2"), env=ENV)
    assert first.returncode == 0, first.stderr[-3000:]
    resized = ddtrain(*TRAIN, "--nproc", "2", "--steps", "12", "--checkpoint-dir", str(tmp_path / "ck2"), "--resume",
                      "--save", str(tmp_path / "resized.pt"), "--out", str(tmp_path / "resized.json"), env=ENV)
    assert resized.returncode == 0, resized.stderr[-3000:]
    assert_same_parameters(torch.load(tmp_path / "resized.pt"), torch.load(tmp_path / "elastic.pt"), rtol=1e-5)
    record = json.loads((tmp_path / "elastic.json").read_text())
    assert record["world_size"] == 2
    assert [(m["step"], m["world_size"], m["attempt"]) for m in record["membership"]] == [(0, 3, 0), (4, 2, 1)]
    assert record["membership"][1]["reason"] == "worker rank 2 was killed by SIGKILL: world size 3 -> 2"
    on_purpose = json.loads((tmp_path / "resized.json").read_text())["membership"]
    assert [(m["step"], m["world_size"], m["reason"]) for m in on_purpose] == \
        [(0, 3, "start"), (4, 2, "--resume at world size 2 (was 3)")]
