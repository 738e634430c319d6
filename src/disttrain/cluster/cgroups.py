"""A CPU quota per emulated node: one cgroup (v1 `cpu` controller) that every process of
the node joins, so the node's processes together get `cores` cores however many they are.

cpu.cfs_quota_us = cores x cpu.cfs_period_us (Linux CFS bandwidth control). A process
joins by writing its pid to the group's `tasks` before it execs; children inherit it.
"""

from __future__ import annotations

import os
import time

__all__ = ["create", "join", "remove_all", "path", "ROOT"]

ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 10_000  # NOTE: short, so a node cannot run a 25 ms burst at full speed inside a 100 ms window


def path(name: str) -> str:
    return os.path.join(ROOT, name)


def create(name: str, cores: float) -> str:
    """Make cgroup `name` limited to `cores` cores; returns its folder."""
    if not os.path.isdir(ROOT):
        raise RuntimeError(f"--cpus-per-node needs the cgroup v1 cpu controller at {ROOT}, which "
                           "this machine does not have; leave out --cpus-per-node")
    folder = path(name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cpu.cfs_period_us"), "w") as f:
        f.write(str(PERIOD_US))
    with open(os.path.join(folder, "cpu.cfs_quota_us"), "w") as f:
        f.write(str(int(cores * PERIOD_US)))
    return folder


def join(name: str, pid: int | None = None) -> None:
    """Move `pid` (default: this process) into cgroup `name`."""
    with open(os.path.join(path(name), "tasks"), "w") as f:
        f.write(str(pid or os.getpid()))


def usage_s(name: str) -> float:
    """CPU seconds used by the group so far (cpuacct, when it is mounted beside cpu)."""
    for base in ("/sys/fs/cgroup/cpuacct", ROOT):
        f = os.path.join(base, name, "cpuacct.usage")
        if os.path.exists(f):
            with open(f) as fh:
                return int(fh.read()) / 1e9
    return float("nan")


def remove_all(prefix: str) -> list[str]:
    """Remove every cgroup whose name starts with `prefix` (after their tasks are gone)."""
    if not os.path.isdir(ROOT):
        return []
    removed = []
    for name in sorted(os.listdir(ROOT)):
        if not name.startswith(prefix):
            continue
        folder = path(name)
        for _ in range(50):  # NOTE: rmdir fails while a killed task is still exiting
            try:
                os.rmdir(folder)
                removed.append(folder)
                break
            except OSError:
                time.sleep(0.05)
    return removed
