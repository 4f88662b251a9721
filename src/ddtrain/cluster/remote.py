"""Host lists across emulated nodes without ssh: an rsh stand-in for Open MPI and MPICH's Hydra.

``mpirun --hostfile`` and ``mpiexec -f hosts`` start their daemons on other hosts through ssh.
Here every host is an emulated node on this machine, so the "remote shell" is a small script
(``agent``) that runs the command inside node ``nI``: its network namespace (``nsenter --net``),
its own hostname and an /etc/hosts naming every node, as ``ddtrain.cluster.slurm`` does for its
daemons. Give it to Open MPI as ``--mca plm_rsh_agent AGENT`` and to Hydra as
``-launcher ssh -launcher-exec AGENT``; run the launcher itself on node 0 (``head(argv)``).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass

from ddtrain.cluster import netns
from ddtrain.cluster.slurm import in_node, node_name


@dataclass
class Hosts:
    """The node names, the /etc/hosts and rsh agent that make them reachable, in one folder."""

    cluster: netns.Cluster
    folder: str
    hosts: str
    agent: str

    def head(self, argv: list[str]) -> list[str]:
        """``argv`` run on node 0, where a login node would run mpirun/mpiexec."""
        return in_node(self.cluster.nodes[0], argv, self.hosts)

    @property
    def names(self) -> list[str]:
        return [node_name(n.index) for n in self.cluster.nodes]


def _agent_script(cluster: netns.Cluster, hosts: str) -> str:
    cases = "".join(f"  {node_name(n.index)}) ns={n.namespace};;\n" for n in cluster.nodes)
    return f"""#!/bin/sh
# rsh/ssh stand-in for emulated cluster {cluster.run_id}: AGENT [ssh options] HOST COMMAND...
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}  *) echo "ddtrain: no emulated node named $host" >&2; exit 255;;
esac
exec nsenter --net=/run/netns/$ns unshare --uts --mount --propagation private \\
     sh -c "hostname $host && mount --bind {shlex.quote(hosts)} /etc/hosts && exec sh -c \\"\\$0\\"" "$*"
"""


@contextlib.contextmanager
def node_hosts(cluster: netns.Cluster):
    """Yield Hosts for ``cluster``; the folder goes afterwards (the processes go with the cluster)."""
    folder = tempfile.mkdtemp(prefix=f"{cluster.run_id}-hosts-")
    try:
        hosts, agent = os.path.join(folder, "hosts"), os.path.join(folder, "agent")
        with open(hosts, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{n.address} {node_name(n.index)}\n" for n in cluster.nodes))
        with open(agent, "w") as f:
            f.write(_agent_script(cluster, hosts))
        os.chmod(folder, 0o755)
        os.chmod(hosts, 0o644)
        os.chmod(agent, 0o755)
        yield Hosts(cluster, folder, hosts, agent)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
