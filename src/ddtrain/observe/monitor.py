"""Per-rank system monitoring while training runs (document 002 §4.3, Fig 4.5-4.22).

A ``Monitor`` is a daemon thread that every ``interval_s`` records, on this rank:

* CPU: this process's utilisation (CPU seconds of the process and its children per wall
  second, in % of one core, so 4 busy threads read 400 %) and the whole host's (% of all
  cores), from ``/proc`` (psutil, where installed, adds loader-worker children);
* GPU utilisation and memory, where the rank trains on CUDA and nvidia-ml-py is installed;
* network bytes and packets received and sent on the interface(s) the process group uses,
  from ``/proc/net/dev`` (cumulative kernel counters: every byte on the interface, headers
  and other processes' traffic included);
* next to them, the bytes our comm layer counted (``ddtrain.comm.traffic``, payload only)
  and the strategy's own figure (``SyncStats``; for ``ddp`` a formula).

Which interface: ``GLOO_SOCKET_IFNAME`` when set, else the interfaces holding the local
addresses of this process's established TCP connections (the process group's pairs and its
store), read from ``/proc/self/net/tcp{,6}``. Ranks on one host in one network namespace
share those counters; ``Monitor.describe()`` says so, and the report plots them once.
Linux only for the network and host columns; elsewhere they are None.
"""
from __future__ import annotations

import os
import socket
import threading
import time

from ddtrain.observe.net_interfaces import interfaces_in_use, read_net_dev

COLUMNS = ("t_s", "cpu_process_pct", "cpu_host_pct", "rss_bytes", "gpu_util_pct", "gpu_mem_bytes",
           "net_rx_bytes", "net_rx_packets", "net_tx_bytes", "net_tx_packets",
           "counted_bytes_sent", "counted_bytes_received", "strategy_bytes_sent", "strategy_bytes_received")
MONITOR_EXTRA = "pip install 'ddtrain[monitor]'"


def host_cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return sum(fields) - idle, sum(fields)


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


class _ProcessCpu:
    """CPU seconds of this process, plus its live children's where psutil is installed."""

    def __init__(self):
        try:
            import psutil
            self._proc = psutil.Process()
        except ImportError:
            self._proc = None

    def seconds(self) -> float:
        t = os.times()
        total = t.user + t.system
        if self._proc is not None:
            try:
                for child in self._proc.children(recursive=True):
                    c = child.cpu_times()
                    total += c.user + c.system
            except Exception:  # a child exited between listing and reading: skip it this time
                pass
        return total


class _Gpu:
    """Utilisation (%) and used memory (bytes) of this rank's GPU through NVML, where possible."""

    def __init__(self, device):
        self.device, self.note, self.nvml = device, None, False
        if device is None or getattr(device, "type", "cpu") != "cuda":
            return
        import torch
        try:
            torch.cuda.utilization(device)
            self.nvml = True
        except Exception as exc:  # ModuleNotFoundError (pynvml), or NVML not usable here
            self.note = f"GPU utilisation unavailable ({type(exc).__name__}: {exc}); {MONITOR_EXTRA}"

    def read(self) -> tuple[float | None, int | None]:
        if self.device is None or getattr(self.device, "type", "cpu") != "cuda":
            return None, None
        import torch
        if not self.nvml:
            return None, int(torch.cuda.memory_reserved(self.device))
        try:
            return float(torch.cuda.utilization(self.device)), int(torch.cuda.device_memory_used(self.device))
        except Exception:
            return None, int(torch.cuda.memory_reserved(self.device))


