"""How many cores this process may use: what a container or a CPU set leaves it, not the
host's count (``os.cpu_count()``), which a worker in a container limited to 4 CPUs of a
64-core host would take as 64 threads a job, throttled by its quota."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores of this process's CPU affinity, capped by its cgroup's CPU quota (a
    container's ``--cpus``: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), a fraction rounded up; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        return max(1, min(cores or 1, math.ceil(quota)))
    return max(1, cores or 1)


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (1.5 = one and a half), None without a quota."""
    try:
        limit, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if limit == "max":
            return None
        quota, length = int(limit), int(period)
        return quota / length if quota > 0 and length > 0 else None
    except (OSError, ValueError):  # no such file, or not two numbers: no quota read there
        pass
    try:
        quota_us = int((cgroup_root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup_root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
