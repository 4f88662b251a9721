"""``ddtrain doctor``'s node column (issue 32: under ``ddtrain cluster run --slurm`` every srun task inherited the
command's DDTRAIN_CLUSTER_NODE=0, and doctor named "node 0" for both nodes)."""
import socket

import pytest

from ddtrain.distributed.doctor import node_name


@pytest.mark.parametrize("env, expect", [
    ({"DDTRAIN_CLUSTER_NODE": "0", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0"}, "node 1"),    # an srun task on n1
    ({"DDTRAIN_CLUSTER_NODE": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0"}, "node 0"),
    ({"DDTRAIN_CLUSTER_NODE": "0", "SLURM_NODEID": "1", "SLURM_STEP_ID": "4294967294"}, "node 0"),   # batch shell
    ({"DDTRAIN_CLUSTER_NODE": "1"}, "node 1"),                                               # cluster run's agents
    ({}, socket.gethostname()),                                                              # a real host
])
def test_the_node_is_the_tasks_own(env, expect, monkeypatch):
    for name in ("DDTRAIN_CLUSTER_NODE", "SLURM_NODEID", "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert node_name() == expect
