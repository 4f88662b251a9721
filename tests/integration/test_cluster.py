"""The emulated cluster: namespaces, links and rate limits exist while it runs, traffic is held
to the link rate, and nothing (namespace, link, process) outlives a run, a crash or a Ctrl-C.

Tests that build clusters need root and working ``ip netns``; elsewhere they skip and say why.
The refusal tests run anywhere on Linux (they must refuse before touching anything).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ddtrain.cluster import emulated_cluster, link_fraction, netns, parse_rate, run_in_cluster
from ddtrain.cluster.run import target_argv
from ddtrain.errors import DDTrainError
from helpers import why_no_cluster


def _why_no_cluster() -> str | None:
    return why_no_cluster()


WHY = _why_no_cluster()
needs_netns = pytest.mark.skipif(WHY is not None, reason=WHY or "")


def _ip_json(*argv) -> list:
    return json.loads(subprocess.run(["ip", "-j", *argv], capture_output=True, text=True, check=True).stdout or "[]")


def _leftovers(marker: str, run_prefix: str = netns.PREFIX) -> list[str]:
    """Namespaces, root-namespace links and processes (command line containing ``marker``) of ours."""
    found = [f"namespace {n}" for n in netns.list_namespaces() if n.startswith(run_prefix)]
    found += [f"link {link['ifname']}" for link in _ip_json("link", "show") if link["ifname"].startswith("ddt")]
    return found + _processes(marker)


def _processes(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            found.append(f"process {pid}: {cmdline}")
    return found


# ---------------------------------------------------------------- no root needed
def test_rates_are_read_in_tc_bit_units():
    assert parse_rate("200mbit") == 200_000_000
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("1.5mbit") == 1_500_000
    assert parse_rate("500000") == 500_000
    with pytest.raises(DDTrainError, match="ambiguous"):
        parse_rate("200mbps")  # tc would read megabytes per second
    with pytest.raises(DDTrainError, match="cannot read rate"):
        parse_rate("fast")


def test_tbf_bucket_holds_a_gso_packet_and_some_ms_of_tokens():
    for bps in (parse_rate("10mbit"), parse_rate("200mbit"), parse_rate("10gbit")):
        p = netns.tbf_params(bps)
        assert p["burst"] >= 64 * 1024 and p["burst"] >= bps / 8 * 0.004
        assert p["limit"] > p["burst"]


def test_bandwidth_is_reported_as_a_fraction_of_the_link():
    env = {"DDTRAIN_LINK_BPS": "200000000", "DDTRAIN_SERVER_LINK_BPS": "1000000000"}
    assert link_fraction(bits_per_s=150e6, env=env) == pytest.approx(0.75)
    assert link_fraction(bytes_per_s=12.5e6, env=env) == pytest.approx(0.5)
    assert link_fraction(bits_per_s=500e6, server=True, env=env) == pytest.approx(0.5)
    assert link_fraction(bits_per_s=1.0, env={}) is None
    with pytest.raises(ValueError):
        link_fraction(env=env)


def test_commands_map_to_torchrun_targets():
    assert target_argv(["ddtrain", "bench", "collectives"]) == ["--module", "ddtrain", "bench", "collectives"]
    assert target_argv(["python", "-m", "ddtrain.cluster.probe", "--json"]) == \
        ["--module", "ddtrain.cluster.probe", "--json"]
    assert target_argv(["python3", "job.py", "-x"]) == ["job.py", "-x"]
    with pytest.raises(DDTrainError, match="must be"):
        target_argv(["ls", "-l"])
    with pytest.raises(DDTrainError, match="cannot run inside"):
        target_argv(["ddtrain", "cluster", "run", "--nodes", "2"])


def test_probe_divides_by_the_link_that_bounds_each_transfer():
    from ddtrain.cluster.probe import _bottleneck_bps
    where = [(0, 400), (0, 400), (1, 100), (2, 100)]   # (node, node link bits/s) per rank
    assert _bottleneck_bps("send", where) == 100        # rank 0 -> rank 3 crosses both links
    assert _bottleneck_bps("incast", where) == 200      # 2 remote links of 100 into 400
    assert _bottleneck_bps("send", [(0, 400), (0, 400)]) is None  # same node: no link at all
    assert _bottleneck_bps("send", [(None, None), (None, None)]) is None  # not in a cluster


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
@pytest.mark.parametrize("case", ["no-tc", "not-root"])
def test_refuses_before_touching_anything(tmp_path, monkeypatch, capsys, case):
    if case == "no-tc":  # a PATH with ip but without tc
        (tmp_path / "bin").mkdir()
        ip = subprocess.run(["sh", "-c", "command -v ip"], capture_output=True, text=True).stdout.strip()
        if ip:
            os.symlink(ip, tmp_path / "bin" / "ip")
        monkeypatch.setenv("PATH", str(tmp_path / "bin"))
        expected = "the 'tc' command"
    else:
        monkeypatch.setenv("DDTRAIN_CLUSTER_ASSUME_NOT_ROOT", "1")
        expected = "root privileges"
    before = netns.list_namespaces() if WHY is None else []
    from ddtrain.cli import main
    code = main(["cluster", "run", "--nodes", "2", "--link", "100mbit", "--", "python", "-m", "ddtrain.cluster.probe"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "ddtrain: error: cannot emulate a cluster on this machine; missing:" in err and expected in err, err
    assert "emulated cluster" not in out  # refused before creating one
    monkeypatch.undo()
    if WHY is None:
        assert netns.list_namespaces() == before


# ---------------------------------------------------------------- root and ip netns needed
@needs_netns
def test_creates_isolated_nodes_with_rate_limited_links():
    with emulated_cluster(3, "100mbit", server_link="50mbit", server_node=-1) as cluster:
        ours = netns.list_namespaces()
        assert cluster.bridge_namespace in ours
        for node in cluster.nodes:
            assert node.namespace in ours
            links = {link["ifname"]: link for link in _ip_json("-n", node.namespace, "addr", "show")}
            assert "UP" in links["lo"]["flags"]
            assert [a["local"] for a in links[node.interface]["addr_info"] if a["family"] == "inet"] == [node.address]
            # the only route is the cluster's own subnet: nodes reach each other and nothing else
            routes = _ip_json("-n", node.namespace, "route", "show")
            assert [r["dst"] for r in routes] == [f"{netns.SUBNET}.0/24"]
            unreachable = subprocess.run(["ip", "-n", node.namespace, "route", "get", "192.0.2.1"],
                                         capture_output=True, text=True)
            assert unreachable.returncode != 0 and "unreachable" in unreachable.stderr.lower()
            peer = cluster.nodes[(node.index + 1) % 3].address
            assert _ip_json("-n", node.namespace, "route", "get", peer)[0]["dev"] == node.interface
            # tbf on both ends of the veth: node egress (its uploads) and bridge egress (its downloads)
            expected_rate = 50_000_000 if node.index == 2 else 100_000_000  # -1: the last node
            assert node.link_bps == expected_rate
            there = node.interface.replace(f"n{node.index}", f"b{node.index}")
            for ns, dev in ((node.namespace, node.interface), (cluster.bridge_namespace, there)):
                qdisc = _ip_tc_json(ns, dev)
                assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] * 8 == expected_rate, qdisc
        # nothing of ours in the host's namespace: no links, no route into the cluster's subnet
        assert not [link for link in _ip_json("link", "show") if link["ifname"].startswith("ddt")]
        assert not [r for r in _ip_json("route", "show") if r["dst"].startswith(netns.SUBNET)]
    assert not [n for n in netns.list_namespaces() if n.startswith(cluster.run_id)]


def _ip_tc_json(ns: str, dev: str) -> dict:
    out = subprocess.run(["tc", "-n", ns, "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True,
                         check=True).stdout
    return [q for q in json.loads(out) if q.get("root")][0]


@needs_netns
def test_transfer_between_nodes_runs_at_the_link_rate(tmp_path):
    nbytes = 6_250_000  # half a second at 100 Mbit/s
    with emulated_cluster(2, "100mbit") as cluster:
        with open(tmp_path / "out.txt", "w") as out:
            result = run_in_cluster(cluster, ["python", "-m", "ddtrain.cluster.probe", "--modes", "send,bidi",
                                              "--bytes", str(nbytes), "--repeat", "2", "--json"],
                                    stdout=out, stderr=subprocess.STDOUT, timeout_s=120)
    text = (tmp_path / "out.txt").read_text()
    assert result.returncode == 0, text
    rows = {r["mode"]: r for r in (json.loads(line.split(" ", 1)[1]) for line in text.splitlines()
                                   if line.startswith("probe_result "))}
    for mode in ("send", "bidi"):  # one way, and both ways at once (a link is full duplex)
        assert rows[mode]["link_bps"] == 100_000_000  # the rate the cluster exported to the ranks
        assert abs(rows[mode]["of_link"] - 1) <= 0.15, rows[mode]
    # the kernel's counters saw the transfers cross the links: 2 send + 2 bidi from node 0, 2 bidi back
    sent0, recv1 = result.traffic[0].bytes_sent, result.traffic[1].bytes_received
    assert sent0 >= 4 * nbytes and recv1 >= 4 * nbytes
    assert abs(sent0 - recv1) <= 0.01 * sent0  # what node 0 sent is what node 1 received
    assert result.traffic[1].bytes_sent >= 2 * nbytes


_CRASH = """
import os, signal, sys, time
rank = int(os.environ["RANK"])
open(os.path.join(sys.argv[1], f"started-{rank}"), "w").close()
if rank == 1 and sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1 and sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(600)  # the other rank waits, as if blocked in a collective with the dead one
"""


def _script(tmp_path) -> str:
    path = tmp_path / "crash_job.py"
    path.write_text(textwrap.dedent(_CRASH))
    return str(path)


@needs_netns
def test_a_killed_rank_ends_the_job_and_leaves_nothing(tmp_path):
    script = _script(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "ddtrain", "cluster", "run", "--nodes", "2", "--link", "100mbit",
                             "--timeout-s", "120", "--", "python", script, str(tmp_path), "kill"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL, (out, err)
    assert "worker rank 1 was killed by SIGKILL" in err and "the job failed" in err, err
    assert _leftovers(script) == []


@needs_netns
def test_a_failing_rank_ends_the_job_with_its_status(tmp_path):
    script = _script(tmp_path)
    with emulated_cluster(2, "100mbit") as cluster:
        with open(tmp_path / "out.txt", "w") as out:
            result = run_in_cluster(cluster, ["python", script, str(tmp_path), "exit"], stdout=out,
                                    stderr=subprocess.STDOUT, timeout_s=120)
        assert _processes(script) == []  # the waiting rank is stopped even before teardown
    assert result.returncode == 3 and sorted(result.node_returncodes)[-1] == 3, result
    assert _leftovers(script) == []


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_tears_everything_down(tmp_path, sig):
    """The signal arrives while run_in_cluster waits: our own process, so the handlers are real."""
    script = _script(tmp_path)
    # what they were before (a shell's background job starts with SIGINT ignored, and that is what must come back)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def signal_when_started():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.1)
    expected = KeyboardInterrupt if sig == signal.SIGINT else SystemExit
    threading.Thread(target=signal_when_started, daemon=True).start()
    with pytest.raises(expected):
        with emulated_cluster(2, "100mbit") as cluster:
            run_in_cluster(cluster, ["python", script, str(tmp_path), "wait"], timeout_s=120)
    assert cluster.run_id and _leftovers(script) == []
    assert not [n for n in netns.list_namespaces() if n.startswith(cluster.run_id)]
    assert {s: signal.getsignal(s) for s in before} == before   # handlers restored, not left as SIG_IGN


@needs_netns
def test_leftovers_of_a_dead_run_are_swept_and_live_runs_spared():
    owner = subprocess.Popen(["sleep", "120"])  # stands in for a 'cluster run' that is still going
    run_id = f"{netns.PREFIX}{owner.pid}-{os.urandom(3).hex()}"
    netns.create(2, 100_000_000, run_id=run_id)
    try:
        assert not [n for n in netns.sweep() if n.startswith(run_id)]  # owner alive: spared
        assert len([n for n in netns.list_namespaces() if n.startswith(run_id)]) == 3
    finally:
        owner.kill()  # now the owner is gone, as after a SIGKILL: its cluster is a leftover
        owner.wait()
    from ddtrain.cli import main
    assert main(["cluster", "clean"]) == 0
    assert _leftovers(run_id, run_prefix=run_id) == []
