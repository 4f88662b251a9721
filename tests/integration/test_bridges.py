"""The bridges' examples with the real frameworks (docs/BRIDGES.md): Lightning, Fabric, Ray Train; 2 workers each.

Each example runs as a user runs it (a subprocess, the framework starting its own workers) and is
checked on what it reports: the hook really reduced the buckets on every rank, the replicas are
equal, the loss falls.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

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


RAY_DRIVER = """
import importlib.util, json, sys
import ray
spec = importlib.util.spec_from_file_location("ray_train", sys.argv[1])
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
try:
    first = example.main(["--workers", "2", "--epochs", "2", "--storage", sys.argv[2]])
    again = example.main(["--workers", "2", "--epochs", "3", "--storage", sys.argv[2] + "-again",
                          "--resume-from", first.checkpoint.path])
    history = first.metrics_dataframe
    print("RESULT " + json.dumps({"losses": list(history["loss"]), "workers": list(history["workers"]),
                                 "checkpoint": first.checkpoint.path, "resumed": again.metrics}))
finally:
    ray.shutdown()
"""


@pytest.mark.slow
def test_ray_train_workers_prepare_train_and_resume_from_a_save_state_checkpoint(tmp_path):
    pytest.importorskip("ray.train", reason="ray is optional (pip install 'ray[train]')")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    # Ray's session files (sockets among them: a short path) in a folder of the test's, not /tmp/ray
    ray_tmp = tempfile.mkdtemp(prefix="ray-")
    env.update(PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=ray_tmp)
    try:
        result = subprocess.run([sys.executable, "-c", RAY_DRIVER, str(EXAMPLES / "ray_train.py"),
                                 str(tmp_path / "store")], capture_output=True, text=True, timeout=540, env=env,
                                cwd=tmp_path)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    report = json.loads(line.removeprefix("RESULT "))
    print(report)
    assert report["workers"] == [2, 2]
    assert report["losses"][1] < report["losses"][0]
    # the checkpoint Ray kept is a ddtrain.save_state file: ddtrain's own reader takes it
    from ddtrain.reliability import checkpoint
    [saved] = [p for p in os.listdir(report["checkpoint"]) if p.startswith("ckpt-")]
    assert checkpoint.read_header(os.path.join(report["checkpoint"], saved))[0]["kind"] == checkpoint.STATE_KIND
    # resumed from it: only the third epoch trained, starting where the state stood
    assert report["resumed"]["first_epoch"] == 2 and report["resumed"]["epoch"] == 2
    assert report["resumed"]["loss"] < report["losses"][0]


@pytest.mark.slow
def test_comm_hook_example_under_torchrun_trains_and_resumes_its_hook_state(tmp_path):
    """examples/bridges/comm_hook_ddp.py as its docstring runs it: 3 ranks, fp16 over butterfly, saved and resumed."""
    from multirank import free_port
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=f"{REPO / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    checkpoint = tmp_path / "ck.pt"
    outputs = []
    for epochs in ("2", "1"):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                              "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLES / "comm_hook_ddp.py"),
                              "--algorithm", "butterfly", "--compression", "topk:0.3", "--epochs", epochs,
                              "--checkpoint", str(checkpoint)], capture_output=True, text=True, timeout=300, env=env,
                             cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        outputs.append(run.stdout)
    print("".join(outputs))
    losses = [float(x) for x in re.findall(r"epoch \d+ loss ([0-9.]+)", "".join(outputs))]
    assert re.findall(r"epoch (\d+) loss", "".join(outputs)) == ["0", "1", "2"]   # the second start went on at 2
    assert losses[2] < losses[0]
    assert sorted(p.name for p in tmp_path.glob("ck.pt.rank*")) == ["ck.pt.rank0", "ck.pt.rank1", "ck.pt.rank2"]
    sent = re.findall(r"rank \d: (\d+) bytes sent by the hook", outputs[1])
    assert len(sent) == 3 and all(int(b) > 0 for b in sent)
