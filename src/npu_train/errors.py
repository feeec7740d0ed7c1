"""The one base of every user-facing error.

Anything the user can fix (a bad override, a missing model file, a malformed backend entry, an
infeasible placement, a too-small ``/dev/shm``, a checkpoint from another model, ...) raises a
subclass of :class:`UserError`. The entry point (``launch/run.py``) prints such an error as one
``error: ...`` line without a traceback and exits with status 2 (:data:`EXIT_USER_ERROR`);
nothing is written before the check that raises it. Every subclass's message names the fix.

Exit statuses of ``launch/run.py`` (mapped in :func:`exit_code_for`):

=====  ===========================================================
0      the job finished
1      a card process failed (the message names card, stage, phase)
2      bad input (:class:`UserError`), found before any card process started
130    interrupted by SIGINT (Ctrl-C), after a checkpoint when possible
143    interrupted by SIGTERM (``kubectl delete``), likewise
=====  ===========================================================
"""
from __future__ import annotations

import errno
import signal
from typing import Optional

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USER_ERROR = 2


class UserError(Exception):
    """Base of errors caused by the user's input; printed as one line, exit status 2."""


class ConfigError(UserError, ValueError):
    """A configuration value is invalid; the message names the key and the fix."""


class JobFailed(Exception):
    """The job was brought down by a failed card process; ``str(self)`` names card, stage, phase and cause."""


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM stopped the job; the exit status is ``128 + signum`` (130 / 143).

    Args:
        signum: the signal received last.
        message: where the job stopped (checkpoint saved, how to resume), printed after the signal name.
        checkpoint: the checkpoint directory saved by this launch (None: none saved).
        checkpoint_dir: the job's checkpoint root (``checkpoint.dir``), what a resume names.
    """

    def __init__(self, signum: int = signal.SIGINT, message: str = "", checkpoint: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None):
        super().__init__(message)
        self.signum = int(signum)
        self.message = message
        self.checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir


def exit_code_for(exc: BaseException) -> int:
    """Exit status of ``launch/run.py`` for an exception that ended the job (see the module table)."""
    if isinstance(exc, JobFailed):
        return EXIT_JOB_FAILED
    if isinstance(exc, KeyboardInterrupt):
        return 128 + int(getattr(exc, "signum", signal.SIGINT))
    if isinstance(exc, (UserError, FileNotFoundError)):
        return EXIT_USER_ERROR
    raise TypeError(f"not a job-ending error: {type(exc).__name__}")


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` reports a full disk: an ``OSError`` with ``ENOSPC``, or a library error wrapping
    it (safetensors' ``SafetensorError``, tokenizers' ``Exception``: "No space left on device")."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
