"""Model zoo: plain nn.Modules, one file per family, looked up by name in MODELS.

A builder takes keyword arguments ``num_classes``, ``in_channels`` and ``input_size``
(H, W) plus its own options, and returns an ``nn.Module``. Nothing here knows about
distribution.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from ..errors import DDTrainError, choice_error
from .mlp import build_mlp
from .simple_cnn import build_simple_cnn

MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": build_mlp,
    "simple-cnn": build_simple_cnn,
}


def build_model(name: str, *, num_classes: int = 10, in_channels: int = 1,
                input_size: tuple[int, int] = (28, 28), **options) -> nn.Module:
    """Build the named model for inputs of shape (in_channels, *input_size)."""
    if name not in MODELS:
        raise choice_error("model", name, MODELS)
    try:
        return MODELS[name](num_classes=num_classes, in_channels=in_channels,
                            input_size=tuple(input_size), **options)
    except TypeError as exc:  # an option the builder does not take
        raise DDTrainError(f"model {name!r}: {exc}") from None


def parameter_count(model: nn.Module) -> int:
    """Learnable parameters (what torchvision and the papers count)."""
    return sum(p.numel() for p in model.parameters())
