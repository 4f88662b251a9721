"""``nifti:DIR`` — brain volumes (NIfTI via nibabel) sliced by document 000's pipeline (brain.py).

Which files are inputs and which is the target, in the first way that applies:
1. DIR is a manifest file (``.json``/``.csv``), or DIR holds ``manifest.json`` or
   ``manifest.csv`` (see ``brain.read_manifest``);
2. the ``inputs`` and ``target`` options name files by pattern, looked up in DIR itself
   (one subject) or else in each sub-folder of DIR (one subject per folder). A pattern
   without ``*?[`` matches file names containing it: ``inputs=gm,wm target=t1`` picks the
   MNI152 grey- and white-matter maps as two input channels and T1 as the target.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

from ddtrain.errors import DDTrainError
from ddtrain.data.arrays import ArrayDataset
from ddtrain.data.brain import SliceOptions, Subject, read_manifest, slice_subjects
from ddtrain.data.transforms import bool_option, int_option

SUFFIXES = (".nii", ".nii.gz")
MANIFESTS = ("manifest.json", "manifest.csv")


def _patterns(value, name: str) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [p.strip() for p in items if p.strip()]
    if not items:
        raise DDTrainError(f"nifti: option {name} names no files")
    return [p if any(c in p for c in "*?[") else f"*{p}*" for p in items]


def _match(folder: Path, pattern: str, volumes: list[str]) -> Path:
    hits = [v for v in volumes if fnmatch.fnmatch(v.lower(), pattern.lower())]
    if len(hits) != 1:
        found = "no NIfTI file" if not hits else f"{len(hits)} files ({', '.join(hits)})"
        raise DDTrainError(f"nifti: pattern {pattern!r} matches {found} in {folder}; it must match exactly one")
    return folder / hits[0]


def find_subjects(root: Path, inputs, target) -> list[Subject]:
    """Subjects by the file-pattern convention (rule 2 of the module docstring)."""
    if inputs is None or target is None:
        raise DDTrainError(f"nifti: {root} has no manifest.json/manifest.csv; give one, or name the "
                           f"files with the options inputs=PATTERN[,PATTERN...] and target=PATTERN")
    input_patterns, (target_pattern,) = _patterns(inputs, "inputs"), _patterns(target, "target")[:1]

    def volumes(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(SUFFIXES))

    folders = [root] if volumes(root) else sorted(p for p in root.iterdir() if p.is_dir() and volumes(p))
    if not folders:
        raise DDTrainError(f"nifti: no .nii or .nii.gz files in {root} or its sub-folders")
    subjects = []
    for folder in folders:
        names = volumes(folder)
        subjects.append(Subject(folder.name, [_match(folder, p, names) for p in input_patterns],
                                _match(folder, target_pattern, names)))
    return subjects


def load_nifti(path: str, *, inputs=None, target=None, axis="sagittal", pad=192, crop=False, size=None,
               norm="nonzero", step=1, drop_empty=False) -> ArrayDataset:
    """``nifti:DIR`` (or ``nifti:MANIFEST``), sliced into an in-memory regression dataset. Options:

    inputs, target  file patterns when there is no manifest (see the module docstring)
    axis        sagittal (default, as document 000), coronal, axial, or 0/1/2
    pad         zero-pad each slice to pad x pad (default 192); larger slices are an error...
    crop        ...unless crop=true, which centre-crops them
    size        then average-pool to size x size (e.g. 64 for CPU runs; default: pad)
    norm        nonzero (z-score within each channel's nonzero voxels, default), volume, none
    step        keep every step-th slice (default 1)
    drop_empty  drop slices whose target is all background (default false)

    Gives x (S, C, H, W) and y (S, 1, H, W) float32; one subject's slices are consecutive.
    """
    root = Path(path)
    if root.is_file() and root.suffix.lower() in (".json", ".csv"):
        subjects = read_manifest(root)
    elif root.is_dir():
        manifest = next((root / m for m in MANIFESTS if (root / m).is_file()), None)
        subjects = read_manifest(manifest) if manifest else find_subjects(root, inputs, target)
    else:
        raise DDTrainError(f"nifti: {root} is neither a directory nor a .json/.csv manifest")
    opts = SliceOptions(axis=axis, pad=int_option("pad", pad, fmt="nifti"), crop=bool_option("crop", crop, fmt="nifti"),
                        size=None if size is None else int_option("size", size, fmt="nifti"), norm=norm,
                        step=int_option("step", step, fmt="nifti"),
                        drop_empty=bool_option("drop_empty", drop_empty, fmt="nifti"))
    x, y = slice_subjects(subjects, opts)
    if len(x) == 0:
        raise DDTrainError(f"nifti: {root} gave no slices (all background with drop_empty=true?)")
    return ArrayDataset(x, y, num_classes=None)
