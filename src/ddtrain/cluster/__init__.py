"""An emulated multi-node cluster on one machine, so methods are compared where the network is
the bottleneck (as in the documents: 10 GbE in 000, shared Ethernet in 001, cloud in 002).

    with emulated_cluster(4, "200mbit") as cluster:          # 4 namespaces, 200 Mbit/s links
        result = run_in_cluster(cluster, ["ddtrain", "bench", "collectives", "--sizes", "1M:64M"])
    print(result.traffic_table())

``ddtrain cluster run --nodes 4 --link 200mbit -- ddtrain …`` is the same from the shell.
Inside the ranks, ``link_rate_bps()`` is the emulated link rate (the physical limit), and
``link_fraction(bytes_per_s=…)`` turns any measured bandwidth into a fraction of it.
docs/EMULATED_CLUSTER.md has the layout, the tc parameters and what the figures mean.
"""
from __future__ import annotations

from ddtrain.cluster.links import (LINK_ENV, NODE_ENV, NODE_LINK_ENV, SERVER_LINK_ENV,
                                   link_fraction, link_rate_bps)
from ddtrain.cluster.checks import missing_requirements, preflight
from ddtrain.cluster.netns import Cluster, Node, format_rate, parse_rate
from ddtrain.cluster.run import RunResult, emulated_cluster, run_in_cluster

__all__ = ["emulated_cluster", "run_in_cluster", "RunResult", "Cluster", "Node", "parse_rate", "format_rate",
           "preflight", "missing_requirements", "link_rate_bps", "link_fraction", "LINK_ENV", "SERVER_LINK_ENV", "NODE_LINK_ENV",
           "NODE_ENV"]
