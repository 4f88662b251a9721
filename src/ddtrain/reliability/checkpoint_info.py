"""What a checkpoint file (or a checkpoint directory) holds, and whether it can be trusted: ``ddtrain checkpoint info``.

``inspect(target)`` reads a file or every checkpoint of a directory without running any code
of it (``checkpoint.read``: the header's checksum, the payload's length and SHA-256, then
``torch.load(weights_only=True)``, then the payload's structure) and returns one ``FileInfo``
per file; ``lines`` renders them. A checkpoint is described by its header: step and epoch,
the run's configuration (strategy, model, data, global batch, gradient accumulation, workers,
seed), its size, and the worker counts it can resume on (``checkpoint_elastic``). A script's state
(``ddtrain.save_state``, header kind "state") is read the same way and described by its own lines.
A file that a run's rotation removes while the directory is read (``checkpoint.Vanished``) is
reported as gone, not as damaged (issue 32: polling a directory in use called good files damaged).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ddtrain.errors import DDTrainError
from ddtrain.reliability import checkpoint, checkpoint_elastic


@dataclass
class FileInfo:
    """One checkpoint file: its header (when readable) and what is wrong with it (None: whole).

    ``gone``: removed (rotated away) between the listing and the reading: neither whole nor damaged.
    """

    path: Path
    size_bytes: int
    header: dict = field(default_factory=dict)
    problem: str | None = None
    gone: bool = False


def inspect_file(path) -> FileInfo:
    """Read and verify one file; a damaged one says what is wrong (its header is kept where it could be read)."""
    path = Path(path)
    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    info = FileInfo(path, size)
    try:
        info.header, _ = checkpoint.read_header(path)
        header, payload = checkpoint.read(path)
        checkpoint.check_payload(payload, header, path)
    except checkpoint.Vanished:
        info.gone = True
    except checkpoint.Damaged as exc:
        info.problem = str(exc)
    except DDTrainError as exc:   # whole bytes, but not what the training loop writes
        info.problem = str(exc).split(": ", 1)[-1]
    return info


def inspect(target) -> list[FileInfo]:
    """Every checkpoint of directory ``target`` (newest first), or the one file ``target``."""
    target = Path(target)
    if target.is_dir():
        found = checkpoint.listing(target)
        if not found:
            raise DDTrainError(f"{target}: no checkpoint files (ckpt-NNNNNNNN.pt) in this directory")
        return [inspect_file(path) for _, path in found]
    if not target.exists():
        raise DDTrainError(f"{target}: no such file or directory")
    return [inspect_file(target)]


def resumes_on(header: dict) -> str:
    """The worker counts a checkpoint can resume on, and how (its strategy's resize rule)."""
    elastic = header.get("elastic")
    if not isinstance(elastic, dict):
        world = header.get("world_size", "?")
        return f"{world} workers only (written before elastic checkpoints: no elastic section)"
    counts = elastic.get("worker_counts", [])
    shown = ", ".join(map(str, counts[:16])) + (", ..." if len(counts) > 16 else "")
    if "fixed" in elastic:
        return f"{shown} workers only ({elastic['fixed']})"
    rule = checkpoint_elastic.RULES.get(elastic.get("rule"), elastic.get("rule") or "?")
    if header.get("kind") == checkpoint.STATE_KIND:
        return f"{shown} workers (those whose count x grad_accum divides the global batch); {rule}"
    return f"{shown} workers (any divisor of the global batch; --grad-accum re-chosen where needed); {rule}"


def _state_lines(h: dict) -> list[str]:
    """The facts of a script's state (``ddtrain.save_state``: header kind "state")."""
    fp, el = h.get("fingerprint") or {}, h.get("elastic") or {}
    batch = (f"global batch {el['global_batch_size']}" if el.get("global_batch_size")
             else f"batch {fp.get('batch_size', '?')} per worker")
    names = lambda lists: ", ".join("+".join(x) or "-" for x in lists) or "-"   # noqa: E731  one model's, then the next's
    return [f"  written by:    ddtrain.save_state (a script's state, {fp.get('models', '?')} prepared model(s))",
            f"  step:          {h.get('step')} optimizer steps (the loader's epoch {h.get('epoch', 1) - 1} counted "
            f"from 0, {h.get('step_in_epoch')} of its steps done)",
            f"  configuration: strategy {h.get('strategy', '?')}, optimizers {names(fp.get('optimizers', []))}, "
            f"schedulers {names(fp.get('schedulers', []))}, {fp.get('train_samples', '?')} training samples, {batch}, "
            f"grad-accum {el.get('grad_accum', '?')}, {el.get('workers', h.get('world_size', '?'))} workers, "
            f"seed {fp.get('seed', '?')}",
            f"  parameters:    {fp.get('parameter_count', '?')} in {len(fp.get('parameter_shapes', []))} tensors"]


def lines(info: FileInfo) -> list[str]:
    """The description of one file, one fact per line."""
    h = info.header
    out = [f"checkpoint {info.path}"]
    if h and h.get("kind") == checkpoint.STATE_KIND:
        out += _state_lines(h)
        out += [f"  size:          {info.size_bytes} bytes (payload {h.get('payload_bytes', '?')})",
                f"  resumes on:    {resumes_on(h)}"]
    elif h:
        fp, el = h.get("fingerprint") or {}, h.get("elastic") or {}
        workers = el.get("workers", h.get("world_size", "?"))
        servers = f", {el['servers']} parameter server(s)" if el.get("servers") else ""
        batch = (f"global batch {el['global_batch_size']}" if el.get("global_batch_size")
                 else f"batch {fp.get('batch_size', '?')} per worker")
        out += [f"  step:          {h.get('step')} (epoch {h.get('epoch')}, {h.get('step_in_epoch')} of its steps done)",
                f"  configuration: strategy {h.get('strategy', fp.get('strategy', '?'))}, model {fp.get('model', '?')}, "
                f"data {el.get('data', '?')} ({fp.get('train_samples', '?')} training samples), {batch}, "
                f"grad-accum {el.get('grad_accum', '?')}, {workers} workers{servers}, "
                f"seed {fp.get('seed', '?')}",
                f"  parameters:    {fp.get('parameter_count', '?')} in {len(fp.get('parameter_shapes', []))} tensors",
                f"  size:          {info.size_bytes} bytes (payload {h.get('payload_bytes', '?')})",
                f"  resumes on:    {resumes_on(h)}"]
        run = h.get("run") or {}
        if run.get("run_id"):
            out.append(f"  written by:    run {run['run_id']}")
    if info.gone:
        out.append("  integrity:     gone: removed while being read (rotated away by the run writing this "
                   "directory); not damaged")
    elif info.problem is None and not checkpoint.verified(h):
        out.append("  integrity:     ok, but its header is unverified: a format-1 file without a header checksum "
                   "(written before header checksums); its step agrees with its payload's, the payload's length "
                   "and SHA-256 are verified, it loads with weights_only")
    elif info.problem is None:
        out.append("  integrity:     ok (header checksum, payload length and SHA-256 verified; loads with "
                   "weights_only; per-rank parts and model/optimizer state present)")
    else:
        out.append(f"  integrity:     DAMAGED: {info.problem}")
    return out
