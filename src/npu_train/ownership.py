"""Who owns a leftover resource (staging dir, shm segments, IPC dir) — :func:`process_identity` of its
launcher — and whether it still runs (:func:`owner_alive`).
"""
from __future__ import annotations

import socket
from typing import Optional


def process_identity(pid: int) -> Optional[dict]:
    """``{"pid", "start" (s, 0.01), "host"}`` of running process ``pid``, or None."""
    import psutil

    try:
        start = psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return {"pid": int(pid), "start": round(start, 2), "host": socket.gethostname()}


def owner_alive(owner: Optional[dict]) -> Optional[bool]:
    """Whether the recorded process runs: True/False (a bad record is dead); None on another host."""
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int):
        return False
    if owner.get("host") != socket.gethostname():
        return None
    now = process_identity(owner["pid"])
    try:
        return now is not None and abs(now["start"] - float(owner.get("start", now["start"]))) < 1.0
    except (TypeError, ValueError):
        return False
