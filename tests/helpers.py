"""What several test modules share: paths, the small training problem of the equivalence tests, and
the ``ddtrain`` command run as a user runs it. Tests import from here, never from each other."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SHARED = REPO.parent / "shared"


N_SAMPLES = 96  # divisible by every R*B below, so no rank drops a sample


def tiny_data(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, *shape, generator=g)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=g)
    ds = ArrayDataset(x, y, num_classes=10)
    return Data("synthetic", ds, None, 10, tuple(shape), "classification")


def tiny_model(name):
    torch.manual_seed(0)
    if name == "mlp":
        return build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(32, 16)), (1, 8, 8)
    return build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(10, 10), dropout=False), (1, 10, 10)


def train_and_return_parameters(name, batch_size, strategy="ddp", epochs=2, **extra):
    model, shape = tiny_model(name)
    config = TrainConfig.from_flat(model=name, data="synthetic", strategy=strategy, epochs=epochs, batch_size=batch_size,
                         lr=0.1, momentum=0.9, seed=3, val_fraction=0.0, quiet=True, **extra)
    record = fit(model, tiny_data(shape), config)
    module = model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, record["epochs"][-1]["steps"]


def assert_same_parameters(reference, got, rtol=1e-5):
    for key, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert (got[key] - ref).abs().max() / scale <= rtol, key


def ddtrain(*args, timeout=240, env=None, cwd=None):
    full_env = {**os.environ, **(env or {})}
    full_env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "ddtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd)


def assert_one_clear_error(result, *phrases):
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    for phrase in phrases:
        assert phrase in errors[0], errors[0]


def why_no_cluster(extra_missing=(), what: str = "emulate a cluster") -> str | None:
    """Why the emulated-cluster tests cannot run here (None: they can): Linux, the tools, a real ``ip netns add``."""
    from ddtrain.cluster import checks, netns
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    missing = checks.missing_requirements() + list(extra_missing)
    if missing:
        return f"cannot {what} here: " + "; ".join(missing)
    probe = netns.new_run_id() + "-br"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"'ip netns add' does not work here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


# A script run unchanged (examples/minimal.py) whose model rank 0 saves after it ran:
# ``python wrap.py OUT.pt SCRIPT ARGS...`` under any launcher.
SAVE_MODEL_WRAPPER = """import runpy, sys, torch
from ddtrain.distributed.env import detect_env
out = sys.argv.pop(1)
sys.argv = sys.argv[1:]
g = runpy.run_path(sys.argv[0], run_name="__main__")
if detect_env().rank == 0:
    torch.save({k: v.detach().clone() for k, v in g["model"].state_dict().items()}, out)
"""


def run_skip_fault(nproc: int, skipping_rank: int, deadline: int, **env) -> tuple[int, list[str], float]:
    """``ddtrain train --nproc N --timeout D`` with ``skipping_rank`` skipping every collective from step 3.

    Returns (exit code, stderr lines, seconds from the fault firing to the job's end).
    """
    import time
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDTRAIN_FAULT": f"rank={skipping_rank},step=3,kind=skip", **env}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", "train", "--model", "mlp", "--data", "digits",
                             "--nproc", str(nproc), "--epochs", "1", "--batch-size", "32", "--timeout", str(deadline)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines, fired = [], None
    for line in proc.stderr:  # the time the fault fired, then the job's end
        lines.append(line.rstrip())
        if fired is None and "DDTRAIN_FAULT: skipping" in line:
            fired = time.monotonic()
    code = proc.wait(timeout=120)
    assert fired is not None, "\n".join(lines)
    return code, lines, time.monotonic() - fired


def plain_sgd(model, x, y, *, lr: float, momentum: float, epochs: int, global_batch: int, epoch_order) -> dict:
    """The reference every synchronous strategy must equal: one process, SGD on batches of ``global_batch``
    taken in ``epoch_order(epoch)``'s order (epochs counted from 1), cross-entropy; the final state dict."""
    import torch.nn.functional as F
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for epoch in range(1, epochs + 1):
        order = epoch_order(epoch)
        for s in range(len(order) // global_batch):
            idx = order[s * global_batch:(s + 1) * global_batch]
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    return model.state_dict()
