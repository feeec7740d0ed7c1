"""Who owns a leftover resource (a checkpoint staging directory, a job's shared-memory segments and
IPC directory), and whether that process still runs.

A resource records its owner as :func:`process_identity` of the job's launcher: pid, the process's
creation time (seconds since the epoch, from psutil; a recycled pid has another one) and the host
name. A later launch removes a leftover only when :func:`owner_alive` says its owner is gone; a
resource owned on another host (a shared file system, a container with another host name sharing
``/dev/shm``) is never removed from here, since its process table cannot be seen.
"""
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
