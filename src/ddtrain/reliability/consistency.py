"""Ranks that disagree refuse to start: a fingerprint of what must agree, compared across ranks and with checkpoints.

Before the first collective every rank builds a ``fingerprint`` (model and parameter shapes,
strategy, batch size, dataset size and dtype, versions, the settings of the loop), once per
process; ``check_startup`` compares them with ``all_gather_object`` and a difference stops every
rank, rank 0 naming the differing rank and field. ``check_resumable`` compares the same record
with the one a checkpoint was written under.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch
import torch.distributed as dist

from ddtrain.errors import DDTrainError
from ddtrain.version import __version__

# What ranks and checkpoints compare besides the settings: facts of the run. A resume at any worker
# count needs the same model parameters and data; the world size may change only with the global batch.
FACTS_RESUME = ("parameter_shapes", "train_samples", "sample_shape")
FACTS_RESUME_SAME_WORKERS = ("world_size",)


def marked_settings(config) -> dict[str, dict]:
    """``{name: metadata}`` of every setting of ``config`` (a TrainConfig, its sections walked) that is marked.

    The marks are each field's ``metadata`` (``ddtrain.config`` says what "agree" and "resume"
    mean): the one place that says which settings ranks and checkpoints must share.
    """
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(marked_settings(value))
        elif "agree" in f.metadata or "resume" in f.metadata:
            out[f.name] = dict(f.metadata)
    return out


def _comparable(value):
    return repr(sorted(value.items())) if isinstance(value, dict) else value
class ConfigMismatch(DDTrainError):
    """Ranks (or a checkpoint and this run) disagree on something that must be the same."""


class PeerStopped(DDTrainError):
    """Raised on the ranks other than 0 for a problem rank 0 reports (the CLI prints it once)."""


def _input_dtype(dataset) -> str:
    if hasattr(dataset, "x"):
        return str(dataset.x.dtype)
    sample = dataset[0][0]
    return str(getattr(sample, "dtype", type(sample).__name__))


# The training data's content, cheaply: a checksum of every label and of a fixed sample of inputs
# (evenly spaced, the same on every rank and in every run). Size and shape alone let a resume go on
# over other data of the same shape (labels permuted, another file) without a word.
DATA_FIELDS = ("train_labels", "train_inputs")
DATA_SAMPLE = 32        # inputs checksummed (an image format: its first DATA_SAMPLE_FILES of them, read raw)
DATA_SAMPLE_FILES = 8


def _checksum(*parts) -> str:
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            part = part.detach().cpu().contiguous().numpy()
        if isinstance(part, np.ndarray):
            digest.update(f"{part.dtype}{part.shape}".encode())
            part = np.ascontiguousarray(part).tobytes()
        digest.update(part if isinstance(part, bytes) else repr(part).encode())
    return digest.hexdigest()[:16]


def data_checksums(dataset) -> dict:
    """``{"train_labels": ..., "train_inputs": ...}`` of ``dataset`` (None where its kind keeps them out of reach:
    a lazily computed or user-defined dataset, whose samples may be drawn at random)."""
    n = len(dataset)
    sample = sorted({int(i) for i in np.linspace(0, n - 1, min(n, DATA_SAMPLE)).round()}) if n else []
    labels = inputs = None
    y, x = getattr(dataset, "y", None), getattr(dataset, "x", None)
    if isinstance(y, torch.Tensor):
        labels = _checksum(y)
    elif isinstance(getattr(dataset, "labels", None), np.ndarray):
        labels = _checksum(dataset.labels)
    if isinstance(x, torch.Tensor):
        inputs = _checksum(x[sample])
    elif callable(getattr(dataset, "read", None)):   # an image format: the files' bytes, not decoded
        try:
            inputs = _checksum(*(dataset.read(i) for i in sample[:DATA_SAMPLE_FILES]))
        except Exception:   # an unreadable file is named when training reaches it
            inputs = None
    return {"train_labels": labels, "train_inputs": inputs}


def fingerprint(config, model, data, world_size: int) -> dict:
    """What must be identical on every rank (and in a checkpoint we resume from).

    The facts of the run (versions, parameter shapes, the data set's size, shape and dtype), every
    setting marked ``agree=True``, and under ``resume`` each setting's resume rule ("same" or
    "same-workers"), so that a checkpoint header says what its run required of a resume.
    """
    shapes = [[name, list(p.shape), str(p.dtype).replace("torch.", "")] for name, p in model.named_parameters()]
    marks, flat = marked_settings(config), config.flat()
    out = {"ddtrain": __version__, "torch": str(torch.__version__), "world_size": world_size,
           **{name: _comparable(flat[name]) for name, mark in marks.items() if mark.get("agree") is True},
           "parameter_count": sum(p.numel() for p in model.parameters()), "parameter_shapes": shapes,
           "train_samples": len(data.train),
           "val_samples": len(data.val) if data.val is not None else 0, "sample_shape": list(data.sample_shape),
           "input_dtype": _input_dtype(data.train), "num_classes": data.num_classes,
           **data_checksums(data.train)}
    out["resume"] = {name: mark["resume"] for name, mark in marks.items()
                     if mark.get("resume") in ("same", "same-workers")}
    # a resume needs the same data unless resume_data_change (--resume-data-change) says other data is meant
    if not getattr(config.reliability, "resume_data_change", False):
        out["resume"].update(dict.fromkeys(DATA_FIELDS, "same"))
    return out


def resume_fields(fingerprint: dict, *, same_workers: bool = True) -> tuple[str, ...]:
    """What a checkpoint must share with the run ``fingerprint`` describes (at another worker count: ``same_workers``
    False, the global batch kept, the per-rank batch and the world size may differ)."""
    rules = fingerprint.get("resume", {})
    return (FACTS_RESUME + (FACTS_RESUME_SAME_WORKERS if same_workers else ())
            + tuple(name for name, rule in rules.items() if rule == "same" or (same_workers and rule == "same-workers")))


def _show(field: str, value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def differences(reference: dict, other: dict, fields=None, *, recorded_only: bool = False) -> list[str]:
    """'field: A vs B' for every field where ``other`` differs from ``reference``.

    ``recorded_only``: fields ``other`` does not hold are skipped (a checkpoint written before the
    field was recorded is not held to it).
    """
    out = []
    for field in fields or reference:
        if recorded_only and field not in other:
            continue
        a, b = reference.get(field), other.get(field)
        if a == b:
            continue
        if field in DATA_FIELDS:
            what = "labels" if field == "train_labels" else f"inputs (a fixed sample of {DATA_SAMPLE})"
            # recorded_only: a checkpoint's fingerprint (a rank's, at start-up, holds every field)
            override = "; to train on this data anyway: --resume-data-change" if recorded_only else ""
            out.append(f"other training data of the same size and shape: its {what} differ "
                       f"(checksum {b} vs {a}{override})")
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
    found = differences(current, header.get("fingerprint", {}), resume_fields(current), recorded_only=True)
    if found:
        raise ConfigMismatch(f"checkpoint {path} does not fit this run: it has " + ", ".join(found)
                             + " (this run has the second value); resume with the same settings "
                             "or use another checkpoint directory (checkpoint_dir, --checkpoint-dir)")
