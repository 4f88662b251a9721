"""Document 000 §6.1.1's brain-imaging pipeline: registered volumes in, 2-D training slices out.

Per subject: load the input volumes (each 3-D file is one channel, each 4-D file as many
channels as it has volumes, e.g. 90 diffusion b-values) and the target volume (e.g. T1);
check they share one voxel grid (shape and affine); z-score each channel; cut slices along
one anatomical axis (sagittal by default, as the document); zero-pad every slice to a
square (192 by default: the document's 174x145 -> 192x192); optionally average-pool to a
smaller side for CPU runs. The result is (S, C, H, W) inputs and (S, 1, H, W) targets,
ready for ``ArrayDataset`` and a U-Net.

Z-scoring is per channel over that channel's nonzero voxels (``norm="nonzero"``, default):
the volumes are skull-stripped, so background is exactly zero and would otherwise dominate
the statistics (78% of an MNI152 volume); background stays exactly 0, the same value as the
padding. ``norm="volume"`` uses every voxel (what a plain standard scaler over the array,
as the document describes, does); ``norm="none"`` keeps raw intensities. The target is
normalised the same way as the inputs.

    subjects = read_manifest("subjects.json")           # or [Subject("s1", [gm, wm], t1)]
    x, y = slice_subjects(subjects, pad=240, size=64)   # tensors (S, 2, 64, 64), (S, 1, 64, 64)
    dataset = ArrayDataset(x, y)                        # regression: num_classes None
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtrain.errors import DDTrainError, choice_error

AXES = {"sagittal": "LR", "coronal": "AP", "axial": "SI"}  # anatomical name -> orientation letters
NORMS = ("nonzero", "volume", "none")


@dataclass
class Subject:
    """One subject: input volume files (their channels in this order) and the target file."""

    name: str
    inputs: list[Path]
    target: Path


def _nibabel():
    try:
        import nibabel
    except ImportError:
        raise DDTrainError("NIfTI volumes need nibabel: pip install ddtrain[imaging]") from None
    return nibabel


def read_manifest(path) -> list[Subject]:
    """Subjects from a JSON or CSV manifest; relative paths are relative to the manifest.

    JSON: ``{"s1": {"inputs": ["gm.nii.gz", "wm.nii.gz"], "target": "t1.nii.gz"}, ...}`` or a
    list of ``{"subject": "s1", "inputs": [...], "target": ...}``.
    CSV: a header ``subject,inputs,target``; inputs separated by ``;``.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise DDTrainError(f"{path}: cannot read manifest ({exc})") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DDTrainError(f"{path}: not valid JSON ({exc})") from None
        rows = [{"subject": k, **v} if isinstance(v, dict) else {"subject": k, "bad": v}
                for k, v in data.items()] if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise DDTrainError(f"{path}: expected an object of subjects or a list of them")
    elif path.suffix.lower() == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
        if rows and not {"subject", "inputs", "target"} <= set(rows[0]):
            raise DDTrainError(f"{path}: CSV header must name subject, inputs, target; has {list(rows[0])}")
        rows = [{**r, "inputs": [p.strip() for p in (r["inputs"] or "").split(";") if p.strip()]} for r in rows]
    else:
        raise DDTrainError(f"{path}: a manifest is a .json or .csv file")
    subjects = []
    for n, row in enumerate(rows):
        if not isinstance(row, dict) or not row.get("inputs") or not row.get("target") \
                or not isinstance(row["inputs"], list):
            raise DDTrainError(f"{path}: subject entry {n} needs 'inputs' (a list of files) and 'target'")
        subjects.append(Subject(str(row.get("subject", n)), [path.parent / p for p in row["inputs"]],
                                path.parent / row["target"]))
    if not subjects:
        raise DDTrainError(f"{path}: the manifest lists no subjects")
    return subjects


def open_volume(path: Path):
    """The nibabel image of ``path`` (header only; data is read later), or one clear error."""
    nib = _nibabel()
    try:
        image = nib.load(str(path))
    except FileNotFoundError:
        raise DDTrainError(f"{path}: volume file does not exist") from None
    except Exception as exc:  # nibabel raises ImageFileError, OSError, ValueError, zlib/EOF errors
        raise DDTrainError(f"{path}: not a readable NIfTI volume ({type(exc).__name__}: {exc})") from None
    if len(image.shape) not in (3, 4):
        raise DDTrainError(f"{path}: a {len(image.shape)}-D image; expected a 3-D volume or 4-D stack")
    return image


