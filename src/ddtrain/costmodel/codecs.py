"""The compressors' own work timed (no messages): what the adviser adds to a compressed step besides its collectives.

``time_codecs`` is used by ``bench.measure`` (``ddtrain advise --measure``, alone, one thread) and by
``sync.auto`` (inside the job's ranks, on the threads they have, with a group of each rank alone).
"""
from __future__ import annotations

import math
import statistics
import time

import torch

from ddtrain.comm import compression


def time_codecs(specs, shapes, calls: int = 3, group=None) -> dict[str, float]:
    """``measure_codecs`` on the threads this process has (the check times them inside the cluster's ranks).

    Inside a job, ``group`` must be a group of this rank alone, so that no message is sent.
    """
    numel = sum(math.prod(s) for s in shapes)
    out = {}
    for spec in specs:
        compressor = compression.build(spec)
        if compressor is None:
            continue
        for name in ("warmup_steps",):       # PowerSGD: time the compressed steps, not the warm-up's plain ones
            if hasattr(compressor, name):
                compressor.steps = getattr(compressor, name)
        flat = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        times = []
        for i in range(calls + 1):
            buffer = flat.clone()
            start = time.perf_counter()
            compressor.all_reduce_(buffer, shapes, algorithm="ring", group=group, key=0, last=True)
            if i:   # the first call allocates the state (error, P, Q)
                times.append(time.perf_counter() - start)
        out[spec] = statistics.median(times)
    return out
