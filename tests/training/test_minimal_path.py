"""The same script runs unchanged as one process and under plain torchrun (acceptance 4)."""
import os
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPT = REPO / "examples" / "minimal.py"


def _run(cmd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # 10 s here (--durations, 2026-11-28): keeps the default tier under 10 min
def test_one_process_and_torchrun_run_the_same_script():
    single = _run([sys.executable, str(SCRIPT), "--epochs", "1"])
    assert single.returncode == 0, single.stderr
    assert "world size 1" in single.stdout and "1797 samples" in single.stdout
    port = str(29500 + os.getpid() % 1000)
    multi = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                  str(SCRIPT), "--epochs", "1"])
    assert multi.returncode == 0, multi.stderr
    lines = [line for line in multi.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 1 and "world size 2" in lines[0] and "899 samples" in lines[0]
