"""Torch threads per card process: one rule for the launcher (``torch.set_num_threads``) and the
planner (which profile rates apply); usable cores honour the affinity mask and the cgroup CPU quota."""
from __future__ import annotations

import math
import os
from typing import Optional

__all__ = ["threads_per_card", "usable_cores", "cgroup_cpu_quota", "read_sys_file"]


#: cgroup v2 file, then the cgroup v1 (quota, period) pairs in their usual mount points
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_DIRS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")


def read_sys_file(path: str) -> Optional[str]:
    """Stripped text of ``path``, or ``None`` when unreadable (the tests replace this)."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_quota() -> Optional[float]:
    """The cgroup CPU limit in CPUs (cgroup v2 ``cpu.max``, else v1 quota / period), or ``None``."""
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
    """Cores this process may use: the affinity mask, limited by the cgroup quota (rounded down), >= 1."""
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
    """torch threads of each card process: ``requested`` when > 0 (``runtime.threads``), else
    ``max(1, cores // cards_on_host)`` (``cores``: :func:`usable_cores`). ``cards_on_host`` counts accelerator
    cards too (their processes run host AdamW and copies). Raises ``ValueError`` for ``requested < 0`` or
    ``cards_on_host < 1``."""
    requested = int(requested or 0)
    if requested < 0:
        raise ValueError(f"threads must be >= 0 (0 = divide the cores), got {requested}")
    if cards_on_host < 1:
        raise ValueError(f"need at least one card process on the host, got {cards_on_host}")
    if requested > 0:
        return requested
    cores = usable_cores() if cores is None else int(cores)
    return max(1, cores // cards_on_host)
