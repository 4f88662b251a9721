"""Overlap of DDP's bucket communication with the backward pass: how much of it a step still waits for.

DDP (and every ddtrain strategy that is a DDP communication hook: ring, tree, butterfly, central,
ddp with compression) hands a gradient bucket to its communication as soon as the backward pass
has filled it; one communication thread (Gloo's, or ``sync.allreduce.CommThread``) takes the
buckets one after the other, in the order they became ready. So bucket ``i`` starts at
``max(ready_i, end_{i-1})`` and ends ``work_i`` later (its compressor's work and its collectives),
and the step waits only for what is left after the backward pass ends:

    step = compute + exposed,  exposed = end_last - backward  (>= work_last: the last bucket is
                                                               ready only when backward ends)

which is the brief's ``t_forward + max(t_backward_until_last_bucket_ready, comm of the earlier
buckets) + comm(last bucket) + t_optimizer`` with each earlier bucket's own start. Strategies that
communicate after the step (local SGD's averaging, parameter servers) keep the sequential model.
"""
from __future__ import annotations

from collections.abc import Sequence

from ddtrain.errors import DDTrainError

# The usual FLOP rule: a layer's backward computes the gradient of its input and of its weights, two
# products the size of its forward one, so backward ~ 2x forward, i.e. 2/3 of forward+backward.
BACKWARD_SHARE_OF_FORWARD_BACKWARD = 2.0 / 3.0


def ready_fractions(bucket_elements: Sequence[float]) -> list[float]:
    """Fraction of the backward pass done when each bucket (in DDP's order) is full.

    The rule: backward produces gradients in reverse parameter order (the order of DDP's buckets)
    at a uniform rate per parameter -- the only rule the parameter shapes alone support. For
    convnets it is pessimistic: the late layers hold most parameters but few FLOPs per parameter,
    so their buckets are really ready earlier (more overlap than predicted here).
    """
    total = float(sum(bucket_elements))
    if total <= 0 or any(e < 0 for e in bucket_elements):
        raise DDTrainError(f"bucket sizes must be >= 0 and not all 0, got {list(bucket_elements)}")
    out, done = [], 0.0
    for e in bucket_elements:
        done += e
        out.append(done / total)
    out[-1] = 1.0   # the last bucket is full exactly when backward ends (no rounding drift)
    return out


def pipeline_end_s(ready_s: Sequence[float], work_s: Sequence[float]) -> float:
    """When one communication thread, taking the buckets in order, each once it is ready, finishes the last."""
    if len(ready_s) != len(work_s):
        raise DDTrainError(f"{len(ready_s)} ready times for {len(work_s)} buckets")
    end = 0.0
    for ready, work in zip(ready_s, work_s):
        end = max(end, ready) + work   # waits for the bucket to be full and for the previous bucket's communication
    return end


def exposed_s(backward_s: float, bucket_elements: Sequence[float], work_s: Sequence[float]) -> float:
    """Communication the step still waits for after a backward pass of ``backward_s`` (time 0 = backward starts)."""
    if not backward_s >= 0:
        raise DDTrainError(f"the backward pass must take >= 0 s, got {backward_s}")
    ready = [f * backward_s for f in ready_fractions(bucket_elements)]
    return pipeline_end_s(ready, work_s) - backward_s
