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
