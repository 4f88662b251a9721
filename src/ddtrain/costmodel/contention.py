"""Ranks sharing a host: the CPU they share (compute and the messages' own work) and the link they share.

- **CPU.** ``ranks`` processes that each keep ``threads`` cores busy on a host of ``cores`` cores
  get ``cores / (ranks · threads)`` of a core each once they outnumber the cores: a compute step
  measured alone takes ``max(1, ranks · threads / cores)`` times longer. In the emulated cluster
  every node is a namespace on the same host, so all ranks of the job share its cores.
- **Link.** ``procs_per_node`` ranks on one node share its one link. In a ring (ours, the
  pipelined one, Gloo's) consecutive ranks sit on the same node, so only one hop per node crosses
  the link in each step and the link carries what one rank per node would: factor 1. In tree,
  butterfly and central the ranks of a node send across the link at the same time in the steps
  whose partner is on another node: up to ``procs_per_node`` flows share it (factor
  ``procs_per_node``); for central the root's link carries only the ranks off its node.
"""
from __future__ import annotations

from ddtrain.costmodel.schedule import RING_LIKE, SCHEDULES
from ddtrain.errors import DDTrainError


def cpu_slowdown(ranks: int, cores: int, threads_per_rank: float = 1.0) -> float:
    """How many times longer a rank's compute takes when ``ranks`` ranks share ``cores`` cores."""
    if ranks < 1 or cores < 1 or not threads_per_rank > 0:
        raise DDTrainError(f"cpu_slowdown needs ranks >= 1, cores >= 1, threads > 0; got {ranks}, {cores}, "
                           f"{threads_per_rank}")
    return max(1.0, ranks * threads_per_rank / cores)


def shared_compute_s(alone_s: float, ranks: int, cores: int, threads_per_rank: float = 1.0) -> float:
    """A compute step measured with the host to itself, scaled to ``ranks`` ranks sharing it."""
    if alone_s < 0:
        raise DDTrainError(f"a compute step time must be >= 0 s, got {alone_s}")
    return alone_s * cpu_slowdown(ranks, cores, threads_per_rank)


def link_share_factor(algorithm: str, ranks: int, procs_per_node: int) -> float:
    """β multiplier for ``procs_per_node`` ranks behind one link (1 with one rank per node)."""
    if algorithm not in SCHEDULES:
        raise DDTrainError(f"no link-sharing rule for algorithm {algorithm!r}; known: {', '.join(SCHEDULES)}")
    if procs_per_node < 1 or ranks < 1 or ranks % procs_per_node:
        raise DDTrainError(f"procs per node must be >= 1 and divide the ranks ({ranks}), got {procs_per_node}")
    if procs_per_node == 1 or ranks == procs_per_node:
        return 1.0  # one rank per node, or all on one node (no link crossed: the caller drops β)
    if algorithm in RING_LIKE:
        return 1.0
    if algorithm == "central":
        # the root's p-1 sequential transfers: only the ranks off its node cross its link
        return (ranks - procs_per_node) / (ranks - 1)
    return float(procs_per_node)
