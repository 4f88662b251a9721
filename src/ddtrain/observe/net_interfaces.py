"""Which network interfaces this process's process group uses, and their kernel byte and packet counters.

Which interface: ``GLOO_SOCKET_IFNAME`` (or ``NCCL_SOCKET_IFNAME``) when set, else the interfaces
holding the local addresses of this process's established TCP connections (the process group's
pairs and its store). Connections, addresses and counters come from psutil (the ``monitor``
extra), on any system it supports; without psutil, from Linux's ``/proc`` (``/proc/self/net/tcp{,6}``,
``/proc/net/dev``), and empty elsewhere. ``ddtrain.observe.monitor`` samples them.
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

NET_DEV = "/proc/net/dev"


@dataclass(frozen=True)
class NetCounters:
    """Cumulative counters of one interface, as the kernel keeps them."""

    rx_bytes: int
    rx_packets: int
    tx_bytes: int
    tx_packets: int


def _psutil():
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def read_net_dev(path: str | None = None) -> dict[str, NetCounters]:
    """Every interface's counters: psutil's ``net_io_counters(pernic=True)``, or ``path`` (``/proc/net/dev``) parsed."""
    psutil = _psutil() if path is None else None
    if psutil is not None:
        return {name: NetCounters(c.bytes_recv, c.packets_recv, c.bytes_sent, c.packets_sent)
                for name, c in psutil.net_io_counters(pernic=True).items()}
    try:
        path = path or NET_DEV
        with open(path) as f:
            lines = f.readlines()[2:]
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if len(fields) >= 10:
            out[name.strip()] = NetCounters(int(fields[0]), int(fields[1]), int(fields[8]), int(fields[9]))
    return out


def _addresses() -> dict[str, str]:
    """IP address -> interface name, for every address of every interface."""
    psutil = _psutil()
    if psutil is None:
        return {**_ipv4_addresses(), **_ipv6_addresses()}
    out = {}
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out[a.address.split("%")[0]] = name      # fe80::1%eth0 -> fe80::1
    return out


def _ipv4_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for every interface that has one (SIOCGIFADDR; without psutil)."""
    import fcntl  # Unix only
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[socket.inet_ntoa(packed[20:24])] = name
    return out


def _ipv6_addresses() -> dict[str, str]:
    out = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    out[socket.inet_ntop(socket.AF_INET6, bytes.fromhex(fields[0]))] = fields[5]
    except OSError:
        pass
    return out


def _decode(hex_addr: str) -> str:
    """``0100007F`` -> ``127.0.0.1``; 32 hex digits -> an IPv6 address (IPv4-mapped ones as IPv4)."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntoa(raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # host-order 32-bit words
    if words[:12] == b"\0" * 10 + b"\xff\xff":
        return socket.inet_ntoa(words[12:])
    return socket.inet_ntop(socket.AF_INET6, words)


def _unmapped(address: str) -> str:
    return address[7:] if address.startswith("::ffff:") and "." in address else address


def connected_local_addresses(pid: str = "self") -> set[str]:
    """Local IP addresses of ``pid``'s established TCP connections (psutil, else /proc)."""
    psutil = _psutil()
    if psutil is not None:
        try:
            process = psutil.Process(None if pid == "self" else int(pid))
            connections = getattr(process, "net_connections", None) or process.connections   # psutil < 6
            return {_unmapped(c.laddr.ip) for c in connections(kind="tcp")
                    if c.status == psutil.CONN_ESTABLISHED and c.laddr}
        except (psutil.Error, OSError):
            return set()
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    out = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "01" and fields[9] in inodes:   # 01 = ESTABLISHED
                out.add(_decode(fields[1].split(":")[0]))
    return out


def interfaces_in_use(env=None) -> list[str]:
    """The interfaces this process's process group talks over (see the module docstring)."""
    env = os.environ if env is None else env
    named = env.get("GLOO_SOCKET_IFNAME") or env.get("NCCL_SOCKET_IFNAME")
    if named and not named.startswith(("^", "=")):
        return sorted({n.strip() for n in named.split(",") if n.strip()})
    addresses = connected_local_addresses()
    if not addresses:
        return []
    table = _addresses()
    found = {table.get(a) or ("lo" if a.startswith("127.") or a == "::1" else None) for a in addresses}
    return sorted(n for n in found if n)
