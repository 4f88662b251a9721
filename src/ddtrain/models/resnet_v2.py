"""ResNet50V2 and ResNet152V2: pre-activation ResNets as Keras builds them (document 003).

He et al. 2016, "Identity mappings", in the layout of ``keras.applications.ResNet50V2``:
- stem: 7x7 stride-2 convolution *with* bias and no batch norm (the first block's
  pre-activation normalises it), zero padding 1, then a 3x3 stride-2 max-pool (Keras pads
  with zeros before that pool, not with -inf as torch's pool padding would);
- every block: batch norm + ReLU first ("preact"); a 1x1 (no bias), batch norm, ReLU, 3x3
  (no bias, carries the stride), batch norm, ReLU, 1x1 at 4x width (with bias); the sum is
  not activated;
- in a stack the *first* block widens the shortcut with a 1x1 convolution (with bias) of
  the pre-activated input, and the *last* block carries the stride (2 in the first three
  stacks, 1 in the fourth); its shortcut subsamples the raw input (Keras's 1x1 max-pool);
- after the stacks: batch norm + ReLU, global average pool, one linear layer.
At 1000 classes Keras reports 25,613,800 and 60,380,648 'Total params'; Keras counts every
batch norm's moving mean and variance in that total, so the same figure here is the
learnable parameters plus the ``running_mean``/``running_var`` buffers. Batch norm epsilon
is Keras's 1.001e-5 and weights start as Keras's do (Glorot-uniform, zero bias); the running
statistics use torch's momentum (0.1, i.e. Keras momentum 0.9), not Keras's 0.99.
"""
from __future__ import annotations

import torch
import torch.nn as nn

EPS = 1.001e-5
LAYOUTS = {50: [3, 4, 6, 3], 152: [3, 8, 36, 3]}


def _bn_relu(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(channels, eps=EPS), nn.ReLU(inplace=True))


class PreActBlock(nn.Module):
    """Keras's ``block2``: ``preact`` feeds ``body`` (and ``shortcut`` when it is a conv)."""

    def __init__(self, in_channels: int, width: int, stride: int, conv_shortcut: bool):
        super().__init__()
        out_channels = 4 * width
        self.preact = _bn_relu(in_channels)
        self.conv_shortcut = conv_shortcut
        if conv_shortcut:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride)
        else:
            self.shortcut = nn.MaxPool2d(1, stride) if stride > 1 else nn.Identity()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), _bn_relu(width),
            nn.Conv2d(width, width, 3, stride, padding=1, bias=False), _bn_relu(width),
            nn.Conv2d(width, out_channels, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        preact = self.preact(x)
        shortcut = self.shortcut(preact if self.conv_shortcut else x)
        return shortcut + self.body(preact)


def build_resnet_v2(*, depth: int, num_classes: int, in_channels: int,
                    input_size: tuple[int, int]) -> nn.Module:
    del input_size  # any size of at least 1x1 works: the head pools globally
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 64, 7, 2, padding=3),
                               nn.ZeroPad2d(1), nn.MaxPool2d(3, 2)]
    channels = 64
    for stage, count in enumerate(LAYOUTS[depth]):
        width = 64 * 2 ** stage
        last_stride = 2 if stage < 3 else 1
        for i in range(count):
            stride = last_stride if i == count - 1 else 1
            layers.append(PreActBlock(channels, width, stride, conv_shortcut=(i == 0)))
            channels = 4 * width
    model = nn.Sequential(*layers, _bn_relu(channels), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(channels, num_classes))
    for m in model.modules():  # Keras defaults: glorot_uniform kernels, zero biases
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def build_resnet50v2(**kwargs) -> nn.Module:
    return build_resnet_v2(depth=50, **kwargs)


def build_resnet152v2(**kwargs) -> nn.Module:
    return build_resnet_v2(depth=152, **kwargs)
