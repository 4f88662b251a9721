"""The bridges' examples with the real frameworks (docs/BRIDGES.md): Lightning, Fabric, Ray Train; 2 workers each.

Each example runs as a user runs it (a subprocess, the framework starting its own workers) and is
checked on what it reports: the hook really reduced the buckets on every rank, the replicas are
equal, the loss falls.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

EXAMPLES = REPO / "examples" / "bridges"


def run_example(name, *args, timeout=300, cwd=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update(PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


@pytest.mark.slow
def test_lightning_ddp_strategy_with_comm_hook_trains_on_two_workers(tmp_path):
    pytest.importorskip("lightning", reason="lightning is optional (pip install lightning)")
    out = tmp_path / "lightning.json"
    result = run_example("lightning_ddp.py", "--devices", "2", "--algorithm", "tree", "--compression", "powersgd:2",
                         "--out", str(out), cwd=tmp_path)
    print(result.stdout.strip().splitlines()[-1])
    report = json.loads(out.read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["buckets_reduced"] > 0 and r["bytes_sent"] > 0 for r in report["ranks"])   # the hook ran, on CPU
    assert report["ranks"][0]["parameters"] == report["ranks"][1]["parameters"]
    assert report["last_loss"] < 0.5 * report["first_loss"]


@pytest.mark.slow
def test_prepare_inside_a_fabric_script_trains_on_two_workers(tmp_path):
    pytest.importorskip("lightning", reason="lightning is optional (pip install lightning)")
    result = run_example("fabric_prepare.py", "--devices", "2", "--strategy", "butterfly", cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"2 workers: epoch \d+ loss ([0-9.]+)", result.stdout)]
    print(result.stdout.strip().splitlines()[-1])
    assert len(losses) == 3 and losses[-1] < 0.5 * losses[0], result.stdout
