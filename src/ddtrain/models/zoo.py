"""The registry: every model family's builder under its name, and the one way to build one."""
from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ddtrain.errors import DDTrainError, choice_error
from ddtrain.models.alexnet import build_alexnet
from ddtrain.models.mlp import build_mlp
from ddtrain.models.resnet import build_resnet18, build_resnet50, build_resnet152
from ddtrain.models.resnet_v2 import build_resnet50v2, build_resnet152v2
from ddtrain.models.simple_cnn import build_simple_cnn
from ddtrain.models.unet import build_unet
from ddtrain.models.vgg import build_vgg16, build_vgg19

MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": build_mlp,
    "simple-cnn": build_simple_cnn,
    "unet": build_unet,
    "alexnet": build_alexnet,
    "vgg16": build_vgg16,
    "vgg19": build_vgg19,
    "resnet18": build_resnet18,
    "resnet50": build_resnet50,
    "resnet152": build_resnet152,
    "resnet50v2": build_resnet50v2,
    "resnet152v2": build_resnet152v2,
}


def build_model(name: str, *, num_classes: int = 10, in_channels: int = 1,
                input_size: tuple[int, int] = (28, 28), **options) -> nn.Module:
    """Build the named model for inputs of shape (in_channels, *input_size)."""
    if name not in MODELS:
        raise choice_error("model", name, MODELS)
    try:
        return MODELS[name](num_classes=num_classes, in_channels=in_channels,
                            input_size=tuple(input_size), **options)
    except (TypeError, ValueError) as exc:  # an option the builder does not take, or a bad value
        raise DDTrainError(f"model {name!r}: {exc}") from None


def parameter_count(model: nn.Module) -> int:
    """Learnable parameters (what torchvision and the papers count)."""
    return sum(p.numel() for p in model.parameters())