class Monitor:
    """Sample this rank every ``interval_s`` on a daemon thread; ``stop()`` returns the columns.

    ``strategy_stats``: a function returning the strategy's SyncStats (or None), read each sample.
    Times (``t_s``) are ``time.perf_counter()`` of this process, like the training spans.
    """

    def __init__(self, interval_s: float = 0.5, *, device=None, strategy_stats=None, interfaces=None):
        if not interval_s > 0:
            raise ValueError(f"monitor interval must be positive, got {interval_s}")
        self.interval_s, self.strategy_stats = interval_s, strategy_stats
        self.interfaces = interfaces if interfaces is not None else interfaces_in_use()
        self.columns: dict[str, list] = {c: [] for c in COLUMNS}
        self._cpu, self._gpu = _ProcessCpu(), _Gpu(device)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple | None = None

    def start(self) -> Monitor:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="ddtrain-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> dict:
        """Take a last sample, end the thread (within one interval) and return ``describe()``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        self.sample()
        return self.describe()

    def sample(self) -> None:
        from ddtrain.comm import traffic

        now, cpu_s, host = time.perf_counter(), self._cpu.seconds(), host_cpu_jiffies()
        process_pct = host_pct = None
        if self._last is not None:
            then, then_cpu, then_host = self._last
            if now > then:
                process_pct = 100.0 * (cpu_s - then_cpu) / (now - then)
            if host and then_host and host[1] > then_host[1]:
                host_pct = 100.0 * (host[0] - then_host[0]) / (host[1] - then_host[1])
        self._last = (now, cpu_s, host)
        net = read_net_dev() if self.interfaces else {}
        mine = [net[n] for n in self.interfaces if n in net]
        counted = traffic.snapshot()
        stats = self.strategy_stats() if self.strategy_stats else None
        gpu_util, gpu_mem = self._gpu.read()
        row = {"t_s": now, "cpu_process_pct": process_pct, "cpu_host_pct": host_pct, "rss_bytes": _rss_bytes(),
               "gpu_util_pct": gpu_util, "gpu_mem_bytes": gpu_mem,
               "net_rx_bytes": sum(c.rx_bytes for c in mine) if mine else None,
               "net_rx_packets": sum(c.rx_packets for c in mine) if mine else None,
               "net_tx_bytes": sum(c.tx_bytes for c in mine) if mine else None,
               "net_tx_packets": sum(c.tx_packets for c in mine) if mine else None,
               "counted_bytes_sent": counted.bytes_sent, "counted_bytes_received": counted.bytes_received,
               "strategy_bytes_sent": getattr(stats, "bytes_sent", None),
               "strategy_bytes_received": getattr(stats, "bytes_received", None)}
        for name in COLUMNS:
            self.columns[name].append(row[name])

    def describe(self) -> dict:
        """The samples (one list per column) and what they were measured on."""
        try:
            netns = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            netns = None
        notes = [self._gpu.note] if self._gpu.note else []
        if not self.interfaces:
            notes.append("no network interface found for the process group (a world of one, or not Linux)")
        return {"interval_s": self.interval_s, "host": socket.gethostname(), "netns": netns,
                "interfaces": list(self.interfaces), "cores": os.cpu_count(), "notes": notes,
                "samples": {name: list(values) for name, values in self.columns.items()}}


def rates(samples: dict, column: str) -> tuple[list[float], list[float]]:
    """(times, per-second rates) of a cumulative column between consecutive samples; None gaps skipped."""
    times, values = samples["t_s"], samples[column]
    out_t, out_v = [], []
    for i in range(1, len(times)):
        if values[i] is None or values[i - 1] is None or times[i] <= times[i - 1]:
            continue
        out_t.append(times[i])
        out_v.append((values[i] - values[i - 1]) / (times[i] - times[i - 1]))
    return out_t, out_v


def delta(samples: dict, column: str, start_s: float | None = None, end_s: float | None = None) -> float | None:
    """Growth of a cumulative column over a window: from the last sample at or before ``start_s``
    (else the first) to the first sample at or after ``end_s`` (else the last); None without two samples."""
    pairs = [(t, v) for t, v in zip(samples["t_s"], samples[column]) if v is not None]
    if len(pairs) < 2:
        return None
    first = max((p for p in pairs if start_s is not None and p[0] <= start_s), default=pairs[0], key=lambda p: p[0])
    last = min((p for p in pairs if end_s is not None and p[0] >= end_s), default=pairs[-1], key=lambda p: p[0])
    return last[1] - first[1] if last[0] > first[0] else None
