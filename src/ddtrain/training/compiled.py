"""``--compile``: torch.compile with the options that measured faster, reasons beside each.

Measured on one H100, compiled ResNet-50 (batch 256, bf16, channels-last, GPU-resident data),
``ddtrain.fit`` against a hand-written loop in the same run, median of 3 rounds
(results/gpu1_issue20/defaults3.json and defaults4.json):

* inductor's coordinate-descent tuning (``tuned``) searches the launch parameters of the kernels
  it generates at compile time: 1.030x the plain loop (5,829 against 5,660 images/s), for a
  first step about a minute longer, because more than half of that step is inductor's fused
  normalisation kernels; torch.compile's defaults give 0.993x;
* CUDA graphs on top (``tuned-graphs``: inductor's ``triton.cudagraphs``) replay the step's
  kernels without launching each: 1.048x (5,933) with the fused optimizer. They are the
  default only in a single process (``auto``): with several ranks the gradient all-reduce sits
  inside the backward graph;
* ``max_autotune`` had not finished compiling after 9 minutes on an H200 (gpu_compile_modes.py).

``default`` gives torch.compile's own defaults. Off CUDA the options are left empty.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

TUNED = {"coordinate_descent_tuning": True}


def options(choice: str, device: torch.device, world_size: int = 1) -> dict:
    """The inductor options ``choice`` stands for on ``device`` at ``world_size`` ranks."""
    if device.type != "cuda" or choice == "default":
        return {}
    if choice == "tuned-graphs" or (choice == "auto" and world_size == 1):
        return {**TUNED, "triton.cudagraphs": True}
    return dict(TUNED)


def compile_model(model: torch.nn.Module, choice: str, device: torch.device):
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return torch.compile(model, options=options(choice, device, world) or None)