def read_channels(path: Path, image) -> np.ndarray:
    """The voxels as (C, X, Y, Z) float32: a 3-D file is one channel, a 4-D file one per volume."""
    try:
        data = np.asarray(image.dataobj, dtype=np.float32)
    except Exception as exc:  # truncated gzip: EOFError, zlib.error, OSError, ValueError
        raise DDTrainError(f"{path}: truncated or corrupt NIfTI data ({type(exc).__name__}: {exc})") from None
    if not np.isfinite(data).all():
        raise DDTrainError(f"{path}: holds NaN or infinite voxels")
    return data[None] if data.ndim == 3 else np.moveaxis(data, 3, 0)


def zscore_(volume: np.ndarray, norm: str = "nonzero") -> np.ndarray:
    """Z-score each channel of (C, X, Y, Z) in place (statistics in float64); see the module doc."""
    if norm == "none":
        return volume
    for channel in volume:
        inside = channel != 0 if norm == "nonzero" else None
        count = int(inside.sum()) if inside is not None else channel.size
        if count == 0:
            continue
        mean = channel.sum(dtype=np.float64) / count  # background zeros add nothing to the sum
        np.subtract(channel, np.float32(mean), out=channel, where=inside if inside is not None else True)
        std = float(np.sqrt(np.square(channel, dtype=np.float64).sum() / count))  # background is still 0
        np.divide(channel, np.float32(std if std > 0 else 1.0), out=channel,
                  where=inside if inside is not None else True)
    return volume


def resolve_axis(axis, affine, path) -> int:
    """An axis index from 0/1/2 or an anatomical name read off the volume's orientation."""
    if isinstance(axis, int) or str(axis).isdigit():
        if int(axis) not in (0, 1, 2):
            raise DDTrainError(f"axis {axis} is not 0, 1 or 2")
        return int(axis)
    if axis not in AXES:
        raise choice_error("slice axis", str(axis), [*AXES, "0", "1", "2"])
    codes = _nibabel().aff2axcodes(affine)
    for i, code in enumerate(codes):
        if code in AXES[axis]:
            return i
    raise DDTrainError(f"{path}: cannot tell the {axis} axis from its orientation {codes}")


