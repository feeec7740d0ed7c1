"""Whether the kernel's OOM killer ended a process: the cgroup v2 ``memory.events`` ``oom_kill`` counter
of the launcher's cgroup (read at start and at the death), or ``dmesg`` naming the pid when readable."""
from __future__ import annotations

import os
import re
import subprocess
from typing import Optional

from npu_train.checkpoint.stream import cgroup_dir


def oom_kills(events: Optional[str] = None) -> Optional[int]:
    """The ``oom_kill`` count of cgroup v2 ``memory.events`` (default: this process's cgroup), or None."""
    if events is None:
        base = cgroup_dir()
        if base is None:
            return None
        events = os.path.join(base, "memory.events")
    try:
        with open(events) as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def dmesg_names(pid: int) -> bool:
    """Whether the kernel log (``dmesg``, when this user may read it) reports ``pid`` killed for memory."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    pat = re.compile(rf"(Out of memory|oom).*\b(process|pid)[= ]?\s*{pid}\b", re.IGNORECASE)
    return any(pat.search(line) for line in out.splitlines()[-2000:])


class OomWatch:
    """Remembers the ``oom_kill`` counter at start; :meth:`cause` names an OOM kill seen since."""

    def __init__(self, events: Optional[str] = None):
        self.events = events
        self.start = oom_kills(events)

    def cause(self, pid: int) -> Optional[str]:
        """"killed by the OOM killer (...)" when the counter rose or dmesg names ``pid``, else None."""
        now = oom_kills(self.events)
        if self.start is not None and now is not None and now > self.start:
            return f"killed by the OOM killer (cgroup memory.events oom_kill {self.start} -> {now})"
        if dmesg_names(pid):
            return f"killed by the OOM killer (dmesg names process {pid})"
        return None
