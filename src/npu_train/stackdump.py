"""``kill -USR1 <pid>``: every thread's Python stack to stderr, then a line naming the process; the job goes on.

The launcher (``launch/run.py``) and every card process (``runtime/worker.py``) call
:func:`install_stack_dump` at start-up. The stacks come from :mod:`faulthandler`'s C-level handler, so
they print even while the process's main thread is stuck inside a C call (a gloo collective, a ZeroMQ
wait, a device kernel). faulthandler prints thread ids only; the line that names the process (``card 1
(pid 4242)``) is printed by a Python handler that faulthandler chains to, which runs when the main
thread next executes Python code: for a process stuck in C code it comes later, when it unblocks, or
never. When several processes are signalled at once (the multi-node tests' timeout path), their dumps
share the launcher's stderr and can interleave.
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
    """Make SIGUSR1 print every thread's stack of this process to stderr (C-level, immediately), followed
    by a line naming it as ``label`` (e.g. ``"card 1"``, ``"the launcher"``; Python-level, best effort).
    Idempotent; call it from the main thread (``signal.signal`` raises ``ValueError`` elsewhere)."""
    global _label
    _label = label
    faulthandler.unregister(signal.SIGUSR1)
    signal.signal(signal.SIGUSR1, _name_the_dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
