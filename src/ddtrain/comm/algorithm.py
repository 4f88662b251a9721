"""One record per all-reduce algorithm (``Algorithm``: its name, its function and its cost), as nccl-tests keeps a
collective's traits in its own file.

Each algorithm module ends with ``ALGORITHM = Algorithm(...)`` and ``ddtrain.comm`` registers it
(``register_algorithm``). Its cost is three pure functions beside its code, each optional (the cost
model and ``ddtrain advise`` leave out, with the reason, an algorithm that lacks one they need):

- ``time(nbytes, ranks, alpha, beta, gamma=0.0) -> seconds``: Hockney's α-β model with Thakur,
  Rabenseifner & Gropp's γ: α seconds to start a message, β seconds per byte on a link, γ seconds
  per byte to combine two buffers locally; a step in which every rank sends and receives ``m``
  bytes at once costs ``α + mβ``, and the time is the sum over the steps on the critical path;
- ``steps(nbytes, ranks) -> [bytes, ...]``: the ``m`` of each of those steps, in order, so that a
  term that depends on the order of the messages (the token bucket of a rate-limited link) or on
  their number (α under load) can be applied to any algorithm. ``sum(α + mβ for m in steps)``
  equals ``time`` with γ = 0 (tests/costmodel/test_advise_terms.py checks every registered one);
- ``link_share(ranks, procs_per_node) -> factor``: the β multiplier when ``procs_per_node`` ranks
  sit behind one node's link and send across it at the same time (1 with one rank per node).
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

import torch

from ddtrain.errors import DDTrainError


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """An all-reduce algorithm of ``ddtrain.comm``, as everything else sees it."""

    name: str                                              # the --algorithm word
    all_reduce: Callable[..., torch.Tensor]                # (tensor, op="sum", group=None, *, timeout_s=None) -> tensor
    time: Callable[..., float] | None = None               # (nbytes, ranks, alpha, beta, gamma=0.0) -> seconds
    steps: Callable[[float, int], list[float]] | None = None   # (nbytes, ranks) -> bytes of each critical-path step
    link_share: Callable[[int, int], float] | None = None  # (ranks, procs_per_node) -> β multiplier of a shared link
    summary: str = ""                                      # one line for docs and --help

    def missing_cost(self) -> list[str]:
        """What the adviser needs of this record and it lacks, in words (empty: nothing)."""
        return [what for what, present in (("no cost formula", self.time), ("no message schedule", self.steps),
                                           ("no link-sharing rule", self.link_share)) if present is None]

    def added_bytes(self, nbytes: float, ranks: int) -> float:
        """Bytes combined locally on the critical path: the γ coefficient of ``time`` (α = β = 0, γ = 1)."""
        if self.time is None:
            raise DDTrainError(f"algorithm {self.name!r} has no cost formula")
        return self.time(nbytes, ranks, 0.0, 0.0, 1.0)


def trivial_cost(nbytes: float, ranks: int) -> bool:
    """Check a cost formula's (or a schedule's) arguments; True when nothing moves (one rank or zero bytes: 0 s)."""
    if ranks < 1:
        raise DDTrainError(f"the number of ranks must be >= 1, got {ranks}")
    if nbytes < 0:
        raise DDTrainError(f"the message size must be >= 0 bytes, got {nbytes}")
    return ranks == 1 or nbytes == 0


def link_shared(ranks: int, procs_per_node: int) -> bool:
    """Check a link-sharing rule's arguments; True when ranks of one node cross its link together.

    False with one rank per node, or with every rank on one node (no link is crossed: the caller
    drops β), where every rule's factor is 1.
    """
    if procs_per_node < 1 or ranks < 1 or ranks % procs_per_node:
        raise DDTrainError(f"procs per node must be >= 1 and divide the ranks ({ranks}), got {procs_per_node}")
    return not (procs_per_node == 1 or ranks == procs_per_node)
