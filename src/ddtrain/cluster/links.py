"""The emulated links as the ranks see them: the rates ``cluster run`` puts in the environment, and a
measured bandwidth as a fraction of them."""
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
