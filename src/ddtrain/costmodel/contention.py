"""Ranks sharing a host: the CPU they share (compute and the messages' own work).

``ranks`` processes that each keep ``threads`` cores busy on a host of ``cores`` cores get
``cores / (ranks · threads)`` of a core each once they outnumber the cores: a compute step
measured alone takes ``max(1, ranks · threads / cores)`` times longer. In the emulated cluster
every node is a namespace on the same host, so all ranks of the job share its cores.

The link they share is each algorithm's own rule (``Algorithm.link_share`` in its ``ddtrain.comm``
module, read through ``schedule.link_share``): a ring's consecutive ranks share a node and only one
hop per node crosses the link; in tree, butterfly and central the ranks of a node cross it together.
"""
from __future__ import annotations

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
