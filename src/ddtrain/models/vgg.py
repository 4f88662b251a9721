"""VGG16 and VGG19 (Simonyan & Zisserman, configurations D and E) as torchvision builds them.

13 or 16 3x3 convolutions in five stages, each closed by a 2x2 max-pool, an adaptive 7x7
average pool, and the 25088-4096-4096 classifier: 138,357,544 and 143,667,240 parameters
at 1000 classes (document 002's second and third models). The adaptive pool keeps those
counts at every input size; 32x32 CIFAR images reach the pool as 1x1 maps. ``batch_norm``
gives torchvision's ``vgg16_bn``/``vgg19_bn`` variant.
"""
from __future__ import annotations

import torch.nn as nn

from ddtrain.errors import DDTrainError

# Convolution widths per stage; every stage ends with a 2x2 max-pool.
CONFIGS = {
    16: [[64, 64], [128, 128], [256, 256, 256], [512, 512, 512], [512, 512, 512]],
    19: [[64, 64], [128, 128], [256] * 4, [512] * 4, [512] * 4],
}


def _init_(model: nn.Module) -> None:
    """torchvision's VGG initialisation (He for convolutions, N(0, 0.01) for linears)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)


def build_vgg(*, depth: int, num_classes: int, in_channels: int, input_size: tuple[int, int],
              batch_norm: bool = False, dropout: float = 0.5) -> nn.Module:
    h, w = input_size
    if min(h, w) < 32:
        raise DDTrainError(f"vgg{depth} needs inputs of at least 32x32 (five 2x2 pools), got "
                           f"{h}x{w}; resize the data or choose another model")
    layers: list[nn.Module] = []
    channels = in_channels
    for stage in CONFIGS[depth]:
        for width in stage:
            layers.append(nn.Conv2d(channels, width, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(width))
            layers.append(nn.ReLU(inplace=True))
            channels = width
        layers.append(nn.MaxPool2d(2, 2))
    model = nn.Sequential(
        nn.Sequential(*layers),
        nn.AdaptiveAvgPool2d((7, 7)),
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(dropout),
        nn.Linear(4096, num_classes),
    )
    _init_(model)
    return model


def build_vgg16(**kwargs) -> nn.Module:
    """VGG16 (configuration D)."""
    return build_vgg(depth=16, **kwargs)


def build_vgg19(**kwargs) -> nn.Module:
    """VGG19 (configuration E)."""
    return build_vgg(depth=19, **kwargs)
