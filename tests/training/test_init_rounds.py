"""``ddtrain.init()``, ``prepare()``, ``shutdown()`` repeated in one process (a notebook, a sweep in one script).

Issue 32: the second round hung on 2 ranks (under ``ddtrain run`` and with plain RANK/WORLD_SIZE
variables alike): the rendezvous store outlives a process group (torchrun's agent's store, or
rank 0's multi-tenant server), so the second group's rank-connection keys were the first
group's, and a rank dialled the other's closed sockets. Each round now meets under a key prefix
of its own (``distributed.rendezvous.connect``).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO

ROUNDS = """
import sys, torch, ddtrain
from torch.utils.data import DataLoader, TensorDataset
for round_ in range(3):
    ddtrain.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    model, optimizer, data = ddtrain.prepare(model, optimizer, data)
    for x, y in data:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    print(f"rank {ddtrain.rank()} round {round_} of {ddtrain.world_size()} done", flush=True)
    ddtrain.shutdown()
"""


@pytest.mark.slow
def test_three_rounds_of_init_prepare_shutdown_on_two_ranks_finish(tmp_path):
    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "DDTRAIN_TIMEOUT_S": "30"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "ddtrain", "run", "--nproc", "2", str(script)],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        for round_ in range(3):
            assert f"rank {rank} round {round_} of 2 done" in result.stdout, result.stdout + result.stderr[-2000:]
