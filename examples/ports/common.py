"""What the four example pairs share, so that each pair's diff is the porting alone: data, models, arguments.

The data are the 8x8 handwritten digits that ship with ddtrain (``ddtrain/data/digits.npz``,
1,797 images), read with numpy: a first slice for training, the next for testing.
"""
import argparse
from importlib import resources

import numpy as np
import torch
from torch.utils.data import TensorDataset


def digits(train_samples: int = 1200, test_samples: int = 400):
    """(train, test) TensorDatasets of (1x8x8 image in [0, 1], label)."""
    with resources.files("ddtrain.data").joinpath("digits.npz").open("rb") as f:
        arrays = np.load(f)
        x = torch.from_numpy(arrays["x"].astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
        y = torch.from_numpy(arrays["y"].astype(np.int64))
    end = train_samples + test_samples
    return TensorDataset(x[:train_samples], y[:train_samples]), TensorDataset(x[train_samples:end], y[train_samples:end])


class Net(torch.nn.Module):
    """A small CNN in the shape of pytorch/examples mnist's ``Net`` (log-probabilities out)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3)
        self.fc1 = torch.nn.Linear(8 * 3 * 3, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.conv(x)), 2)
        return torch.log_softmax(self.fc2(torch.relu(self.fc1(x.flatten(1)))), dim=1)


def parser(description: str, **defaults) -> argparse.ArgumentParser:
    """The arguments every example takes (each adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=defaults.get("epochs", 3))
    p.add_argument("--batch-size", type=int, default=defaults.get("batch_size", 32))
    p.add_argument("--lr", type=float, default=defaults.get("lr", 0.1))
    p.add_argument("--train-samples", type=int, default=1200)
    p.add_argument("--test-samples", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    return p
