"""Torch threads per card process: one rule, used by the launcher (``torch.set_num_threads`` in
each card process) and by the planner (which rates of a calibration profile apply).

Usable cores = the CPUs this process may run on (``os.sched_getaffinity(0)``; ``os.cpu_count()``
where the platform lacks it), limited by the cgroup CPU quota when one is set (a container's
``--cpus`` / a Kubernetes CPU limit): cgroup v2 ``/sys/fs/cgroup/cpu.max`` (``"<quota> <period>"``
or ``"max <period>"``), else cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota ``-1``
= none). A fractional quota is rounded down (1.5 CPUs -> 1 core: a second thread would be
throttled), at least 1.
"""
from __future__ import annotations

import math
import os
from typing import Optional

__all__ = ["threads_per_card", "usable_cores", "cgroup_cpu_quota", "read_sys_file"]

#: cgroup v2 file, then the cgroup v1 (quota, period) pairs in their usual mount points
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_DIRS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")


def read_sys_file(path: str) -> Optional[str]:
    """Stripped text of ``path``, or ``None`` when it cannot be read (the tests replace this)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota() -> Optional[float]:
    """The cgroup CPU limit in CPUs (quota / period, e.g. 2.5), or ``None`` when none is set or
    the files are absent or malformed."""
    text = read_sys_file(CGROUP_V2_CPU_MAX)
    if text is not None:
        parts = text.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                quota, period = float(parts[0]), float(parts[1])
            except ValueError:
                return None
            return quota / period if quota > 0 and period > 0 else None
        return None
    for d in CGROUP_V1_DIRS:
        q, p = read_sys_file(f"{d}/cpu.cfs_quota_us"), read_sys_file(f"{d}/cpu.cfs_period_us")
        if q is None or p is None:
            continue
        try:
            quota, period = float(q), float(p)
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cores() -> int:
    """Cores this process may use: affinity mask size, limited by the cgroup CPU quota (rounded
    down), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS / Windows
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def threads_per_card(requested: Optional[int], cards_on_host: int,
                     cores: Optional[int] = None) -> int:
    """torch intra-op threads of each card process on this host.

    Args:
        requested: ``runtime.threads``; used as is when > 0 (``None`` or 0: not set).
        cards_on_host: card processes on this host, cpu and accelerator cards alike (an
            accelerator card's process runs the host AdamW of its offloaded layers and the
            copies on the CPU too).
        cores: the cores to divide; ``None``: :func:`usable_cores`.

    Returns:
        ``requested`` if > 0, else ``max(1, cores // cards_on_host)``.

    Raises:
        ValueError: ``requested < 0`` or ``cards_on_host < 1``.
    """
    requested = int(requested or 0)
    if requested < 0:
        raise ValueError(f"threads must be >= 0 (0 = divide the cores), got {requested}")
    if cards_on_host < 1:
        raise ValueError(f"need at least one card process on the host, got {cards_on_host}")
    if requested > 0:
        return requested
    cores = usable_cores() if cores is None else int(cores)
    return max(1, cores // cards_on_host)
