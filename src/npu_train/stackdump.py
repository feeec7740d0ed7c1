"""``kill -USR1 <pid>``: every thread's Python stack to stderr (:mod:`faulthandler`, so also while stuck in
C), then a line naming the process; the job goes on.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys

_label = "this process"


def _name_the_dump(signum, frame) -> None:  # the Python half: runs in the main thread, after the C-level dump
    try:
        sys.stderr.write(f"^ the Python stacks above are {_label}'s (pid {os.getpid()}, kill -USR1); it goes on\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not kill the job
        pass


def install_stack_dump(label: str) -> None:
    """Install the SIGUSR1 stack dump, naming the process ``label``. Idempotent; main thread only (ValueError)."""
    global _label
    _label = label
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, _name_the_dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
