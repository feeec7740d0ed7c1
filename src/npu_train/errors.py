"""The base of every user-facing error (:class:`UserError`: the user can fix it, the message names the fix,
printed as an ``error:`` line folded at words within 100 columns, :func:`refusal_text`) and the exit statuses (:func:`exit_code_for`): 0 finished, 1 a card
process failed, 2 bad input, 130 / 143 SIGINT / SIGTERM.
"""
from __future__ import annotations

import errno
import math
import os
import re
import signal
import sys
from typing import Optional

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USER_ERROR = 2


#: the widest line a refusal prints (columns), the step lines' and the plan's width
REFUSAL_COLUMNS = 100

#: the narrowest width :func:`console_columns` folds to (a smaller terminal still gets lines of this width)
MIN_COLUMNS = 40


def console_columns(stream=None) -> int:
    """The one width every console line is folded to: ``min(terminal columns, REFUSAL_COLUMNS)`` (less the
    columns of a line prefix, :func:`reserve_console_columns`) when ``stream``
    (default stdout; the launcher's tees and the live bar's streams are looked through to the stream they
    wrap) is a terminal that reports its size (``COLUMNS`` when it reports none), else :data:`REFUSAL_COLUMNS`
    (a file, a pipe, a terminal of unknown size), never below :data:`MIN_COLUMNS`. A fresh-clone review saw
    text folded at the terminal's 120 columns and again at 100, and at 80 re-wrapped by the console library
    mid-phrase (issue 40)."""
    stream = sys.stdout if stream is None else stream
    for _ in range(8):  # launch/run.py's _LogTee / _ErrorLineTee (.inner), live._AboveBar (.orig)
        inner = stream.__dict__.get("inner", stream.__dict__.get("orig")) if hasattr(stream, "__dict__") else None
        if inner is None:
            break
        stream = inner
    try:
        fd = stream.fileno()
        cols = os.get_terminal_size(fd).columns if os.isatty(fd) else REFUSAL_COLUMNS
    except (AttributeError, ValueError, OSError):  # no file descriptor (a test's capture), a closed stream
        cols = REFUSAL_COLUMNS
    if cols <= 0:
        env = os.environ.get("COLUMNS", "")
        cols = int(env) if env.isdigit() and int(env) > 0 else REFUSAL_COLUMNS
    return max(MIN_COLUMNS, min(int(cols), REFUSAL_COLUMNS) - _RESERVED_COLUMNS[0])


#: columns taken off :func:`console_columns` for a prefix put before every console line (a concurrent sweep
#: job's ``[job 1/2] ``: launch/run.py), so that a line and its prefix together fit the console
_RESERVED_COLUMNS = [0]


def reserve_console_columns(n: int) -> None:
    """Make :func:`console_columns` ``n`` columns narrower (0: the whole width again) in this process."""
    _RESERVED_COLUMNS[0] = max(0, int(n))


#: a number and the unit (or ``x <number>``) after it, and a count's name and its number (micro-batch, dp,
#: pp, step, accum): joined when a line is folded ("0.0 s", "micro-batch 2 x 4", "12 GiB")
_UNIT = (r"(?:[GTMK]?FLOPS?|[GMK]i?B|B|M(?: params)?|s|ms|us|min|h|x|%|tok|tokens?|steps?|layers?|cards?|"
         r"cores?|threads?|stages?|replicas?|sequences?|params?|rows?|pairs?|samples?|plans?|jobs?|experts?)")
# a number and its unit ("153.8 GFLOP/s", "30 B/param", "1,000 M params/s", "2 thread(s)"), a "2 x 4" product, a
# result after its " = " ("= 417 M"), a count after its word ("micro-batch 2", "dp 2"), and a trailing "..." kept with the word before it
_NUMBER_UNIT = re.compile(r"(?<=\d) " + _UNIT + r"(?:\(s\))?(?:/[A-Za-z]+)*(?![\w/(]|\.\w)|(?<=\d x) (?=\d)|(?<= =) (?=\d)|"
                          r"(?:(?<=micro-batch)|(?<=\bdp)|(?<=\bpp)|(?<=\bstep)|(?<=\baccum)|(?<=accumulation)) (?=\d)|"
                          r"(?<=\S) (?=(?:\.\.\.|\u2026)(?:\s|$))")
_GLUE = "\ue000"  # a private-use character textwrap does not split at, put back to a space after folding


def wrap_words(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "  ") -> list[str]:
    """``text`` folded at words within ``width`` columns (:func:`textwrap.wrap`: no break at hyphens, a word
    wider than a line stays whole on a line of its own), never between a number and its unit ("0.0 s",
    "2 x 4": a fresh-clone review saw ``(0.0`` end one line and ``s to publish)`` start the next, issue 40).
    The lines, ``[]`` for an empty ``text``."""
    import textwrap

    glued = _NUMBER_UNIT.sub(lambda m: m.group(0).replace(" ", _GLUE), text)
    return [ln.replace(_GLUE, " ") for ln in textwrap.wrap(
        glued, width=width, initial_indent=initial_indent, subsequent_indent=subsequent_indent,
        break_on_hyphens=False, break_long_words=False)]


