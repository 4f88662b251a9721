"""Is a directory the same on every node? Checkpoints across nodes and restarts need shared storage.

Rank 0 alone writes checkpoints, so without restarts a node-local ``--checkpoint-dir`` is
enough. With restarts it is not: after a restart by torchrun's c10d rendezvous, rank 0 may be
a process on another node, which finds no checkpoint there and would start from step 0,
losing the progress without a word. ``check_shared`` (collective, every rank, before resuming)
has rank 0 write a marker file and every rank look for it, and compares what each rank sees
of the checkpoints; it refuses where progress would be lost, naming the ranks and hosts.
"""
from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path

import torch.distributed as dist

from ddtrain.errors import DDTrainError

MARKER_PREFIX = ".ddtrain-visible-"


def _newest_checkpoint(directory: Path) -> str | None:
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("ckpt-") and n.endswith(".pt"))
    except OSError:
        return None
    return names[-1] if names else None


def restarts_allowed(configured: int = 0) -> int:
    """How often this job may be restarted: ``--max-restarts``, or torchrun's (TORCHELASTIC_MAX_RESTARTS)."""
    raw = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return max(configured, int(raw.strip()) if raw.strip().isdecimal() else 0)


def check_shared(directory, *, attempt: int, max_restarts: int) -> None:
    """Collective: refuse (DDTrainError on every rank) when ``directory`` is not shared and progress would be lost.

    Refused: a restart (``attempt`` > 0) where rank 0 sees no checkpoint but another rank
    does (rank 0 moved to a node without them), and a first attempt that may be restarted
    (``max_restarts`` > 0) when some rank cannot see the directory rank 0 writes to.
    A world of one, or a directory every rank sees, passes.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    directory, rank, world = Path(directory), dist.get_rank(), dist.get_world_size()
    marker = None
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        marker = MARKER_PREFIX + secrets.token_hex(8)
        (directory / marker).touch()
    names = [marker]
    dist.broadcast_object_list(names, src=0)
    try:
        mine = (socket.gethostname(), (directory / names[0]).exists(), _newest_checkpoint(directory))
        seen = [None] * world
        dist.all_gather_object(seen, mine)
    finally:
        if rank == 0:
            (directory / names[0]).unlink(missing_ok=True)
    host0, _, newest0 = seen[0]
    blind = [(r, host) for r, (host, visible, _) in enumerate(seen) if not visible]
    if attempt > 0 and newest0 is None:
        others = [(r, host, newest) for r, (host, _, newest) in enumerate(seen) if newest]
        if others:
            r, host, newest = others[0]
            raise DDTrainError(
                f"restart {attempt}: rank 0 (host {host0}) finds no checkpoint in {directory}, but rank {r} "
                f"(host {host}) sees {newest} there: the checkpoint directory is not shared between nodes, and "
                f"starting from step 0 would lose the progress; put --checkpoint-dir on storage every node "
                f"mounts, or continue on {host} with --resume")
    if blind and (attempt > 0 or max_restarts > 0):
        ranks = ", ".join(f"rank {r} (host {host})" for r, host in blind[:4]) + (" ..." if len(blind) > 4 else "")
        raise DDTrainError(
            f"--checkpoint-dir {directory} is not shared between nodes: {ranks} cannot see the file rank 0 "
            f"(host {host0}) wrote there; with restarts rank 0 may move to another node and find no checkpoint. "
            f"Put it on storage every node mounts (NFS, Lustre, ...), or run without --max-restarts")
