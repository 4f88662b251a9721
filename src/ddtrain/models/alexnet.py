"""AlexNet as torchvision builds it (document 002's first model): 61,100,840 parameters.

The one-GPU variant of Krizhevsky et al. (64/192/384/256/256 filters), an adaptive 6x6
average pool and the 9216-4096-4096 classifier. The adaptive pool keeps the parameter count
the same at every input size. At 224x224 the layers are exactly torchvision's; at small
inputs (document 002 trains on 32x32 CIFAR-10) a 3x3 max-pool would see a map smaller than
its window and fail, so such pools are left out (pools hold no parameters). Inputs must be
at least 7x7 so the 11x11 stride-4 stem leaves a pixel.
"""
from __future__ import annotations

import torch.nn as nn

from ddtrain.errors import DDTrainError


def _conv_out(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def build_alexnet(*, num_classes: int, in_channels: int, input_size: tuple[int, int],
                  dropout: float = 0.5) -> nn.Module:
    h, w = input_size
    if min(h, w) < 7:
        raise DDTrainError(f"alexnet needs inputs of at least 7x7 (11x11 stride-4 stem), got "
                           f"{h}x{w}; resize the data or choose another model")
    # (out_channels, kernel, stride, padding, max-pool after)
    plan = [(64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
            (256, 3, 1, 1, False), (256, 3, 1, 1, True)]
    layers: list[nn.Module] = []
    channels, size = in_channels, min(h, w)
    for out_channels, kernel, stride, padding, pool in plan:
        layers += [nn.Conv2d(channels, out_channels, kernel, stride, padding), nn.ReLU(inplace=True)]
        channels, size = out_channels, _conv_out(size, kernel, stride, padding)
        if pool and size >= 3:
            layers.append(nn.MaxPool2d(3, 2))
            size = _conv_out(size, 3, 2)
    return nn.Sequential(
        nn.Sequential(*layers),
        nn.AdaptiveAvgPool2d((6, 6)),
        nn.Flatten(),
        nn.Dropout(dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
        nn.Dropout(dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
        nn.Linear(4096, num_classes),
    )
