"""Refuse early: say exactly what this machine lacks to emulate a cluster, touching nothing."""
from __future__ import annotations

import os
import shutil
import sys

from ddtrain.errors import DDTrainError

KERNEL_FEATURES = {"CONFIG_NET_NS": "net_ns", "CONFIG_VETH": "veth", "CONFIG_BRIDGE": "bridge",
                   "CONFIG_NET_SCH_TBF": "sch_tbf"}
# Testing hook: pretend not to be root, to check the refusal without dropping privileges.
ASSUME_NOT_ROOT_ENV = "DDTRAIN_CLUSTER_ASSUME_NOT_ROOT"


def _kernel_config() -> dict[str, str] | None:
    import gzip
    paths = ["/proc/config.gz", f"/boot/config-{os.uname().release}"]
    for path in paths:
        try:
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rt") as f:
                text = f.read()
        except OSError:
            continue
        config = {}
        for line in text.splitlines():
            if line.startswith("CONFIG_") and "=" in line:
                key, value = line.split("=", 1)
                config[key] = value
            elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
                config[line[2:-len(" is not set")]] = "n"
        return config
    return None


def missing_requirements(env=None) -> list[str]:
    """What this machine lacks to emulate a cluster, one phrase each ([] when all is there).

    Looks, touching nothing: Linux, root, ``ip`` and ``tc`` on PATH, and the kernel features
    (network namespaces, veth, bridge, sch_tbf) in the kernel config, /sys/module or the
    module tree. A feature nobody can vouch for either way is not reported missing; creating
    the cluster then fails on that command, with its message, and tears down what it made.
    """
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return [f"Linux (this is {sys.platform}; network namespaces are Linux-only)"]
    missing = []
    if os.geteuid() != 0 or env.get(ASSUME_NOT_ROOT_ENV):
        missing.append("root privileges (network namespaces and tc need root; run with sudo)")
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool, path=env.get("PATH", os.defpath)) is None:
            missing.append(f"the '{tool}' command (install {package}; PATH={env.get('PATH', '')})")
    config = _kernel_config() or {}
    release = os.uname().release
    for option, module in KERNEL_FEATURES.items():
        value = config.get(option)
        if value == "y" or os.path.isdir(f"/sys/module/{module}"):
            continue
        if option == "CONFIG_NET_NS":
            if not os.path.exists("/proc/self/ns/net"):
                missing.append("kernel support for network namespaces (CONFIG_NET_NS)")
            continue
        if value == "n":
            missing.append(f"kernel support for {module} ({option} is not set in this kernel)")
        elif value == "m" and not _module_file_exists(release, module):
            missing.append(f"the kernel module {module} ({option}=m, but no {module}.ko under "
                           f"/lib/modules/{release}; install this kernel's modules package)")
    return missing


def _module_file_exists(release: str, module: str) -> bool:
    root = f"/lib/modules/{release}"
    for _dirpath, _, files in os.walk(root):
        if any(name.split(".ko")[0] == module for name in files if ".ko" in name):
            return True
    return False


def preflight(env=None) -> None:
    """Raise DDTrainError naming everything missing, before anything is created."""
    missing = missing_requirements(env)
    if missing:
        raise DDTrainError("cannot emulate a cluster on this machine; missing: " + "; ".join(missing))
