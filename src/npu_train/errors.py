"""The base of every user-facing error (:class:`UserError`: the user can fix it, the message names the fix,
printed as one ``error:`` line) and the exit statuses (:func:`exit_code_for`): 0 finished, 1 a card
process failed, 2 bad input, 130 / 143 SIGINT / SIGTERM.
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


class BackendUnavailableError(UserError, RuntimeError):
    """The device runtime a backend entry needs is missing on this machine (no driver / library /
    device nodes / package), or the device cannot be used at all. The message says what to do.
    (Here, not in ``backends/base.py``, so that the backend list is checked without importing torch.)"""


class BackendSpecError(UserError, ValueError):
    """A malformed or impossible ``backend`` list; the message names the entry and the fix."""


class JobFailed(Exception):
    """The job was brought down by a failed card process; ``str(self)`` names card, stage, phase and cause.
    ``checkpoint``: the latest complete checkpoint of the run (saved by this launch or the one it resumed
    from), or None; ``checkpoint_dir``: its root (what the resume command names)."""

    def __init__(self, message: str = "", checkpoint: Optional[str] = None, checkpoint_dir: Optional[str] = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir


class Interrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM ``signum`` stopped the job (exit ``128 + signum``); ``checkpoint``: the one saved, or None;
    ``preparing``: it came while the launch prepared, before any card process was started."""

    def __init__(self, signum: int = signal.SIGINT, message: str = "", checkpoint: Optional[str] = None,
                 checkpoint_dir: Optional[str] = None, preparing: bool = False):
        super().__init__(message)
        self.signum = int(signum)
        self.message = message
        self.checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir
        self.preparing = preparing

    def headline(self) -> str:
        """The launcher's line for it, e.g. ``interrupted by SIGTERM: all card processes stopped``, or ``...
        while preparing: no card process had started``; the caller appends the checkpoint note."""
        what = " while preparing: no card process had started" if self.preparing else ": all card processes stopped"
        return f"interrupted by {signal.Signals(self.signum).name}{what}"


#: SIGINT/SIGTERM numbers received before the job's own handlers were installed (launch/run.py notes them
#: here while ``run_job``'s module and torch import); :func:`raise_pending_signal` acts on the first
PENDING_SIGNALS: list = []


def raise_pending_signal() -> None:
    """Raise ``Interrupted(signum, preparing=True)`` for a signal held in :data:`PENDING_SIGNALS` (then
    cleared); nothing when none is held. Called where the job can first stop cleanly."""
    if PENDING_SIGNALS:
        signum = PENDING_SIGNALS[0]
        PENDING_SIGNALS.clear()
        raise Interrupted(signum, preparing=True)


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
    """Whether ``e`` reports a full disk (``ENOSPC``, or a library error saying "No space left on device")."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
