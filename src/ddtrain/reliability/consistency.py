"""Ranks that disagree refuse to start: a fingerprint of what must agree, compared across ranks and with checkpoints.

Before the first collective every rank builds a ``fingerprint`` (model and parameter shapes,
strategy, batch size, dataset size and dtype, versions, the settings of the loop), once per
process; ``check_startup`` compares them with ``all_gather_object`` and a difference stops every
rank, rank 0 naming the differing rank and field. ``check_resumable`` compares the same record
with the one a checkpoint was written under.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.version import __version__

# Settings every rank must share (paths such as --data or --out may differ between hosts).
AGREE = ("epochs", "steps", "lr", "momentum", "weight_decay", "optimizer", "seed", "val_fraction", "sharding",
         "amp", "sync_every", "servers", "staleness", "check_every", "checkpoint_every", "on_nonfinite",
         "on_mismatch")
# What a checkpoint must share with the run that resumes from it (lr or epochs may change).
RESUME_FIELDS = ("world_size", "model", "model_args", "parameter_shapes", "strategy", "batch_size",
                 "train_samples", "sample_shape", "seed", "sharding", "optimizer", "amp")


class ConfigMismatch(DDTrainError):
    """Ranks (or a checkpoint and this run) disagree on something that must be the same."""


class PeerStopped(DDTrainError):
    """Raised on the ranks other than 0 for a problem rank 0 reports (the CLI prints it once)."""


def _input_dtype(dataset) -> str:
    if hasattr(dataset, "x"):
        return str(dataset.x.dtype)
    sample = dataset[0][0]
    return str(getattr(sample, "dtype", type(sample).__name__))


def fingerprint(config, model, data, world_size: int) -> dict:
    """What must be identical on every rank (and in a checkpoint we resume from)."""
    shapes = [[name, list(p.shape), str(p.dtype).replace("torch.", "")] for name, p in model.named_parameters()]
    out = {"ddtrain": __version__, "torch": str(torch.__version__), "world_size": world_size, "model": config.model,
           "model_args": repr(sorted(config.model_args.items())),
           "parameter_count": sum(p.numel() for p in model.parameters()), "parameter_shapes": shapes,
           "strategy": config.strategy, "batch_size": config.recipe.batch_size, "train_samples": len(data.train),
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


def check_startup(mine: dict) -> None:
    """Collective: refuse to start when any rank's fingerprint (``mine`` on this rank) differs from rank 0's."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
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
                             "or use another checkpoint directory (checkpoint_dir, --checkpoint-dir)")
