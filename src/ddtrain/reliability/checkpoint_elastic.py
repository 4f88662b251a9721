"""Checkpoints that resume on another number of workers, training on as if nothing had changed.

A run with ``--global-batch-size G`` and ``balanced`` sharding trains the same samples at every
step whatever its worker count (``ShardSampler``: step s of an epoch is ``perm[s*G:(s+1)*G]``)
and the same mean gradient over them; so its global state (the parameters, the optimizer, the
gradient scaler, the parameter servers' shards) is all a resume at another size needs. A
checkpoint's header carries an ``elastic`` section (``section``): G, the gradient accumulation,
the worker count, the data set, the strategy's resize rule and the worker counts it can resume
on (the divisors of G; ``--grad-accum`` is re-chosen where the one asked does not fit,
``ddtrain.recipe.grad_accum_for``). What is per rank is merged or re-derived (``reshape``):
the epoch's metric sums are added up (on rank 0), the RNG streams of ranks that did not exist
are seeded from (seed, step, rank), and strategies without one global state follow their rule:
local-sgd averages the workers' replicas (an averaging at the boundary), hybrid takes rank 0's
(its broadcast at the boundary), the parameter servers keep their own shards.
"""
from __future__ import annotations

import random

import torch

from ddtrain.reliability.consistency import ConfigMismatch, check_resumable, differences, resume_fields

# What must still agree when the worker count changes is the fingerprint's settings marked resume="same"
# (consistency.resume_fields with same_workers=False); the elastic section adds the data set by name and
# arguments, and the global batch (recorded here before the fingerprint held it).
SECTION_FIELDS = ("data", "data_args", "global_batch_size")

# a strategy's rule for a resize (``rule``): "identical", "average", "rank0", "servers"
RULES = {
    "identical": "identical training: the replicas are one global state",
    "servers": "identical training: the parameter servers' parameters and optimizer state are the global state",
    "rank0": "rank 0's replica (the broadcast hybrid makes every --sync-every steps, done at the boundary)",
    "average": "the workers' replicas and optimizer states averaged (an averaging at the boundary)",
    "servers-async": "the servers' state; the workers re-pull it; not identical (asynchronous updates)",
}


def rule(spec) -> str:
    """A strategy's resize rule from its StrategySpec (no strategy name tested)."""
    if spec.replicated:
        return "identical"
    if spec.uses_servers:
        return "servers" if spec.synchronous else "servers-async"
    return "rank0" if spec.synchronous else "average"


def worker_counts(global_batch: int, limit: int) -> list[int]:
    """Worker counts that keep a global batch of ``global_batch``: its divisors up to ``limit`` (samples)."""
    return [r for r in range(1, min(global_batch, limit) + 1) if global_batch % r == 0]


def section(config, *, workers: int, servers: int, train_samples: int, resize_rule: str | None) -> dict:
    """The header's ``elastic`` section: what a resume at another worker count needs to check and re-derive."""
    total = config.recipe.global_batch_size
    out = {"global_batch_size": total, "grad_accum": config.recipe.grad_accum, "workers": workers, "servers": servers,
           "data": config.data.data, "data_args": repr(sorted(config.data.data_args.items())), "sharding": config.data.sharding,
           "rule": resize_rule}
    if not total:
        out["fixed"] = "written without --global-batch-size: the global batch is --batch-size x workers"
    elif config.data.sharding != "balanced":
        out["fixed"] = f"--sharding {config.data.sharding} gives each worker count other samples"
    out["worker_counts"] = [workers] if "fixed" in out else worker_counts(total, train_samples)
    return out


