"""An emulated multi-node cluster on one machine, so methods are compared where the network is
the bottleneck (as in the documents: 10 GbE in 000, shared Ethernet in 001, cloud in 002).

    with emulated_cluster(4, "200mbit") as cluster:          # 4 namespaces, 200 Mbit/s links
        result = run_in_cluster(cluster, ["ddtrain", "bench", "collectives", "--sizes", "1M:64M"])
    print(result.traffic_table())

``ddtrain cluster run --nodes 4 --link 200mbit -- ddtrain …`` is the same from the shell.
Inside the ranks, ``link_rate_bps()`` is the emulated link rate (the physical limit), and
``link_fraction(bytes_per_s=…)`` turns any measured bandwidth into a fraction of it.
docs/CLUSTER.md has the layout, the tc parameters and what the figures mean.
"""
from __future__ import annotations

import os

LINK_ENV = "DDTRAIN_LINK_BPS"                # the --link rate, bits/s (workers' links)
SERVER_LINK_ENV = "DDTRAIN_SERVER_LINK_BPS"  # the --server-node's link rate, bits/s (= LINK unless --server-link)
NODE_LINK_ENV = "DDTRAIN_NODE_LINK_BPS"      # this rank's own node link, bits/s
NODE_ENV = "DDTRAIN_CLUSTER_NODE"            # this rank's node index


def link_rate_bps(*, server: bool = False, node: bool = False, env=None) -> int | None:
    """The emulated link rate in bits/s; None outside a cluster run.

    Default: the --link rate (every worker node's link); ``server=True``: the server node's
    link (differs with --server-link); ``node=True``: this rank's own node's link.
    """
    env = os.environ if env is None else env
    value = env.get(SERVER_LINK_ENV if server else NODE_LINK_ENV if node else LINK_ENV)
    return int(value) if value else None


def link_fraction(*, bits_per_s: float | None = None, bytes_per_s: float | None = None,
                  server: bool = False, env=None) -> float | None:
    """A measured bandwidth as a fraction of the link rate (None outside a cluster run).

    Give exactly one of ``bits_per_s`` or ``bytes_per_s`` (busbw in GB/s is bytes: pass
    ``bytes_per_s=busbw * 1e9``).
    """
    if (bits_per_s is None) == (bytes_per_s is None):
        raise ValueError("give exactly one of bits_per_s or bytes_per_s")
    link = link_rate_bps(server=server, env=env)
    if not link:
        return None
    bits = bits_per_s if bits_per_s is not None else bytes_per_s * 8
    return bits / link


from ddtrain.cluster.checks import missing_requirements, preflight  # noqa: E402
from ddtrain.cluster.netns import Cluster, Node, format_rate, parse_rate  # noqa: E402
from ddtrain.cluster.run import RunResult, emulated_cluster, run_in_cluster  # noqa: E402

__all__ = ["emulated_cluster", "run_in_cluster", "RunResult", "Cluster", "Node", "parse_rate", "format_rate",
           "preflight", "missing_requirements", "link_rate_bps", "link_fraction", "LINK_ENV", "SERVER_LINK_ENV", "NODE_LINK_ENV",
           "NODE_ENV"]
