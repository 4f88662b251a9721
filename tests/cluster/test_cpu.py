"""``--node-cpu``: the node cgroups hold their processes to a CPU quota and leave nothing behind.

The parsing is pure; the cgroup tests need root and a CPU controller (cgroup v2 ``cpu`` or v1
``cpu``) and are skipped, saying which is missing, without them.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from ddtrain.cluster import cpu, netns
from ddtrain.errors import DDTrainError


def why_no_controller() -> str | None:
    try:
        cpu.controller()
    except DDTrainError as exc:
        return str(exc)
    return None


def test_parse_reads_node_and_fraction_and_counts_negative_nodes_from_the_end():
    assert cpu.parse(["1=0.25", "-1=0.5"], 4) == {1: 0.25, 3: 0.5}
    assert cpu.parse([], 2) == {}
    for bad, words in (("1", "NODE=FRACTION"), ("x=0.5", "NODE=FRACTION"), ("5=0.5", "0..3"), ("1=0", "fraction")):
        with pytest.raises(DDTrainError, match=words):
            cpu.parse([bad], 4)


@pytest.mark.skipif(why_no_controller() is not None, reason=f"no cgroup CPU control here: {why_no_controller()}")
def test_a_node_cgroup_throttles_its_processes_and_is_removed_afterwards():
    run_id = netns.new_run_id()
    busy = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass\n"
    with cpu.limited(run_id, {1: 0.05}) as limits:
        path = limits.groups[1]
        quota = (path / "cpu.max").read_text().split()[0] if limits.version == "v2" else \
            (path / "cpu.cfs_quota_us").read_text().strip()
        assert quota == "5000"
        child = subprocess.Popen([sys.executable, "-c", busy], preexec_fn=limits.preexec(1))
        members = (path / "cgroup.procs").read_text().split()
        assert str(child.pid) in members
        child.wait(timeout=60)
        stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) >= 1   # the kernel held it back at its quota
    assert not path.exists()


@pytest.mark.skipif(why_no_controller() is not None, reason=f"no cgroup CPU control here: {why_no_controller()}")
def test_the_cgroups_go_on_failure_and_a_dead_runs_cgroups_are_swept():
    run_id = netns.new_run_id()
    with pytest.raises(RuntimeError):
        with cpu.limited(run_id, {0: 0.5, 2: 0.25}) as limits:
            paths = list(limits.groups.values())
            raise RuntimeError("the job failed")
    assert paths and not any(p.exists() for p in paths)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = limits.root / f"ddtrain-{dead.pid}-abc123-n0"   # what a SIGKILLed run leaves
    left.mkdir()
    assert str(left) in cpu.sweep(limits.root) and not left.exists()


def test_cluster_run_refuses_a_node_it_does_not_have_in_one_line():
    from helpers import assert_one_clear_error, ddtrain
    result = ddtrain("cluster", "run", "--nodes", "2", "--link", "1gbit", "--node-cpu", "5=0.5", "--",
                     "ddtrain", "train", "--steps", "1")
    assert_one_clear_error(result, "--node-cpu", "0..1")


@pytest.mark.slow   # an emulated cluster of 2 nodes training 4 steps
@pytest.mark.skipif(why_no_controller() is not None, reason=f"no cgroup CPU control here: {why_no_controller()}")
def test_cluster_run_holds_a_node_and_leaves_no_cgroup():
    from helpers import ddtrain, why_no_cluster
    if why_no_cluster():
        pytest.skip(why_no_cluster())
    before = set(cpu.V1_ROOT.iterdir()) if cpu.V1_ROOT.is_dir() else set()
    result = ddtrain("cluster", "run", "--nodes", "2", "--link", "1gbit", "--node-cpu=-1=0.5", "--",
                     "ddtrain", "train", "--model", "mlp", "--data", "digits", "--steps", "4",
                     "--global-batch-size", "32", "--balance", "speed", "--balance-every", "2", timeout=400)
    assert result.returncode == 0, result.stderr
    assert "# node 1 held to 0.5 CPU" in result.stdout
    after = set(cpu.V1_ROOT.iterdir()) if cpu.V1_ROOT.is_dir() else set()
    assert not {p for p in after - before if p.name.startswith("ddtrain-")}
