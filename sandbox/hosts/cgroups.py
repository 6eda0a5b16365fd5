"""A CPU meter per host: one cgroup per host that its processes (and their children, such as
run workers) are put in, read as CPU seconds. Only accounting, no limits.

cgroup v1 ``cpuacct`` (``cpuacct.usage``, ns) when the machine mounts it, else cgroup v2
(``cpu.stat`` ``usage_usec``, kept by every v2 cgroup) at ``/sys/fs/cgroup/unified`` (hybrid
layout) or ``/sys/fs/cgroup``. Without either, metering is off and everything else works.

A process is put in its host's group by the parent right after it is started (inside a host,
``ip netns exec`` mounts a fresh ``/sys``, so the cgroup files are not visible from there). The
groups are removed by ``down`` once their processes are gone.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

V1_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
V2_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def hierarchy() -> Path | None:
    """Where per-host groups go, or None when CPU accounting is unavailable."""
    if (V1_CPUACCT / "cpuacct.usage").exists():
        return V1_CPUACCT
    for root in V2_ROOTS:
        if (root / "cgroup.controllers").exists():
            return root
    return None


def create(name: str) -> Path | None:
    """Make (or reuse) the group ``name``; None if accounting is unavailable or not allowed."""
    root = hierarchy()
    if root is None:
        return None
    path = root / name
    try:
        path.mkdir(exist_ok=True)
    except OSError:
        return None
    return path


def add(group: Path | str | None, pid: int) -> bool:
    """Move ``pid`` into ``group`` (its future children follow)."""
    if not group:
        return False
    try:
        (Path(group) / "cgroup.procs").write_text(str(pid))
    except OSError:
        return False
    return True


def cpu_seconds(group: Path | str | None) -> float | None:
    """CPU time used by every process ever in ``group`` (ended ones included)."""
    if not group:
        return None
    path = Path(group)
    try:
        if (path / "cpuacct.usage").exists():
            return int((path / "cpuacct.usage").read_text()) / 1e9
        for line in (path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        return None
    return None


def remove(group: Path | str | None, timeout: float = 5.0) -> bool:
    """Remove an empty group (processes that just died may take a moment to leave it)."""
    if not group or not Path(group).exists():
        return True
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            Path(group).rmdir()
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
