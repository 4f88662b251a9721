"""Work timed here, alone, on one thread: a model's compute step and each gradient compressor's own work.

``ddtrain advise --measure`` ranks with these (scaled by the CPU the job's ranks share:
``costmodel.contention``), and ``benchmarks/advise_check.py`` runs ``time_codecs`` inside the
cluster's ranks. ``step_seconds`` times any built model; ``measure_step`` builds one of the zoo.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from ddtrain.costmodel.codecs import time_codecs
from ddtrain.data.synthetic import SHAPES
from ddtrain.errors import DDTrainError
from ddtrain.models.zoo import build_model


class one_thread:
    """Time on one thread: on a shared, loaded host two OpenMP threads spin against each other's load and a
    ResNet-18 step measured 17.4 s on two threads against 2.2 s on one (docs/ADVISE.md)."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


def zoo_model(model: str, data: str, device: str = "meta") -> torch.nn.Module:
    """``model`` of the zoo for the input shape and classes of ``data`` (meta device: shapes only, no memory, no time)."""
    if data not in SHAPES:
        raise DDTrainError(f"--data must be one of {', '.join(SHAPES)}, got {data!r}")
    channels, side, classes, _ = SHAPES[data]
    with torch.device(device):
        return build_model(model, num_classes=classes or 1, in_channels=channels, input_size=(side, side))


def step_seconds(model: torch.nn.Module, inputs: torch.Tensor, loss_of, steps: int = 5, warmup: int = 2) -> float:
    """Median seconds of a forward + backward + SGD step of ``model`` on ``inputs`` (``loss_of(output)`` -> loss).

    The ``warmup`` first steps allocate and are left out.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for i in range(steps + warmup):
        start = time.perf_counter()
        loss_of(model(inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_step(model: str, data: str, batch_size: int, steps: int = 5) -> float:
    """Median seconds of a forward+backward+SGD step of zoo ``model`` with ``batch_size`` random inputs of ``data``'s
    shape, here, alone, on one thread."""
    if model is None:
        raise DDTrainError("--measure needs --model (there is nothing to time with --params)")
    with one_thread():
        built = zoo_model(model, data, device="cpu")
        channels, side, classes, _ = SHAPES[data]
        x = torch.randn(batch_size, channels, side, side)
        if classes:
            y = torch.randint(0, classes, (batch_size,))
            loss_fn = torch.nn.CrossEntropyLoss()
            return step_seconds(built, x, lambda out: loss_fn(out, y), steps)
        loss_fn = torch.nn.MSELoss()
        return step_seconds(built, x, lambda out: loss_fn(out, torch.zeros_like(out)), steps)


# the most gradient elements the codecs are timed on (64 MB of float32): a larger model's codec time is this
# sample's, scaled by its elements (issue 32: `advise --params 1e12` tried to allocate a 4 TB buffer)
CODEC_SAMPLE_ELEMENTS = 16 << 20


def sample_shapes(shapes, most: int = CODEC_SAMPLE_ELEMENTS) -> tuple[tuple[tuple[int, ...], ...], float]:
    """(``shapes`` cut down to at most ``most`` elements, the factor back to the whole): each shape's first
    dimension shrunk by the same ratio, so that the sample keeps the model's mix of matrix sizes."""
    total = sum(math.prod(s) for s in shapes)
    if total <= most:
        return tuple(tuple(s) for s in shapes), 1.0
    ratio = most / total
    cut = tuple((max(1, int(s[0] * ratio)), *s[1:]) if s else () for s in shapes)
    while sum(math.prod(s) for s in cut) > most:   # a shape too wide to shrink by its first dimension alone
        widest = max(range(len(cut)), key=lambda i: math.prod(cut[i]))
        cut = tuple((*s[:-1], max(1, s[-1] // 2)) if i == widest else s for i, s in enumerate(cut))
    return cut, total / sum(math.prod(s) for s in cut)


def measure_codecs(specs, shapes, calls: int = 3) -> dict[str, float]:
    """Median seconds of each compressor's own work on a gradient of ``shapes``, here, alone, one thread (no messages).

    The compressor is the one training uses (``ddtrain.comm.compression.build``), past its warm-up,
    on a random buffer: what it adds to a step besides its collectives. A gradient of more than
    ``CODEC_SAMPLE_ELEMENTS`` is timed on a sample of its shapes and scaled by its elements.
    """
    sample, factor = sample_shapes(shapes)
    with one_thread():
        return {spec: seconds * factor for spec, seconds in time_codecs(specs, sample, calls).items()}
