"""R ranks with per-rank batch B take the same steps as one process with batch R*B (acceptance 3)."""
import pytest
import torch

from ddtrain import TrainConfig, fit
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.models import build_model
from multirank import run_ranks

N_SAMPLES = 96  # divisible by every R*B below, so no rank drops a sample


def _data(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, *shape, generator=g)
    y = torch.randint(0, 10, (N_SAMPLES,), generator=g)
    ds = ArrayDataset(x, y, num_classes=10)
    return Data("synthetic", ds, None, 10, tuple(shape), "classification")


def _model(name):
    torch.manual_seed(0)
    if name == "mlp":
        return build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(32, 16)), (1, 8, 8)
    return build_model("simple-cnn", num_classes=10, in_channels=1, input_size=(10, 10), dropout=False), (1, 10, 10)


def train_and_return_parameters(name, batch_size, strategy="ddp", epochs=2, **extra):
    model, shape = _model(name)
    config = TrainConfig(model=name, data="synthetic", strategy=strategy, epochs=epochs, batch_size=batch_size,
                         lr=0.1, momentum=0.9, seed=3, val_fraction=0.0, quiet=True, **extra)
    record = fit(model, _data(shape), config)
    module = model
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, record["epochs"][-1]["steps"]


def assert_same_parameters(reference, got, rtol=1e-5):
    for key, ref in reference.items():
        scale = ref.abs().max().clamp_min(1e-12)
        assert (got[key] - ref).abs().max() / scale <= rtol, key


@pytest.mark.parametrize("name", ["mlp", "simple-cnn"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_with_batch_b_equal_one_process_with_batch_rb(name, world):
    batch = 8
    reference, ref_steps = train_and_return_parameters(name, batch * world)
    results = run_ranks(train_and_return_parameters, world, name, batch)
    for params, steps in results:
        assert steps == ref_steps == N_SAMPLES // (batch * world)
        assert_same_parameters(reference, params)
