"""``kill -USR1 <pid>``: every thread's Python stack to stderr, then a line naming the process; the job goes on.

:func:`install_stack_dump` (called by the launcher and every card process) uses :mod:`faulthandler`, so stacks
print even while the main thread is stuck in C code; the naming line comes from a chained Python handler, so
it prints only once the main thread runs Python again."""
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
    """Make SIGUSR1 print every thread's stack of this process to stderr (C-level, immediately), followed
    by a line naming it as ``label`` (e.g. ``"card 1"``, ``"the launcher"``; Python-level, best effort).
    Idempotent; call it from the main thread (``signal.signal`` raises ``ValueError`` elsewhere)."""
    global _label
    _label = label
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, _name_the_dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
