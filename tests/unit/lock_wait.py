"""Shared by the text and chat build tests: run a packed-data build while a stand-in for another node holds
its build lock, check that it waits, then finish that node's build and return what the waiter mapped."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable


def build_while_locked(build: Callable[[Callable[[str], None]], object], target: Path, built: str):
    """``build(log)`` in a thread while ``<target>.lock`` names ``node0 pid 1``; asserts it waits (a
    "waiting for node0 pid 1" line, still running after 1 s), then puts ``built`` (the other node's file) at
    ``target`` and drops the lock. Returns ``(result of build, log lines)``."""
    lock = target.with_name(target.name + ".lock")
    lock.write_text("node0 pid 1\n")
    out, logs = {}, []
    th = threading.Thread(target=lambda: out.update(d=build(logs.append)))
    th.start()
    time.sleep(1.0)
    assert th.is_alive() and any("waiting for node0 pid 1" in m for m in logs), logs
    os.link(built, target)
    lock.unlink()
    th.join(30)
    return out["d"], logs
