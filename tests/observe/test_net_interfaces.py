"""Network counters and connections through psutil agree with Linux's /proc, which remains the fallback without psutil."""
import socket
import sys

import pytest

from ddtrain.observe import net_interfaces

psutil = pytest.importorskip("psutil")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the /proc fallback is Linux's")


@linux
def test_psutil_counters_agree_with_proc_net_dev():
    before = net_interfaces.read_net_dev("/proc/net/dev")
    ours = net_interfaces.read_net_dev()
    after = net_interfaces.read_net_dev("/proc/net/dev")
    assert set(ours) == set(before)
    for name, c in ours.items():   # counters only grow: psutil's reading lies between the two
        for field in ("rx_bytes", "rx_packets", "tx_bytes", "tx_packets"):
            assert getattr(before[name], field) <= getattr(c, field) <= getattr(after[name], field), (name, field)


@linux
def test_connections_and_addresses_through_psutil_and_through_proc_agree(monkeypatch):
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        with_psutil = net_interfaces.connected_local_addresses()
        table = net_interfaces._addresses()
        monkeypatch.setattr(net_interfaces, "_psutil", lambda: None)
        assert "127.0.0.1" in with_psutil
        assert with_psutil == net_interfaces.connected_local_addresses()
        assert net_interfaces._addresses()["127.0.0.1"] == table["127.0.0.1"] == "lo"
        assert net_interfaces.interfaces_in_use(env={}) == ["lo"]
    finally:
        for s in (client, peer, server):
            s.close()
