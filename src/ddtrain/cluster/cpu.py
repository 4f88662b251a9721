"""``--node-cpu NODE=FRACTION``: hold an emulated node's processes to a fraction of a CPU, to make stragglers.

Every process a node starts (its agent, its workers, their threads) is put in one cgroup per
node whose CPU bandwidth limit is FRACTION of one CPU: ``cpu.max`` = "FRACTION x 100000 100000"
on cgroup v2 where its ``cpu`` controller is available, else cgroup v1's ``cpu`` controller
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``). The kernel's CFS bandwidth control lets the
group run that much CPU time per 100 ms period and throttles it for the rest, so a node at 0.25
computes about four times slower than an unlimited one on an idle core.

The node's agent joins its cgroup before it runs (``Popen(preexec_fn=...)``), so nothing it
starts escapes. The cgroups are named ``<run id>-n<node>`` (the run id names the owner process,
as the namespaces do) and removed when the run ends, also on Ctrl-C and on failure; a run killed
with SIGKILL leaves its empty cgroups, which the next ``cluster run`` or ``ddtrain cluster clean``
removes (``sweep``).
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from ddtrain.errors import DDTrainError

PERIOD_US = 100_000
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))   # cgroup v2 mounts (unified, or hybrid)
V1_ROOT = Path("/sys/fs/cgroup/cpu")
_NAME = re.compile(r"^ddtrain-(\d+)-[0-9a-f]+-n\d+$")


def parse(items: list[str], nodes: int) -> dict[int, float]:
    """``["1=0.25", "-1=0.5"]`` -> {node: fraction of one CPU}; negative nodes count from the end."""
    limits = {}
    for item in items or ():
        node, sep, value = item.partition("=")
        try:
            index, fraction = int(node), float(value)
        except ValueError:
            raise DDTrainError(f"--node-cpu takes NODE=FRACTION (e.g. 1=0.25), got {item!r}") from None
        if not sep or not -nodes <= index < nodes:
            raise DDTrainError(f"--node-cpu {item!r}: the node must be in 0..{nodes - 1} (or negative from the end)")
        if not 0.01 <= fraction <= os.cpu_count():
            raise DDTrainError(f"--node-cpu {item!r}: the fraction of a CPU must be in 0.01..{os.cpu_count()} "
                               f"(this machine's CPUs)")
        limits[index % nodes] = fraction
    return limits


def controller() -> tuple[str, Path]:
    """("v2", parent) or ("v1", root) of the CPU controller this machine offers; DDTrainError naming what is missing."""
    if os.geteuid() != 0:
        raise DDTrainError("--node-cpu needs root (it writes CPU limits into cgroups): run with sudo")
    for root in V2_ROOTS:
        controllers = root / "cgroup.controllers"
        if controllers.exists() and "cpu" in controllers.read_text().split():
            return "v2", root
    if (V1_ROOT / "cpu.cfs_quota_us").exists() and os.access(V1_ROOT, os.W_OK):
        return "v1", V1_ROOT
    raise DDTrainError("--node-cpu needs the cgroup CPU controller: neither cgroup v2 with 'cpu' in "
                       f"{' or '.join(str(r / 'cgroup.controllers') for r in V2_ROOTS)} nor a writable cgroup v1 "
                       f"{V1_ROOT} was found")


class CpuLimits:
    """The cgroups of one run's limited nodes; ``preexec(node)`` is what a node's Popen runs to join its own."""

    def __init__(self, run_id: str, limits: dict[int, float]):
        self.run_id, self.limits = run_id, dict(limits)
        self.version, self.root = controller() if limits else ("", Path())
        self.groups: dict[int, Path] = {}

    def create(self) -> None:
        if self.version == "v2":   # the parent must hand the cpu controller to its children
            control = self.root / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
        for node, fraction in sorted(self.limits.items()):
            path = self.root / f"{self.run_id}-n{node}"
            path.mkdir()
            self.groups[node] = path
            quota = max(1000, round(fraction * PERIOD_US))   # the kernel's smallest quota is 1 ms
            if self.version == "v2":
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))

    def preexec(self, node: int):
        """The function a node's ``Popen`` runs in the child before it executes: join the node's cgroup."""
        path = self.groups.get(node)
        if path is None:
            return None
        procs = str(path / "cgroup.procs")

        def join():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def describe(self) -> dict:
        return {str(node): {"cpus": fraction, "cgroup": str(self.groups.get(node, "")), "version": self.version,
                            "quota_us": max(1000, round(fraction * PERIOD_US)), "period_us": PERIOD_US}
                for node, fraction in sorted(self.limits.items())}

    def remove(self) -> None:
        """Remove the cgroups; processes still in one (there should be none) move to the parent first."""
        for node in list(self.groups):
            _remove(self.groups.pop(node), self.root)


def _remove(path: Path, root: Path) -> None:
    deadline = time.monotonic() + 5.0
    while path.exists():
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (root / "cgroup.procs").write_text(pid)
            path.rmdir()
            return
        if time.monotonic() > deadline:
            raise DDTrainError(f"could not remove the cgroup {path} (processes still in it); remove it with "
                               f"'ddtrain cluster clean' or rmdir")
        time.sleep(0.05)


@contextlib.contextmanager
def limited(run_id: str, limits: dict[int, float]):
    """The run's node cgroups for the duration of the block (nothing when ``limits`` is empty)."""
    cgroups = CpuLimits(run_id, limits)
    if limits:
        sweep(cgroups.root)
    try:
        if limits:
            cgroups.create()
        yield cgroups
    finally:
        cgroups.remove()


def sweep(root: Path | None = None, *, include_live: bool = False) -> list[str]:
    """Remove ddtrain's node cgroups whose owning run is gone (all of them with ``include_live``); the names."""
    from ddtrain.cluster.netns import _owner_alive
    roots = [root] if root is not None else [r for r in (*V2_ROOTS, V1_ROOT) if r.is_dir()]
    removed = []
    for parent in roots:
        with contextlib.suppress(OSError):
            for path in parent.iterdir():
                match = _NAME.match(path.name)
                if path.is_dir() and match and (include_live or not _owner_alive(int(match.group(1)))):
                    _remove(path, parent)
                    removed.append(str(path))
    return removed
