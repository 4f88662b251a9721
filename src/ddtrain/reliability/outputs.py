"""Outputs never clobber inputs or each other: checked in the launching process, before any worker starts.

A run's outputs are ``--out``, ``--save``, ``--trace``, ``--checkpoint-dir`` and the folders
or files of the tracking section when there is one; its inputs are the data set's file or folder
(``--data FORMAT:PATH``) and any ``--data-arg`` naming an existing path. An output may not be
an input, lie inside the data set's folder, be another output, or (a file) lie inside the
checkpoint directory under a checkpoint's name. Paths are compared after resolving symlinks,
so ``--save`` through a link onto the training ``.npz`` is caught too.
"""
from __future__ import annotations

import os
from pathlib import Path

from ddtrain.errors import DDTrainError


def _resolved(path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))


def outputs(config) -> list[tuple[str, str, bool]]:
    """(flag, path, is a folder) of every output the config names."""
    found = [("--out", config.out, False), ("--save", config.save, False),
             ("--trace", getattr(config.profile, "trace", None), False),
             ("--checkpoint-dir", config.reliability.checkpoint_dir, True)]
    tracking = getattr(config, "tracking", None)
    for name in getattr(tracking, "__dataclass_fields__", {}):
        value = getattr(tracking, name)
        if isinstance(value, str) and value and name.endswith(("_dir", "_file", "_path")):
            found.append(("--" + name.replace("_", "-"), value, name.endswith("_dir")))
    return [(flag, str(path), folder) for flag, path, folder in found if path]


def inputs(config) -> list[tuple[str, Path]]:
    """(what, resolved path) of every existing path the data set is read from."""
    fmt, _, arg = str(config.data.data).partition(":")
    found = []
    if arg and os.path.exists(os.path.expanduser(arg)):
        found.append((f"--data {config.data.data}", _resolved(arg)))
    for key, value in (config.data.data_args or {}).items():
        if isinstance(value, str) and value and os.path.exists(os.path.expanduser(value)):
            found.append((f"--data-arg {key}={value}", _resolved(value)))
    return found


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check(config) -> None:
    """Raise DDTrainError naming both paths when an output would overwrite an input or another output."""
    named = outputs(config)
    sources = inputs(config)
    for flag, path, folder in named:
        target = _resolved(path)
        for what, source in sources:
            if target == source:
                raise DDTrainError(f"{flag} {path} is the data set itself ({what}): writing there would destroy "
                                   "the training data; choose another path")
            if source.is_dir() and _inside(target, source):
                raise DDTrainError(f"{flag} {path} lies inside the data set's folder ({what}): the output would be "
                                   "read as data by later runs, or replace part of it; write it outside that folder")
            if folder and _inside(source, target):
                raise DDTrainError(f"{flag} {path} contains the data set ({what}): checkpoint rotation and "
                                   "damaged-file handling would act on the data; choose a folder of its own")
    for i, (flag, path, folder) in enumerate(named):
        target = _resolved(path)
        for other_flag, other, other_folder in named[i + 1:]:
            second = _resolved(other)
            if target == second:
                raise DDTrainError(f"{flag} and {other_flag} name the same path {path}: one output would replace "
                                   "the other; give each its own")
            if folder and not other_folder and _inside(second, target) and _looks_like_checkpoint(second.name):
                raise DDTrainError(f"{other_flag} {other} is named like a checkpoint inside {flag} {path}: "
                                   "checkpoint rotation would delete it; choose another name")
            if other_folder and not folder and _inside(target, second) and _looks_like_checkpoint(target.name):
                raise DDTrainError(f"{flag} {path} is named like a checkpoint inside {other_flag} {other}: "
                                   "checkpoint rotation would delete it; choose another name")


def _looks_like_checkpoint(name: str) -> bool:
    from ddtrain.reliability.checkpoint import NAME
    return bool(NAME.match(name)) or name.startswith(".ddtrain-")
