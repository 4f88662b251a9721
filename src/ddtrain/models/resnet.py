"""ResNet-18/50/152, version 1.5, as torchvision builds them (documents 002 and 004).

v1.5 puts a bottleneck's stride on its 3x3 convolution rather than the first 1x1 (He et al.
2015 put it on the 1x1); it is what torchvision, and so document 004's ImageNet runs, use.
Document 002 ran Keras's ResNet50/152, which are v1: ``version="1"`` builds that layout (the
same parameters; Keras's v1 also has biases on its convolutions, which torchvision's and
these do not, so Keras counts 25,636,712 for ResNet50).
Post-activation blocks (conv, batch norm, ReLU; the ReLU after the addition), a 7x7 stride-2
stem and 3x3 max-pool, four stages of 64/128/256/512 widths, global average pool, one
linear layer: 11,689,512 / 25,557,032 / 60,192,808 parameters at 1000 classes. Any input
of at least 1x1 runs (32x32 CIFAR images reach the last stage as 1x1 maps, as in document
002's Keras runs on CIFAR-10).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ddtrain.errors import DDTrainError

# name -> (blocks per stage, bottleneck?)
LAYOUTS = {18: ([2, 2, 2, 2], False), 50: ([3, 4, 6, 3], True), 152: ([3, 8, 36, 3], True)}


def _conv_bn(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, bias=False),
            nn.BatchNorm2d(out_channels)]


class Block(nn.Module):
    """One residual block: ``body`` (basic: 3x3, 3x3; bottleneck: 1x1, 3x3 strided, 1x1 at
    4x width) plus ``shortcut`` (identity, or 1x1 conv + batch norm when the shape changes)."""

    def __init__(self, in_channels: int, width: int, stride: int, bottleneck: bool,
                 stride_in_1x1: bool = False):
        super().__init__()
        relu = lambda: nn.ReLU(inplace=True)  # noqa: E731
        if bottleneck:
            out_channels = 4 * width
            s1, s3 = (stride, 1) if stride_in_1x1 else (1, stride)
            body = [*_conv_bn(in_channels, width, 1, s1), relu(),
                    *_conv_bn(width, width, 3, s3), relu(),
                    *_conv_bn(width, out_channels, 1)]
        else:
            out_channels = width
            body = [*_conv_bn(in_channels, width, 3, stride), relu(), *_conv_bn(width, width, 3)]
        self.body = nn.Sequential(*body)
        self.shortcut = (nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride))
                         if stride != 1 or in_channels != out_channels else nn.Identity())
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def build_resnet(*, depth: int, num_classes: int, in_channels: int, input_size: tuple[int, int],
                 version: str | float = "1.5", zero_init_residual: bool = False) -> nn.Module:
    """``version="1"`` puts a bottleneck's stride on its first 1x1 as the original paper and
    Keras do (same parameters, fewer FLOPs: the 3.9 and 11.3 GFLOPs of document 002's
    Table 3.1). ``zero_init_residual`` starts every block as the identity (Goyal et al.
    2017), which helps large-batch data-parallel training; off by default as in torchvision."""
    del input_size  # any size works: the head pools globally
    version = str(version)  # `--model-arg version=1` arrives as the number 1
    if version not in ("1", "1.5"):
        raise DDTrainError(f"resnet version must be '1' or '1.5', got {version!r}")
    blocks, bottleneck = LAYOUTS[depth]
    layers: list[nn.Module] = [*_conv_bn(in_channels, 64, 7, 2), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for stage, count in enumerate(blocks):
        width = 64 * 2 ** stage
        for i in range(count):
            stride = 2 if (i == 0 and stage > 0) else 1
            block = Block(channels, width, stride, bottleneck, stride_in_1x1=(version == "1"))
            layers.append(block)
            channels = block.out_channels
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(channels, num_classes))
    for m in model.modules():  # torchvision's initialisation
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, Block):
                nn.init.zeros_(m.body[-1].weight)  # the last batch norm
    return model


def build_resnet18(**kwargs) -> nn.Module:
    return build_resnet(depth=18, **kwargs)


def build_resnet50(**kwargs) -> nn.Module:
    return build_resnet(depth=50, **kwargs)


def build_resnet152(**kwargs) -> nn.Module:
    return build_resnet(depth=152, **kwargs)
