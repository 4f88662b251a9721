"""``--compile``: torch.compile with the options that measured faster, reasons beside each.

Measured on one H100, compiled ResNet-50 (batch 256, bf16, channels-last, GPU-resident data),
``ddtrain.fit`` against a hand-written loop in the same run, median of 3 rounds
(results/gpu1_issue20/defaults3.json, defaults4.json, defaults5.json):

* inductor's coordinate-descent tuning (``tuned``) searches the launch parameters of the kernels
  it generates at compile time: 1.030x the plain loop (5,829 against 5,660 images/s), for a
  first step about a minute longer, because more than half of that step is inductor's fused
  normalisation kernels; torch.compile's defaults give 0.993x;
* CUDA graphs on top (``tuned-graphs``: inductor's ``triton.cudagraphs``) replay the step's
  kernels without launching each: 1.048x (5,933) with the fused optimizer. They need a single
  process: with several ranks the gradient all-reduce sits inside the backward graph;
* ``graphs``: the CUDA graphs alone, without the tuning's longer compile;
* ``max_autotune`` had not finished compiling after 9 minutes on an H200 (gpu_compile_modes.py).

``default`` gives torch.compile's own defaults. Off CUDA the options are left empty.

``auto`` weighs the tuning's cost against the run's length. Tuned options make each step
5.9 % faster than torch.compile's defaults (defaults5.json: 5,605 -> 5,937 images/s, 2.6 ms of a
45.7 ms step) and the compile 180 s longer (issue 30, one H200: 240 s against ~60 s before the
first step): the tuning pays for itself after 180 s / 2.6 ms = 69,000 steps (82,000 at the
H200's 2.2 ms). So ``auto`` tunes (``tuned-graphs`` in one process, ``tuned`` with several)
only for runs of at least ``TUNE_MIN_STEPS`` optimizer steps (ImageNet's 90 epochs at a global
batch of 256 are 450,000), and takes torch.compile's defaults for shorter ones (benchmarks,
smoke tests, fine-tuning). Inductor's on-disk caches (on by default in torch >= 2.5: FX graphs,
AOTAutograd, autotuning, the Triton kernels) make a second compile of the same model, shapes
and options on the same machine much shorter, whichever options: they live in
``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_$USER``; point it at persistent
storage on a rented machine). docs/PERFORMANCE.md has the cold and warm compile times.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

TUNED = {"coordinate_descent_tuning": True}
TUNE_MIN_STEPS = 100_000     # auto tunes from here (the break-even above, rounded up)


def choose(choice: str, device: torch.device, world_size: int = 1, planned_steps: int | None = None) -> tuple[str, str]:
    """(the options ``choice`` stands for on ``device``, why): ``auto`` resolved by the run's length."""
    if device.type != "cuda":
        return "default", "not on CUDA: torch.compile's defaults"
    if choice != "auto":
        return choice, "asked for"
    if planned_steps is not None and planned_steps < TUNE_MIN_STEPS:
        return "default", (f"auto: {planned_steps} steps are fewer than the {TUNE_MIN_STEPS} that repay the tuning's "
                           f"longer compile (ddtrain.training.compiled)")
    if world_size == 1:
        return "tuned-graphs", "auto: a long run in one process"
    return "tuned", "auto: a long run on several ranks (no CUDA graphs: the all-reduce is inside backward)"


def options(choice: str, device: torch.device, world_size: int = 1, planned_steps: int | None = None) -> dict:
    """The inductor options ``choice`` stands for on ``device`` at ``world_size`` ranks."""
    name, _ = choose(choice, device, world_size, planned_steps)
    if name == "default":
        return {}
    if name == "tuned-graphs":
        return {**TUNED, "triton.cudagraphs": True}
    if name == "graphs":       # one launch per step at torch.compile's compile time (no tuning)
        return {"triton.cudagraphs": True}
    return dict(TUNED)


def compile_model(model: torch.nn.Module, choice: str, device: torch.device, planned_steps: int | None = None, *,
                  static_shapes: bool = False):
    """``torch.compile(model)`` with ``choice``'s options; ``static_shapes``: ``dynamic=False`` (fsdp, below)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # FSDP2's hooks are traced with the model; the recompile they cause marks sizes dynamic, and inductor then
    # fails ("Cannot convert expression to float", torch 2.13, a plain fully_shard + torch.compile ResNet-18 on
    # CPU); static shapes compile (the loop's batches have one size; another size recompiles)
    return torch.compile(model, options=options(choice, device, world, planned_steps) or None,
                         **({"dynamic": False} if static_shapes else {}))
