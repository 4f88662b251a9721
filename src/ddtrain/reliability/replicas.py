"""Replicas that drift apart are caught: per-parameter checksums of the bits, gathered and compared exactly.

``ReplicaCheck`` owns its schedule (every ``check_every`` steps, else at each epoch's last step)
and runs only where the strategy says its replicas must be bitwise identical at that step
(``replicas_identical(step)``). Each parameter's bits are hashed into two int64 numbers (a plain
and a position-weighted wrap-around sum, ``checksums``: one pass per check); a difference stops
the run naming rank and parameter, or (``on_mismatch="rebroadcast"``) copies rank 0's
parameters to every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ddtrain.distributed import runtime
from ddtrain.errors import DDTrainError
from ddtrain.reliability import stall
from ddtrain.reliability.consistency import PeerStopped

INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
WEIGHT_PERIOD = 8191   # positions are weighted 1..8191 (a prime), so swapped values change the hash


class ReplicaMismatch(DDTrainError):
    """Replicas that must be identical are not."""


def checksums(tensors) -> torch.Tensor:
    """A (len(tensors), 2) int64 tensor: a plain and a position-weighted wrap-around sum of each tensor's bits."""
    rows = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(INT_OF_SIZE[flat.element_size()]).to(torch.int64) if flat.is_floating_point() \
            else flat.to(torch.int64)
        weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % WEIGHT_PERIOD + 1
        rows.append(torch.stack([bits.sum(), (bits * weights).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def compare_replicas(module, group=None) -> dict:
    """Collective over ``group``: {group rank: [names of parameters that differ from group rank 0's]}."""
    named = list(module.named_parameters())
    names, mine = [name for name, _ in named], checksums([p for _, p in named])
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


class ReplicaCheck:
    """The loop's replica check: ``due(step, end_of_epoch)``, then ``check(step)`` (a collective)."""

    def __init__(self, strategy, *, check_every: int, on_mismatch: str, info: dict):
        self.strategy, self.module, self.group = strategy, strategy.module, strategy.group
        self.check_every, self.on_mismatch, self.info = check_every, on_mismatch, info

    def due(self, step: int, end_of_epoch: bool) -> bool:
        """The same steps on every rank: every ``check_every`` steps, else at the end of each epoch."""
        return step % self.check_every == 0 if self.check_every else end_of_epoch

    def check(self, step: int) -> None:
        if not self.strategy.replicas_identical(step):
            return
        stall.mark(step, "replica checksum (all-gather)")
        diffs = compare_replicas(self.module, self.group)
        self.info["replica_checks"] += 1
        if not diffs:
            return
        message = describe_mismatch(step, diffs, self.group)
        if self.on_mismatch == "stop":
            cls = ReplicaMismatch if runtime.rank() == 0 else PeerStopped
            raise cls(message + "; stopping (--on-mismatch rebroadcast, or fit(..., on_mismatch='rebroadcast'), "
                      "copies rank 0's parameters to every rank and goes on instead)")
        rebroadcast_(self.module, self.group)
        self.info["rebroadcasts"].append(step)
        if runtime.rank() == 0:
            runtime.eprint(f"ddtrain: warning: {message}; rank 0's parameters were broadcast to every rank")