def check(header: dict, fingerprint: dict, now: dict | None, path) -> bool:
    """Raise ConfigMismatch when the checkpoint cannot be resumed by this run; True when it resumes at another size.

    ``now`` is this run's ``section``. A checkpoint without one (written before elastic
    resume) resumes only at its own size, checked as it always was.
    """
    theirs = header.get("elastic")
    if not isinstance(theirs, dict) or now is None:
        check_resumable(header, fingerprint, path)
        return False
    # without a global batch the per-rank batch is the run's batch: the "same-workers" settings must agree too
    fixed = "fixed" in theirs or "fixed" in now
    fields = tuple(f for f in resume_fields(fingerprint, same_workers=fixed) if f not in ("world_size",))
    found = differences(fingerprint, header.get("fingerprint", {}), fields, recorded_only=True)
    named = {line.partition("=")[0].partition(" ")[0] for line in found}
    found += differences(now, theirs, tuple(f for f in SECTION_FIELDS if f not in named))
    if found:
        raise ConfigMismatch(f"checkpoint {path} does not fit this run: it has " + ", ".join(found)
                             + " (this run has the second value); resume with the same settings "
                             "or use another checkpoint directory (checkpoint_dir, --checkpoint-dir)")
    if theirs.get("workers") == now["workers"]:
        return False
    was, here = theirs.get("workers"), now["workers"]
    if "fixed" in theirs:
        raise ConfigMismatch(f"checkpoint {path} was written by {was} workers and resumes only on {was} "
                             f"(this run has {here}): {theirs['fixed']}")
    if here not in theirs.get("worker_counts", []):
        raise ConfigMismatch(f"checkpoint {path} cannot resume on {here} workers: its global batch of "
                             f"{theirs['global_batch_size']} divides among " + ", ".join(
                                 map(str, theirs.get("worker_counts", []))) + " workers")
    return True


def derived_rng(seed: int, step: int, rank: int, capture, apply) -> dict:
    """RNG states for a rank a checkpoint has no part for, seeded from (seed, step, rank).

    ``capture()`` reads this process's states and ``apply(states)`` sets them
    (``checkpoint.rng_state`` and ``set_rng_state``); this process's own are put back.
    """
    saved = capture()
    value = (seed * 1_000_003 + step) * 1000 + rank
    torch.manual_seed(value)
    random.seed(value)
    try:
        import numpy as np
        np.random.seed(value % 2**32)
    except ImportError:
        pass
    try:
        return capture()
    finally:
        apply(saved)


def merged_state(states: list[dict], how: str) -> dict:
    """One model/optimizer/scaler state from the workers' own: rank 0's, or the floating tensors averaged."""
    if how != "average" or len(states) == 1:
        return states[0]

    def mean(values):
        first = values[0]
        if isinstance(first, torch.Tensor):
            return torch.stack(values).mean(0).to(first.dtype) if first.is_floating_point() else first
        if isinstance(first, dict):
            return {k: mean([v[k] for v in values]) for k in first}
        if isinstance(first, (list, tuple)):
            return type(first)(mean([v[i] for v in values]) for i in range(len(first)))
        return first
    return mean(states)


def reshape(parts: list[dict], shared, *, elastic: dict, workers: int, seed: int, step: int,
            capture, apply) -> list[tuple]:
    """(shared, part) for each rank of a world of ``workers`` workers (+ the same servers) from a checkpoint's parts.

    Workers come first, then the servers (``dist.launch``'s layout), whose parts (the checkpoint
    holds the workers' only) are made here. Rank 0 gets the epoch's
    metric sums of every worker added up (the loop all-reduces them at the epoch's end), the
    other workers zeros; a worker rank the checkpoint had keeps its RNG streams, a new one gets
    them from (seed, step, rank). Per-rank model and optimizer states (strategies that are not
    replicated) are merged by the strategy's rule; a server keeps its own part.
    """
    was, servers = elastic["workers"], elastic.get("servers", 0)
    worker_parts = parts[:was]
    meter = sum(p["meter"] for p in worker_parts)
    state = None
    if "model" in worker_parts[0]:  # not replicated: one state from the workers' own
        state = merged_state([{k: p[k] for k in ("model", "optimizer", "scaler") if k in p} for p in worker_parts],
                             "average" if elastic.get("rule") == "average" else "rank0")
    out = []
    for r in range(workers):
        if r < was:
            part = {**worker_parts[r]}
        else:
            rng = derived_rng(seed, step, r, capture, apply)
            part = {**worker_parts[0], "rng": rng, "rng_epoch": rng}
        part["meter"] = meter if r == 0 else torch.zeros_like(meter)
        if state is not None:
            part.update(state)
        out.append((shared, part))
    for i in range(servers):  # a server keeps no part of its own (it loads the global state)
        rng = derived_rng(seed, step, workers + i, capture, apply)
        out.append((shared, {**worker_parts[0], "rng": rng, "rng_epoch": rng, "meter": torch.zeros_like(meter)}))
    return out
