"""Consistency guards: ranks that disagree refuse to start, replicas that drift apart are caught.

* ``check_startup``: before the first collective every rank builds a fingerprint of what must
  agree (model and parameter shapes, strategy, batch size, dataset size and dtype, versions,
  the settings of the loop) and ``all_gather_object`` compares them; a difference stops every
  rank, rank 0 naming the differing rank and field.
* ``replica_checksums``: per parameter, two int64 hashes of the bits (a plain and a
  position-weighted wrap-around sum), gathered and compared exactly. Only when the strategy
  says its replicas must be bitwise identical at this step (``replicas_identical(step)``).
* ``nonfinite``: a non-finite loss or gradient stops the run naming step and rank, or, with
  ``--on-nonfinite skip``, the ranks agree through one all-reduce of a flag per rank and all
  skip the step together (a rank skipping alone would leave the replicas apart).

The loop calls these through ``ddtrain.reliability.keeper.Keeper``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError

# Settings every rank must share (paths such as --data or --out may differ between hosts).
AGREE = ("epochs", "steps", "lr", "momentum", "weight_decay", "optimizer", "seed", "val_fraction", "sharding",
         "amp", "sync_every", "servers", "staleness", "check_every", "checkpoint_every", "on_nonfinite",
         "on_mismatch")
# What a checkpoint must share with the run that resumes from it (lr or epochs may change).
RESUME_FIELDS = ("world_size", "model", "model_args", "parameter_shapes", "strategy", "batch_size",
                 "train_samples", "sample_shape", "seed", "sharding", "optimizer", "amp")
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ConfigMismatch(DDTrainError):
    """Ranks (or a checkpoint and this run) disagree on something that must be the same."""


class ReplicaMismatch(DDTrainError):
    """Replicas that must be identical are not."""


class PeerStopped(DDTrainError):
    """Raised on the ranks other than 0 for a problem rank 0 reports (the CLI prints it once)."""


def _input_dtype(dataset) -> str:
    if hasattr(dataset, "x"):
        return str(dataset.x.dtype)
    sample = dataset[0][0]
    return str(getattr(sample, "dtype", type(sample).__name__))


def fingerprint(config, model, data, world_size: int) -> dict:
    """What must be identical on every rank (and in a checkpoint we resume from)."""
    from ddtrain import __version__
    shapes = [[name, list(p.shape), str(p.dtype).replace("torch.", "")] for name, p in model.named_parameters()]
    out = {"ddtrain": __version__, "torch": str(torch.__version__), "world_size": world_size, "model": config.model,
           "model_args": repr(sorted(config.model_args.items())),
           "parameter_count": sum(p.numel() for p in model.parameters()), "parameter_shapes": shapes,
           "strategy": config.strategy, "batch_size": config.batch_size, "train_samples": len(data.train),
           "val_samples": len(data.val) if data.val is not None else 0, "sample_shape": list(data.sample_shape),
           "input_dtype": _input_dtype(data.train), "num_classes": data.num_classes}
    flat = config.flat()
    out.update({name: flat[name] for name in AGREE})
    return out


def _show(field: str, value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(reference: dict, other: dict, fields=None) -> list[str]:
    """'field: A vs B' for every field where ``other`` differs from ``reference``."""
    out = []
    for field in fields or reference:
        a, b = reference.get(field), other.get(field)
        if a == b:
            continue
        if field == "parameter_shapes" and isinstance(a, list) and isinstance(b, list):
            pairs = [(x, y) for x, y in zip(a, b) if x != y]
            if pairs:
                (name, shape_a, _), (_, shape_b, _) = pairs[0]
                out.append(f"parameter_shapes ('{name}' is {tuple(shape_b)} vs {tuple(shape_a)})")
            else:
                out.append(f"parameter_shapes ({len(b)} vs {len(a)} parameters)")
            continue
        out.append(f"{field}={_show(field, b)} vs {_show(field, a)}")
    return out


def check_startup(config, model, data) -> None:
    """Collective: refuse to start when any rank's fingerprint differs from rank 0's."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = fingerprint(config, model, data, dist.get_world_size())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    problems = [f"rank {r} has " + ", ".join(d) for r, p in enumerate(everyone)
                if (d := differences(everyone[0], p))]
    if not problems:
        return
    message = ("ranks disagree on their configuration, refusing to start: " + "; ".join(problems)
               + " (where rank 0 has the second value)")
    raise (ConfigMismatch if dist.get_rank() == 0 else PeerStopped)(message)


def check_resumable(header: dict, current: dict, path) -> None:
    """Raise ConfigMismatch if the checkpoint in ``path`` was written by an incompatible run."""
    found = differences(current, header.get("fingerprint", {}), RESUME_FIELDS)
    if found:
        raise ConfigMismatch(f"checkpoint {path} does not fit this run: it has " + ", ".join(found)
                             + " (this run has the second value); resume with the same settings "
                             "or use another --checkpoint-dir")


# ---- replicas --------------------------------------------------------------------------------

def parameter_checksums(module) -> tuple[list[str], torch.Tensor]:
    """Names and a (P, 2) int64 tensor: a plain and a position-weighted wrap-around sum of each parameter's bits."""
    names, rows = [], []
    for name, p in module.named_parameters():
        flat = p.detach().reshape(-1)
        bits = flat.view(INT_OF_SIZE[flat.element_size()]).to(torch.int64) if flat.is_floating_point() \
            else flat.to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 8191 + 1
        rows.append(torch.stack([bits.sum(), (bits * weights).sum()]))
        names.append(name)
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def compare_replicas(module, group=None) -> dict:
    """Collective over ``group``: {group rank: [names of parameters that differ from group rank 0's]}."""
    names, mine = parameter_checksums(module)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return {r: [names[i] for i in range(len(names)) if not torch.equal(t[i], everyone[0][i])]
            for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])}


def rebroadcast_(module, group=None) -> None:
    """Collective: overwrite every rank's parameters and buffers with group rank 0's."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def describe_mismatch(step: int, diffs: dict, group=None) -> str:
    parts = []
    for r, names in sorted(diffs.items()):
        glob = dist.get_global_rank(group, r) if group is not None else r
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        parts.append(f"rank {glob} ('{names[0]}'{more})")
    root = dist.get_global_rank(group, 0) if group is not None else 0
    verb = "differs" if len(parts) == 1 else "differ"
    return f"replicas differ after {step} steps: " + ", ".join(parts) + f" {verb} from rank {root}"


# ---- non-finite values -----------------------------------------------------------------------

def grads_finite(module) -> bool:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack(norms)).all().item())


def agree_on_bad(loss_bad: bool, grads_bad: bool, device, group=None) -> tuple[list[int], str]:
    """Collective: (global ranks to blame, "loss" or "gradients"), the same on every rank; ([], "") if none.

    Gradients that went through an all-reduce are non-finite everywhere once they are on one
    rank, so the ranks whose loss was non-finite are named first.
    """
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        me = dist.get_rank() if dist.is_initialized() else 0
        return ([me], "loss") if loss_bad else ([me], "gradients") if grads_bad else ([], "")
    flags = torch.zeros(2, dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[0, dist.get_rank(group)], flags[1, dist.get_rank(group)] = int(loss_bad), int(grads_bad)
    dist.all_reduce(flags, group=group)
    for row, cause in ((0, "loss"), (1, "gradients")):
        ranks = [r for r, f in enumerate(flags[row].tolist()) if f]
        if ranks:
            return [dist.get_global_rank(group, r) if group is not None else r for r in ranks], cause
    return [], ""
