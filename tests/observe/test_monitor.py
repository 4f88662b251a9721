"""System monitoring: /proc parsing, the process group's interface, the sampler thread, and
(acceptance 3) bytes on the wire against our counters for Gloo over TCP on a loopback that
carries nothing else (a private network namespace, where the machine allows one)."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddtrain.observe import monitor, net_interfaces
from ddtrain.comm import traffic

HERE = Path(__file__).parent

NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 1000  10    0    0    0     0          0         0  1000  10    0    0    0     0       0          0
  eth0: 5555  7    0    0    0     0          0         0   222  3    0    0    0     0       0          0
"""


def test_read_net_dev_takes_bytes_and_packets_both_ways(tmp_path):
    path = tmp_path / "dev"
    path.write_text(NET_DEV)
    counters = net_interfaces.read_net_dev(str(path))
    assert counters["eth0"] == net_interfaces.NetCounters(rx_bytes=5555, rx_packets=7, tx_bytes=222, tx_packets=3)
    assert counters["lo"].tx_bytes == 1000
    assert net_interfaces.read_net_dev(str(tmp_path / "missing")) == {}


def test_addresses_in_proc_net_tcp_are_decoded():
    assert net_interfaces._decode("0100007F") == "127.0.0.1"
    assert net_interfaces._decode("0000000000000000FFFF00000100007F") == "127.0.0.1"   # IPv4-mapped IPv6
    assert net_interfaces._decode("00000000000000000000000001000000") == "::1"


def test_the_interface_of_our_own_tcp_connection_is_found():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        assert "127.0.0.1" in net_interfaces.connected_local_addresses()
        assert net_interfaces.interfaces_in_use(env={}) == ["lo"]
        assert net_interfaces.interfaces_in_use(env={"GLOO_SOCKET_IFNAME": "eth7,eth8"}) == ["eth7", "eth8"]
    finally:
        for s in (client, peer, server):
            s.close()


def test_sampler_records_cpu_and_what_the_comm_layer_counted():
    mon = monitor.Monitor(0.05, interfaces=["lo"]).start()
    traffic.record("test-monitor", bytes_sent=12345, bytes_received=678)
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        sum(i * i for i in range(10000))        # keep a core busy
    out = mon.stop()
    s = out["samples"]
    assert len({len(v) for v in s.values()}) == 1 and len(s["t_s"]) >= 3
    assert s["t_s"] == sorted(s["t_s"])
    assert max(v for v in s["cpu_process_pct"] if v is not None) > 0
    assert s["counted_bytes_sent"][-1] - s["counted_bytes_sent"][0] == 12345
    assert s["counted_bytes_received"][-1] - s["counted_bytes_received"][0] == 678
    assert all(v is not None for v in s["net_tx_bytes"]) and out["interfaces"] == ["lo"]
    assert monitor.delta(s, "counted_bytes_sent", s["t_s"][0], s["t_s"][-1]) == 12345


def test_rates_and_window_deltas_of_cumulative_columns():
    s = {"t_s": [0.0, 1.0, 2.0, 4.0], "x": [0, 10, None, 50]}
    assert monitor.rates(s, "x") == ([1.0], [10.0])
    assert monitor.delta(s, "x", 0.5, 3.0) == 50        # from the sample before 0.5 to the one after 3.0
    assert monitor.delta(s, "x", 1.0, 1.0) is None      # one sample: no interval


# ---- acceptance 3: /proc/net/dev against our counters on an otherwise silent loopback ----------

def lo_traffic(numel: int, calls: int):
    """On each rank: ring all-reduces of ``numel`` floats; lo's byte counter and ours around them."""
    import torch
    from ddtrain.comm import all_reduce
    interfaces = net_interfaces.interfaces_in_use()
    before_net, before_ours = net_interfaces.read_net_dev()["lo"], traffic.snapshot()
    for _ in range(calls):
        all_reduce(torch.ones(numel), algorithm="ring")
    after_net, after_ours = net_interfaces.read_net_dev()["lo"], traffic.snapshot()
    return {"interfaces": interfaces, "lo_tx": after_net.tx_bytes - before_net.tx_bytes,
            "lo_rx": after_net.rx_bytes - before_net.rx_bytes,
            "ours_sent": after_ours.bytes_sent - before_ours.bytes_sent}


def measure_in_private_loopback():
    """Run inside ``unshare -n``: 2 Gloo ranks on this namespace's own lo; print the numbers."""
    from multirank import run_ranks
    results = run_ranks(lo_traffic, 2, 1 << 20, 5, timeout_s=240)
    print(json.dumps(results))


def _can_unshare() -> bool:
    if sys.platform != "linux" or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root, unshare and ip to make a private network namespace")
def test_wire_bytes_agree_with_our_counters_on_a_private_loopback():
    code = (f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]; import test_monitor; "
            "test_monitor.measure_in_private_loopback()")
    proc = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"{code}\""],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ranks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["interfaces"] == ["lo"] for r in ranks)          # the process group's interface was found
    ours = sum(r["ours_sent"] for r in ranks)
    assert ours == 2 * 5 * 4 * (1 << 20)                          # 2 ranks x 5 calls x the whole 4 MiB buffer
    # lo carries only our two ranks here; each rank's counters read the same lo, at slightly different times
    wire = max(r["lo_tx"] for r in ranks)
    assert 1.0 <= wire / ours <= 1.10, (wire, ours)
