"""Who owns a leftover resource (checkpoint staging dir, a job's shm segments and IPC dir) and whether it runs.

The owner is :func:`process_identity` of the job's launcher (pid, creation time, host name); a leftover is
removed only when :func:`owner_alive` says the owner is gone, never when it is on another host."""
from __future__ import annotations

import socket
from typing import Optional


def process_identity(pid: int) -> Optional[dict]:
    """``{"pid", "start", "host"}`` of running process ``pid`` (``start`` rounded to 0.01 s), or None if
    there is no such process."""
    import psutil

    try:
        start = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return {"pid": int(pid), "start": round(start, 2), "host": socket.gethostname()}


def owner_alive(owner: Optional[dict]) -> Optional[bool]:
    """Whether the process recorded by :func:`process_identity` still runs: True or False; None when it
    ran on another host (cannot tell from here). A missing or malformed record counts as dead."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    if owner.get("host") != socket.gethostname():
        return None
    now = process_identity(owner["pid"])
    try:
        return now is not None and abs(now["start"] - float(owner.get("start", now["start"]))) < 1.0
    except (TypeError, ValueError):
        return False
