"""Parameter counts and forward FLOPs per sample, counted on the model itself.

What is counted: ``torch.utils.flop_counter.FlopCounterMode`` over one forward pass of a
single sample, which counts the matrix products and convolutions (``aten.mm``, ``addmm``,
``bmm``, ``convolution``, attention) at 2 FLOPs per multiply-add. Not counted: biases, batch
norm, activations, pooling, upsampling, residual additions (together about 1% for the zoo's
models). So the figure is 2x the "MACs" (multiply-accumulates) that torchvision's model
table calls "GFLOPS": ResNet-50 at 224x224 is 4.09 GMACs there and 8.18 GFLOPs here.

The pass runs on the meta device (shapes only, no arithmetic, no memory), with the model's
own parameters swapped for meta copies, so counting VGG19 at 224x224 takes milliseconds and
leaves the model untouched. Print the zoo's table with::

    python -m ddtrain.models.flops                                   # reference inputs
    python -m ddtrain.models.flops resnet50v2 --input 3x128x128 --classes 10   # document 003
"""
from __future__ import annotations


import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from ddtrain.errors import choice_error
from ddtrain.models.zoo import MODELS, build_model, parameter_count

# Reference input of each model (the one its source document or publisher counts at):
# name -> (in_channels, height, width, num_classes, where the input comes from).
REFERENCE_INPUTS = {
    "mlp": (1, 28, 28, 10, "MNIST, document 001"),
    "simple-cnn": (1, 28, 28, 10, "MNIST, document 000 Table 6.3"),
    "unet": (97, 192, 192, 1, "HCP slices, document 000 Table 6.4"),
    "alexnet": (3, 224, 224, 1000, "ImageNet, torchvision; document 002"),
    "vgg16": (3, 224, 224, 1000, "ImageNet, torchvision; document 002"),
    "vgg19": (3, 224, 224, 1000, "ImageNet, torchvision; document 002"),
    "resnet18": (3, 224, 224, 1000, "ImageNet, torchvision; document 004"),
    "resnet50": (3, 224, 224, 1000, "ImageNet, torchvision; document 002"),
    "resnet152": (3, 224, 224, 1000, "ImageNet, torchvision; document 002"),
    "resnet50v2": (3, 224, 224, 1000, "ImageNet, Keras; document 003"),
    "resnet152v2": (3, 224, 224, 1000, "ImageNet, Keras; document 003"),
}


def buffer_count(model: nn.Module) -> int:
    """Floating-point state that is not learned: batch norm's running mean and variance.

    Integer counters (``num_batches_tracked``) are left out; parameters + this figure is
    what Keras reports as 'Total params'.
    """
    return sum(b.numel() for b in model.buffers() if b.is_floating_point())


def count_flops(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Forward FLOPs for one sample of shape ``input_shape`` (no batch dimension)."""
    meta = {name: torch.empty_like(t, device="meta")
            for name, t in [*model.named_parameters(), *model.named_buffers()]}
    x = torch.empty((1, *input_shape), device="meta")
    was_training = model.training
    model.eval()  # batch norm must not update (meta) running statistics in place
    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            functional_call(model, meta, (x,))
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


def model_summary(model: nn.Module, input_shape: tuple[int, ...]) -> dict:
    """``params`` (learnable), ``buffers`` (running statistics) and ``flops_per_sample``
    (forward, 2 per multiply-add) of ``model`` for samples of shape ``input_shape``."""
    return {"params": parameter_count(model), "buffers": buffer_count(model),
            "flops_per_sample": count_flops(model, tuple(input_shape))}


def reference_table(names=None, input_shape=None, num_classes=None) -> list[dict]:
    """One row per model (default: all registered) at its reference input, or at
    ``input_shape`` (C, H, W) / ``num_classes`` where given; built on the meta device."""
    rows = []
    for name in names or MODELS:
        if name not in MODELS:
            raise choice_error("model", name, MODELS)
        channels, height, width, classes, source = REFERENCE_INPUTS.get(
            name, (3, 224, 224, 1000, "not listed in REFERENCE_INPUTS"))
        if input_shape is not None:
            (channels, height, width), source = input_shape, "--input"
        classes = classes if num_classes is None else num_classes
        with torch.device("meta"):
            model = build_model(name, num_classes=classes, in_channels=channels,
                                input_size=(height, width))
        summary = model_summary(model, (channels, height, width))
        rows.append({"model": name, "input": f"{channels}x{height}x{width}",
                     "classes": classes, "source": source, **summary})
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width table, units in the header, '#' before every non-data line."""
    lines = ["# forward FLOPs per sample = 2 x multiply-adds of convolutions and matrix "
             "products (torch.utils.flop_counter)",
             "# params = learnable parameters; +bn_stats adds batch norm running mean/var "
             "(Keras 'Total params')",
             f"# {'model':<12} {'input CxHxW':>12} {'classes':>7} {'params':>13} "
             f"{'+bn_stats':>13} {'GFLOPs':>9}  source"]
    for r in rows:
        lines.append(f"  {r['model']:<12} {r['input']:>12} {r['classes']:>7} "
                     f"{r['params']:>13,} {r['params'] + r['buffers']:>13,} "
                     f"{r['flops_per_sample'] / 1e9:>9.4f}  {r['source']}")
    return "\n".join(lines)


if __name__ == "__main__":  # the command is ``ddtrain model flops``; this keeps ``python -m`` working
    import sys

    from ddtrain.cli import main
    raise SystemExit(main(["model", "flops", *sys.argv[1:]]))