def refusal_text(message: str, prefix: str = "error: ", width: Optional[int] = None) -> str:
    """``prefix + message`` as printed: each of the message's own lines folded at words within ``width`` columns
    (default: :func:`console_columns` of stderr, where refusals go),
    the lines after the first indented two spaces and a folded line's continuation two more (a word wider than
    a line, a long path, stays whole on a line of its own, after the prefix when it comes first). Joining the lines that start with spaces back onto
    the first with single spaces gives the message on one line (``status.json``, grep). A fresh-clone review
    saw refusals of 142-451 columns on one line and an 8-cpu-card 8B refusal of ~5,000 characters (issue 40)."""
    width = console_columns(sys.stderr) if width is None else int(width)
    out = []
    for k, line in enumerate(str(message).split("\n")):
        indent = "" if k == 0 else "  "
        text = (prefix if k == 0 else "") + line.strip()
        folded = wrap_words(text, width, initial_indent=indent, subsequent_indent=indent + "  ") or [indent + text]
        if k == 0 and prefix.strip() and folded[0] == prefix.strip() and len(folded) > 1:
            # a first word wider than the line (a long path) stays on the prefix's line, never "error:" alone
            folded[:2] = [prefix + folded[1].strip()]
        out += folded
    return "\n".join(out)


def error_lines(text: str) -> list[str]:
    """The ``error:`` refusals in printed ``text`` (stderr, ``run.log``), each with its folded lines (those after
    it that start with spaces, :func:`refusal_text`) joined back with single spaces: one string a refusal."""
    out: list[str] = []
    open_ = False
    for line in str(text).splitlines():
        if line.startswith("error:"):
            out.append(line.rstrip())
            open_ = True
        elif open_ and line.startswith("  "):
            out[-1] += " " + line.strip()
        else:
            open_ = False
    return out


def one_refusal(text: str) -> Optional[str]:
    """The refusal when printed ``text`` is exactly one ``error:`` refusal (its folded lines included) and nothing
    else, on one line (:func:`error_lines`); None otherwise."""
    lines = [ln for ln in str(text).splitlines() if ln.strip()]
    if not lines or not lines[0].startswith("error:") or not all(ln.startswith("  ") for ln in lines[1:]):
        return None
    return error_lines(text)[0]


class UserError(Exception):
    """Base of errors caused by the user's input; printed folded within 100 columns (:func:`refusal_text`),
    exit status 2."""


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
    from), or None; ``checkpoint_dir``: its root (what the resume command names); ``failure``: the message without
    the part that names the checkpoint and how to resume (launch/run.py prints the whole resume command after it)."""

    def __init__(self, message: str = "", checkpoint: Optional[str] = None, checkpoint_dir: Optional[str] = None,
                 failure: Optional[str] = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.checkpoint_dir = checkpoint_dir
        self.failure = message if failure is None else failure


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


def nearest_existing(path: str) -> str:
    """``path`` made absolute, or its nearest parent that exists (a file, when a parent of ``path`` is one): where
    a free-space check or a write probe for a path still to be made looks, and what an error names."""
    p = os.path.abspath(path)
    while not os.path.lexists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return p


def out_of_space(e: BaseException) -> bool:
    """Whether ``e`` reports a full disk (``ENOSPC``, or a library error saying "No space left on device")."""
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


def fmt_disk_bytes(n: float) -> str:
    """A size on disk (a checkpoint, an export's ``model.safetensors``, the free space for them) in decimal units,
    as disks are sold and ``df -H`` prints them: GB (10**9 bytes) from 0.1 GB on (``"1.95 GB"``), else MB (10**6
    bytes, ``"33.6 MB"``). Memory figures are GiB (2**30 bytes, ``hardware.GIB``) and say so."""
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def fmt_number(x: float) -> str:
    """A float as a user writes it: plain where that reads well (``0.001``, ``0.05``, ``2.5``, ``100000``: from
    1e-3 to below 1e6, :func:`format` ``g`` where it is exact, else ``repr``), else scientific with the
    shortest exact mantissa and a bare exponent (``1e-4``, ``3e-5``, ``2.5e-5``, ``1e6``). Hydra and Python
    print ``train.lr=1e-4`` back as ``0.0001`` and ``3e-5`` as ``3e-05`` (issue 40)."""
    x = float(x)
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if 1e-3 <= abs(x) < 1e6:
        g = f"{x:g}"
        return g if float(g) == x else repr(x)
    for digits in range(17):
        mant, exp = f"{x:.{digits}e}".split("e")
        if float(f"{mant}e{exp}") == x:
            break
    mant = mant.rstrip("0").rstrip(".") if "." in mant else mant
    return f"{mant}e{int(exp)}"
