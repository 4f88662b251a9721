"""Fully connected network: document 001's experiment model, hidden sizes as the message-size knob."""
from __future__ import annotations

import math

import torch.nn as nn


def build_mlp(*, num_classes: int, in_channels: int, input_size: tuple[int, int],
              hidden: tuple[int, ...] | int = (128, 128), dropout: float = 0.0) -> nn.Module:
    """Flatten, then Linear+ReLU for each hidden size, then a Linear to ``num_classes``.

    Document 001 used four layers (input, two hidden, output) and varied the second hidden
    layer's width to change the size of the gradient message.
    """
    hidden = (hidden,) if isinstance(hidden, int) else tuple(hidden)
    if not hidden or any(int(h) < 1 for h in hidden):
        raise ValueError(f"hidden sizes must be positive integers, got {hidden}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_channels * math.prod(input_size)
    for h in hidden:
        layers += [nn.Linear(width, int(h)), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = int(h)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
