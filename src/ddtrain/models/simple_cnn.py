"""Simple-CNN of document 000, Table 6.3 (the Keras MNIST example network).

Layer                 output (28x28x1 input)   parameters
conv 3x3, 32, ReLU    26 x 26 x 32             320
conv 3x3, 64, ReLU    24 x 24 x 64             18,496
max-pool 2x2          12 x 12 x 64
dropout 0.25
flatten               9216
dense 128, ReLU       128                      1,179,776
dropout 0.5
dense 10 (softmax)    10                       1,290      total 1,199,882

The softmax lives in the loss (cross-entropy on logits). Other input sizes work as long as
the feature map survives the two valid convolutions and the pool.
"""
from __future__ import annotations

import torch.nn as nn


def build_simple_cnn(*, num_classes: int, in_channels: int, input_size: tuple[int, int],
                     dropout: bool = True) -> nn.Module:
    h, w = input_size
    if h < 6 or w < 6:
        raise ValueError(f"simple-cnn needs inputs of at least 6x6 (two 3x3 convolutions and a "
                         f"2x2 pool), got {h}x{w}; resize the data or choose another model")
    flat = 64 * ((h - 4) // 2) * ((w - 4) // 2)
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3), nn.ReLU(),
        nn.Conv2d(32, 64, 3), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25 if dropout else 0.0),
        nn.Flatten(),
        nn.Linear(flat, 128), nn.ReLU(),
        nn.Dropout(0.5 if dropout else 0.0),
        nn.Linear(128, num_classes),
    )
