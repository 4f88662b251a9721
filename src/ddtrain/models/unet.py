"""U-Net of document 000, Table 6.4: 97 diffusion/FA/b0 channels in, one T1 slice out.

Block        layers (all convolutions 3x3, 'same' padding, ReLU)       output (192x192x97 in)
1..4 (down)  conv, conv, batch norm, dropout 0.25 -> skip             192/96/48/24, 32..256 ch
             2x2 max-pool                                             96/48/24/12
5 (bridge)   conv, conv, batch norm, dropout 0.5                      12 x 12 x 512
6..9 (up)    upsample 2x, conv -> concatenate the skip -> conv, conv,
             batch norm                                               24/48/96/192, 256..32 ch
output       conv 1x1 to ``out_channels`` (linear: regression)        192 x 192 x 1

Where the document disagrees with itself the table's shapes win: its pools say "stride 1"
but halve the map (so stride 2 here), and its prose gives the decoder blocks a dropout
layer that the table does not list (``decoder_dropout``, default 0). Activations are not
named in the table; ReLU as in the Keras U-Net examples the thesis builds on. ``base``
(width of block 1) and ``depth`` (number of down/up blocks) scale the network for CPU tests.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ddtrain.errors import DDTrainError


def conv_block(in_channels: int, out_channels: int, dropout: float) -> nn.Sequential:
    """Two 3x3 conv + ReLU, then batch norm (and dropout when > 0): one row group of the table."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1), nn.ReLU(inplace=True),
        nn.BatchNorm2d(out_channels),
    ]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


class Down(nn.Module):
    """Encoder block: ``convs`` gives the skip tensor, ``pool`` halves it for the next block."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__()
        self.convs = conv_block(in_channels, out_channels, dropout)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        skip = self.convs(x)
        return skip, self.pool(skip)


class Up(nn.Module):
    """Decoder block: ``upsample``, ``up_conv`` halves the channels, concatenation with the
    skip doubles them again, ``convs`` brings them back to ``out_channels``."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float):
        super().__init__()
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")  # Keras UpSampling2D
        self.up_conv = nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, padding=1),
                                     nn.ReLU(inplace=True))
        self.convs = conv_block(2 * out_channels, out_channels, dropout)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up_conv(self.upsample(x))
        return self.convs(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    """Encoder ``down[i]``, ``bridge``, decoder ``up[i]``, 1x1 ``head``; named for hooks."""

    def __init__(self, in_channels: int, out_channels: int, base: int, depth: int,
                 dropout: float, bridge_dropout: float, decoder_dropout: float):
        super().__init__()
        widths = [base * 2 ** i for i in range(depth + 1)]  # 32, 64, 128, 256, 512
        self.down = nn.ModuleList()
        channels = in_channels
        for width in widths[:-1]:
            self.down.append(Down(channels, width, dropout))
            channels = width
        self.bridge = conv_block(channels, widths[-1], bridge_dropout)
        self.up = nn.ModuleList(Up(widths[i + 1], widths[i], decoder_dropout)
                                for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            skip, x = block(x)
            skips.append(skip)
        x = self.bridge(x)
        for block, skip in zip(self.up, reversed(skips)):
            x = block(x, skip)
        return self.head(x)


def build_unet(*, num_classes: int, in_channels: int, input_size: tuple[int, int],
               out_channels: int = 1, base: int = 32, depth: int = 4, dropout: float = 0.25,
               bridge_dropout: float = 0.5, decoder_dropout: float = 0.0) -> nn.Module:
    """Table 6.4's U-Net. ``num_classes`` is ignored: the output is ``out_channels`` maps
    (1 = the T1 slice regressed from the diffusion channels)."""
    del num_classes  # a regression model; the registry passes it to every builder
    if not all(isinstance(v, int) and v >= 1 for v in (base, depth, out_channels)):
        raise DDTrainError(f"unet needs integers base, depth and out_channels >= 1, got base={base}, "
                           f"depth={depth}, out_channels={out_channels}")
    for name, p in (("dropout", dropout), ("bridge_dropout", bridge_dropout),
                    ("decoder_dropout", decoder_dropout)):
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise DDTrainError(f"unet {name} must be in [0, 1), got {p}")
    step = 2 ** depth
    h, w = input_size
    if h % step or w % step:
        raise DDTrainError(f"unet with depth {depth} needs height and width divisible by "
                           f"{step} (one 2x2 pool per level), got {h}x{w}; pad the slices "
                           f"(document 000 pads 174x145 to 192x192) or lower --depth")
    return UNet(in_channels, out_channels, base, depth, dropout, bridge_dropout, decoder_dropout)
