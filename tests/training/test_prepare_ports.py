"""examples/ports: four scripts, each as plain DDP and ported to ddtrain, give the same numbers.

On 2 Gloo ranks, each pair runs on a small slice of the bundled digits (256 training, 64 test
images): the ported script with ``ddp`` and ``ring`` must print the losses and accuracies of
its plain-DDP twin to 1e-6, including a resume from a snapshot or checkpoint (the port also
resumes from the twin's checkpoint, saved with DDP's ``module.`` keys). Then the ported
scripts run unchanged as one process and under ``torchrun --nproc-per-node 2``.
"""
import os
import subprocess
import sys

import pytest

from helpers import REPO
from multirank import run_ranks

PORTS = REPO / "examples" / "ports"
SLICE = ["--train-samples", "256", "--test-samples", "64"]
SCRIPTS = ["mnist_steplr", "trainer_snapshot", "imagenet_style", "horovod_mnist"]


def run_script(module, extra, tag, resume_from=None):
    """``module.main`` as the test runs it: with a resume for the two scripts that have one."""
    import torch.distributed as dist

    import ddtrain
    if module.__name__.startswith("trainer_snapshot"):       # 2 epochs, then a resumed third from the snapshot
        history = module.main(SLICE + extra + ["--epochs", "2", "--snapshot-path", f"{tag}.pt"])
        ddtrain.shutdown()
        dist.barrier()         # a restart: rank 0's snapshot is written before any rank looks for it
        history += module.main(SLICE + extra + ["--epochs", "3", "--snapshot-path", f"{tag}.pt"])
    elif module.__name__.startswith("imagenet_style"):       # 1 epoch, then --resume for the second
        history = module.main(SLICE + extra + ["--epochs", "1", "--checkpoint", f"{tag}.pt"])
        ddtrain.shutdown()
        dist.barrier()
        history += module.main(SLICE + extra + ["--epochs", "2", "--checkpoint", f"{tag}-2.pt",
                                                "--resume", resume_from or f"{tag}.pt"])
    else:
        history = module.main(SLICE + extra)
    ddtrain.shutdown()
    return history


def run_pair(script: str, strategies, workdir: str):
    """On every rank: the plain-DDP twin's history, and the port's for each strategy.

    The imagenet-style port resumes from the twin's checkpoint, saved with DDP's ``module.`` keys.
    """
    import importlib
    sys.path.insert(0, str(PORTS))
    plain, port = (importlib.import_module(f"{script}_{kind}") for kind in ("ddp", "ddtrain"))
    twin_tag = f"{workdir}/{script}-plain-twin"
    twin = run_script(plain, [], twin_tag)
    return twin, {strategy: run_script(port, ["--strategy", strategy], f"{workdir}/{script}-{strategy}",
                                       resume_from=f"{twin_tag}.pt")
                  for strategy in strategies}


def _same(plain, port, tolerance=1e-6):
    assert len(plain) == len(port) > 0
    for a, b in zip(plain, port):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                assert abs(a[key] - b[key]) <= tolerance * max(1.0, abs(a[key])), (key, a[key], b[key])
        else:
            assert abs(a - b) <= tolerance * max(1.0, abs(a)), (a, b)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_port_gives_the_numbers_of_its_plain_ddp_twin(script, tmp_path):
    for twin, ports in run_ranks(run_pair, 2, script, ["ddp", "ring"], str(tmp_path), timeout_s=240):
        for history in ports.values():
            _same(twin, history)


def _run(cmd):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1"},
                          cwd=REPO)


@pytest.mark.slow
def test_the_ports_run_as_one_process_and_under_torchrun(tmp_path):
    for script in SCRIPTS:
        args = [str(PORTS / f"{script}_ddtrain.py"), *SLICE, "--epochs", "1"]
        if script == "trainer_snapshot":
            args += ["--snapshot-path", str(tmp_path / "snapshot.pt")]
        if script == "imagenet_style":
            args += ["--checkpoint", str(tmp_path / "checkpoint.pt")]
        single = _run([sys.executable, *args])
        assert single.returncode == 0, single.stderr
        assert "epoch" in single.stdout
        if script == "trainer_snapshot":
            (tmp_path / "snapshot.pt").unlink()
    port = str(29500 + os.getpid() % 1000)
    multi = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                  str(PORTS / "mnist_steplr_ddtrain.py"), *SLICE, "--epochs", "1", "--strategy", "ring"])
    assert multi.returncode == 0, multi.stderr
    assert len([line for line in multi.stdout.splitlines() if line.startswith("epoch")]) == 1   # rank 0 speaks


@pytest.mark.slow
def test_the_trainer_snapshot_commands_as_written_resume_and_say_so(tmp_path):
    """Issue 32: the docstring's second command (torchrun on the same --snapshot-path) found a snapshot holding
    every epoch and silently did nothing. It now asks for more epochs and resumes, saying where; a run with
    nothing left to train says so."""
    snapshot = str(tmp_path / "snapshot.pt")
    script = str(PORTS / "trainer_snapshot_ddtrain.py")
    first = _run([sys.executable, script, "--snapshot-path", snapshot, "--epochs", "3"])
    assert first.returncode == 0 and "epoch 2:" in first.stdout, first.stderr[-2000:]
    port = str(29500 + os.getpid() % 1000)
    second = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                   script, "--snapshot-path", snapshot, "--epochs", "5"])
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"resuming from snapshot {snapshot} at epoch 3" in second.stdout and "epoch 4:" in second.stdout
    again = _run([sys.executable, script, "--snapshot-path", snapshot, "--epochs", "5"])
    assert again.returncode == 0 and "already holds 5 epoch(s) of 5: nothing to train" in again.stdout, again.stdout