def pad_square(slices, pad: int, crop: bool = False, what: str = "slice") -> torch.Tensor:
    """Zero-pad (S, C, h, w) to (S, C, pad, pad), centred; larger sides are an error unless ``crop``.

    ``slices`` may be a strided numpy view (one copy is made, into the padded output).
    """
    h, w = slices.shape[-2:]
    if (h > pad or w > pad) and not crop:
        raise DDTrainError(f"{what}: slices are {h}x{w}, larger than pad={pad}; "
                           f"choose pad >= {max(h, w)} or crop=true to centre-crop")
    top, left = max(0, (h - pad) // 2), max(0, (w - pad) // 2)
    kept = torch.as_tensor(slices[..., top:top + min(h, pad), left:left + min(w, pad)])
    h, w = kept.shape[-2:]
    out = kept.new_zeros((*kept.shape[:-2], pad, pad))
    out[..., (pad - h) // 2:(pad - h) // 2 + h, (pad - w) // 2:(pad - w) // 2 + w] = kept
    return out


def _slices(volume: np.ndarray, axis: int, step: int) -> np.ndarray:
    """(C, X, Y, Z) -> (S, C, H, W) view: every ``step``-th slice along ``axis``, the other two in order."""
    return np.moveaxis(volume, axis + 1, 0)[::step]


@dataclass(kw_only=True)
class SliceOptions:
    """How volumes become slices (the options of ``nifti:DIR``)."""

    axis: str | int = "sagittal"  # sagittal, coronal, axial (read off the affine) or 0, 1, 2
    pad: int = 192                # zero-pad every slice to pad x pad (document 000: 192)
    crop: bool = False            # centre-crop sides larger than pad instead of refusing
    size: int | None = None       # average-pool the padded slice down to size x size
    norm: str = "nonzero"         # z-score over nonzero voxels, the whole volume, or none
    step: int = 1                 # keep every step-th slice
    drop_empty: bool = False      # drop slices whose target is all zero (outside the head)

    def __post_init__(self):
        if self.norm not in NORMS:
            raise choice_error("norm", self.norm, NORMS)
        if self.pad < 1 or self.step < 1 or (self.size is not None and not 1 <= self.size <= self.pad):
            raise DDTrainError(f"need pad >= 1, step >= 1 and 1 <= size <= pad; got pad={self.pad}, "
                               f"step={self.step}, size={self.size}")


def subject_slices(subject: Subject, opts: SliceOptions | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One subject's (S, C, H, W) input and (S, 1, H, W) target slices, float32."""
    opts = opts or SliceOptions()
    files = [*subject.inputs, subject.target]
    if not subject.inputs:
        raise DDTrainError(f"subject {subject.name}: no input volumes")
    images = [open_volume(Path(f)) for f in files]
    grid_shape, grid_affine = images[-1].shape[:3], images[-1].affine
    for f, image in zip(files, images):
        if image.shape[:3] != grid_shape or not np.allclose(image.affine, grid_affine, atol=1e-4):
            raise DDTrainError(f"{f}: its grid (shape {image.shape[:3]}, affine {image.affine.round(3).tolist()}) "
                               f"differs from the target {subject.target} (shape {grid_shape}, affine "
                               f"{grid_affine.round(3).tolist()}); register the volumes to one space first")
    if len(images[-1].shape) == 4 and images[-1].shape[3] != 1:
        raise DDTrainError(f"{subject.target}: the target must be one volume, not {images[-1].shape[3]}")
    axis = resolve_axis(opts.axis, grid_affine, subject.target)
    parts = []
    for f, image in zip(files, images):  # one file at a time: peak memory is one volume
        volume = zscore_(read_channels(Path(f), image), opts.norm)
        part = pad_square(_slices(volume, axis, opts.step), opts.pad, opts.crop, str(f))
        if opts.size is not None and opts.size != opts.pad:
            part = F.interpolate(part, size=(opts.size, opts.size), mode="area")
        parts.append(part)
    x, y = torch.cat(parts[:-1], dim=1), parts[-1]
    if opts.drop_empty:
        keep = y.flatten(1).ne(0).any(1)
        x, y = x[keep], y[keep]
    return x, y


def iter_slices(subjects: list[Subject], opts: SliceOptions | None = None):
    """Yield (C, H, W) input / (1, H, W) target pairs, subject by subject, slice by slice."""
    for subject in subjects:
        x, y = subject_slices(subject, opts)
        yield from zip(x, y)


def slice_subjects(subjects: list[Subject], opts: SliceOptions | None = None, **options):
    """All subjects' slices stacked: (S, C, H, W) inputs and (S, 1, H, W) targets.

    ``options`` are ``SliceOptions`` fields, a shortcut for ``opts``. Every subject must
    give the same channels. The output is allocated once from the headers' slice counts
    (15 HCP subjects at 97x192x192 are ~31 GB of float32; no second copy is made).
    """
    opts = opts or SliceOptions(**options)
    if not subjects:
        raise DDTrainError("no subjects to slice")
    x_all = y_all = None
    filled = 0
    for subject in subjects:
        x, y = subject_slices(subject, opts)
        if x_all is None:
            bound = sum(-(-_slice_count(s, opts) // opts.step) for s in subjects)
            x_all, y_all = x.new_empty((bound, *x.shape[1:])), y.new_empty((bound, *y.shape[1:]))
        elif x.shape[1:] != x_all.shape[1:]:
            raise DDTrainError(f"subject {subject.name}: slices of shape {tuple(x.shape[1:])} differ from "
                               f"subject {subjects[0].name}'s {tuple(x_all.shape[1:])}")
        x_all[filled:filled + len(x)], y_all[filled:filled + len(y)] = x, y
        filled += len(x)
    return x_all[:filled], y_all[:filled]


def _slice_count(subject: Subject, opts: SliceOptions) -> int:
    image = open_volume(Path(subject.target))
    return image.shape[resolve_axis(opts.axis, image.affine, subject.target)]
