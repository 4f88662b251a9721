"""One record per all-reduce algorithm (``Algorithm``: its name, its function and its cost formula), as nccl-tests
keeps a collective's traits in its own file.

Each algorithm module ends with ``ALGORITHM = Algorithm(...)`` and ``ddtrain.comm`` registers it
(``register_algorithm``). A cost formula is a pure function ``(nbytes, ranks, alpha, beta,
gamma=0.0) -> seconds`` of Hockney's α-β model with Thakur, Rabenseifner & Gropp's γ: α
seconds to start a message, β seconds per byte on a link, γ seconds per byte to combine two
buffers locally; a step in which every rank sends and receives ``m`` bytes at once costs
``α + mβ``, and the time is the sum over the steps on the critical path.
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
    summary: str = ""                                      # one line for docs and --help


def trivial_cost(nbytes: float, ranks: int) -> bool:
    """Check a cost formula's arguments; True when nothing moves (one rank or zero bytes: 0 s)."""
    if ranks < 1:
        raise DDTrainError(f"the number of ranks must be >= 1, got {ranks}")
    if nbytes < 0:
        raise DDTrainError(f"the message size must be >= 0 bytes, got {nbytes}")
    return ranks == 1 or nbytes == 0
