"""Model zoo: plain nn.Modules, one file per family, looked up by name in MODELS.

A builder takes keyword arguments ``num_classes``, ``in_channels`` and ``input_size``
(H, W) plus its own options, and returns an ``nn.Module``. Nothing here knows about
distribution. ``model_summary(model, input_shape)`` gives parameters, batch norm statistics
and counted forward FLOPs per sample (see flops.py).
"""
from __future__ import annotations

import torch.nn as nn

from ddtrain.models.zoo import MODELS, build_model, parameter_count


def model_summary(model: nn.Module, input_shape: tuple[int, ...]) -> dict:
    """``params``, ``buffers`` (batch norm running statistics) and counted forward
    ``flops_per_sample`` for samples of shape ``input_shape``; see flops.py."""
    from ddtrain.models.flops import model_summary as summary
    return summary(model, input_shape)


__all__ = ["MODELS", "build_model", "parameter_count", "model_summary"]
