"""The live progress display on a terminal (``runtime.progress``): a ``rich`` progress bar under the output.

Start at :func:`live_progress`: on a terminal (``auto``) it returns a :class:`LiveProgress`, else None and the
plain per-step lines of logs and CI stay exactly as they are. While it runs, everything printed goes above
the bar (``sys.stdout`` / ``sys.stderr`` are replaced by :class:`_AboveBar`) and still reaches the job's log
file whole; the bar shows the current phase (preparing, tokenizing, each card's model load, compilation,
rendezvous), then the step with ETA, loss, tokens/s, MFU and memory per card.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["LiveProgress", "live_progress", "PROGRESS"]

#: ``runtime.progress`` values
PROGRESS = ("auto", "rich", "plain")

GIB = 2 ** 30

#: the bar's width (columns) where the line has room, and the least it shrinks to before the step's fields go
BAR_MAX, BAR_MIN = 24, 10


def shorten_label(text: str, width: int) -> str:
    """``text`` within ``width`` columns, never cut inside a word: whole when it fits, else its leading
    ``; ``-separated clauses that fit (``card 0: ...; card 1: ...``) and ``; …``, else its leading words and
    ``…`` (``…`` alone when not even the first word fits; ``""`` for ``width`` < 1). A fresh-clone review saw
    the phase cut at 60 characters mid-word: ``card 1: peak FLOP/s (a matmu`` (issue 40)."""
    if len(text) <= width:
        return text
    if width < 1:
        return ""
    clauses = text.split("; ")
    kept = 0
    while kept < len(clauses) - 1 and len("; ".join(clauses[:kept + 1]) + "; …") <= width:
        kept += 1
    if kept:
        return "; ".join(clauses[:kept]) + "; …"
    words, out = text.split(" "), ""
    for w in words:
        if len(f"{out} {w}".strip() + "…") > width:
            break
        out = f"{out} {w}".strip()
    return out.rstrip(";:,") + "…" if out else "…"


def bar_layout(width: int, description: str, count: str, eta: str, fields: list[str]) -> tuple[str, int, str]:
    """The bar's line fitted to ``width`` columns: ``(description, bar width, info)``. The line is the spinner
    (1 column), the description, the bar, ``count`` (``k/N``), ``eta`` and the info (``fields`` joined by
    `` | ``), one space between columns. Where it does not fit, the fields go from the last (least important:
    memory, MFU, tokens/s, loss), then the description is shortened (:func:`shorten_label`), the bar keeping
    :data:`BAR_MIN` columns (4 on a line too narrow for that and a 12-column description); a field never splits from its value. A fresh-clone review saw the bar take two
    lines with ``MFU`` on one and ``28.0%`` on the next (issue 40)."""
    rest = width - 1 - 5 - len(count) - len(eta)  # the spinner, the five spaces between six columns
    fields = list(fields)
    while fields and len(description) + len(" | ".join(fields)) + BAR_MIN > rest:
        fields.pop()
    info = " | ".join(fields)
    room = rest - len(info)
    floor = BAR_MIN if room - BAR_MIN >= 12 else 4  # a narrow line: a shorter bar before a cut description
    description = shorten_label(description, room - floor)
    return description, max(1, min(BAR_MAX, rest - len(description) - len(info))), info


def live_progress(mode: str, total_steps: int, start_step: int = 0, sweep: bool = False,
                  stream=None) -> Optional["LiveProgress"]:
    """A started :class:`LiveProgress` for ``mode`` (``auto``: when ``stream`` (stdout) is a terminal, not a
    sweep job (concurrent jobs share one console) and ``TERM`` is not ``dumb``; ``rich``: always; ``plain``:
    never), else None."""
    stream = stream or sys.stdout
    if mode == "plain" or (mode == "auto" and (sweep or not _is_tty(stream)
                                              or os.environ.get("TERM", "") == "dumb")):
        return None
    return LiveProgress(total_steps, start_step, stream).start()


def _is_tty(stream) -> bool:
    inner = getattr(stream, "inner", stream)  # launch/run.py's log tee
    try:
        return bool(inner.isatty())
    except (AttributeError, ValueError):
        return False


class _AboveBar:
    """A text stream that prints whole lines above the live bar and copies them to the job's log file (the
    ``log`` of launch/run.py's tee, when there is one)."""

    def __init__(self, live: "LiveProgress", orig, style: Optional[str] = None):
        self.live, self.orig, self.style, self.buf = live, orig, style, ""

    def write(self, s: str) -> int:
        from npu_train.metrics.report import fold_long_line

        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            # at words, at the console's one width (the terminal, or rich, would break mid-word)
            line = fold_long_line(line, self.live.width)
            self.live.print(line, line, style=self.style, log=getattr(self.orig, "log", None))
        return len(s)

    def flush(self) -> None:
        log = getattr(self.orig, "log", None)
        if log is not None:
            try:
                log.flush()
            except (OSError, ValueError):
                pass

    def isatty(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self.orig, name)


class LiveProgress:
    """The bar: a description (phase), ``step k/N``, the time left, and the last step's figures."""

    def __init__(self, total_steps: int, start_step: int, stream):
        from rich.console import Console

        from npu_train.errors import console_columns

        terminal = getattr(stream, "inner", stream)
        # one width for the bar and the lines above it: the terminal's, at most 100 (rich's own guess was 80 on
        # a terminal that reports no size, which cut the bar's step count and re-wrapped lines mid-phrase)
        self.width = console_columns(terminal)
        self.console = Console(file=terminal, width=self.width, highlight=False, emoji=False, markup=False)
        self.total, self.start_step = int(total_steps), int(start_step)
        self.progress = None
        self.task = None
        self._saved = None
        self._card_phase: dict[int, str] = {}
        self._bar = None
        self._desc, self._eta, self._fields = "preparing", "", []
        self._done = self.start_step

    def start(self) -> "LiveProgress":
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
        from rich.table import Column

        # the ETA is the reporter's (steps left x mean step time after the start-up step): rich's own
        # TimeRemainingColumn showed -:--:-- whenever a step took longer than its 30 s speed window
        # one line, fitted by _show (bar_layout): no cell wraps (the step's figures folded "MFU" from "28.0%") and
        # none is cut by rich (it cut every column alike: the step count showed as "1…")
        def cell() -> Column:
            return Column(no_wrap=True, overflow="ignore")

        self._bar = BarColumn(bar_width=BAR_MAX, table_column=cell())
        self.progress = Progress(SpinnerColumn(table_column=cell()),
                                 TextColumn("{task.description}", table_column=cell()), self._bar,
                                 MofNCompleteColumn(table_column=cell()),
                                 TextColumn("{task.fields[eta]}", table_column=cell()),
                                 TextColumn("{task.fields[info]}", table_column=cell()),
                                 console=self.console, transient=True,
                                 redirect_stdout=False, redirect_stderr=False, refresh_per_second=4)
        self.task = self.progress.add_task("preparing", total=self.total, completed=self.start_step, info="", eta="")
        self._show()
        self.progress.start()
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout = _AboveBar(self, sys.stdout)
        sys.stderr = _AboveBar(self, sys.stderr)
        return self

    def print(self, terminal_text: str, log_text: str, style: Optional[str] = None, log=None) -> None:
        """``terminal_text`` above the bar; ``log_text`` (+ newline) to ``log`` (the job's log file) when given,
        else to the log of the stdout this display replaced."""
        if log is None and self._saved is not None:
            log = getattr(self._saved[0], "log", None)
        if log is not None:
            try:
                log.write(log_text + "\n")
            except (OSError, ValueError):
                pass
        # folded already (at words, to self.width): rich must not wrap it again
        self.console.print(terminal_text, style=style, soft_wrap=True, crop=False)

    def phase(self, text: str, rank: Optional[int] = None) -> None:
        """The current start-up phase (``rank``: a card's, shown as ``card r: ...``)."""
        if self.progress is None:
            return
        if rank is not None:
            self._card_phase[rank] = text
            text = "; ".join(f"card {r}: {p}" for r, p in sorted(self._card_phase.items()))
        self._desc = text
        self._show()

    def _show(self) -> None:
        """Put the phase, step count, ETA and figures on the bar, fitted to one line of ``self.width``."""
        w = len(str(self.total))
        count = f"{self._done:{w}d}/{self.total}"
        desc, bar, info = bar_layout(self.width, self._desc, count, self._eta, self._fields)
        self._bar.bar_width = bar
        self.progress.update(self.task, completed=self._done, description=desc, info=info, eta=self._eta)

    def at_step(self, step: int) -> None:
        """A resumed run starts the bar at ``step``."""
        if self.progress is not None:
            self._done = int(step)
            self._show()

    def step(self, rec: dict) -> None:
        """Move the bar to ``rec["step"]`` with its loss, tokens/s, MFU and memory per card."""
        if self.progress is None:
            return
        mem = "/".join(f"{m / GIB:.2f}" for m in rec.get("mem_peak_bytes", []))
        from npu_train.metrics.report import fmt_duration, mfu_text, tok_text

        mfu = mfu_text(rec)[3:]
        # most important first: bar_layout drops from the end where the line is too narrow
        self._fields = [f"loss {rec['loss']:.4f}", tok_text(rec)] + ([mfu] if mfu else []) + [f"mem {mem} GiB"]
        self._card_phase.clear()
        self._eta = f"ETA {fmt_duration(rec['eta_s'])}" if rec.get("eta_s") is not None else ""
        self._done, self._desc = int(rec["step"]), "training"
        self._show()

    def stop(self) -> None:
        """Remove the bar and give stdout / stderr back (idempotent)."""
        if self._saved is not None:
            for s in (sys.stdout, sys.stderr):
                if isinstance(s, _AboveBar) and s.buf:
                    s.write("\n")
            sys.stdout, sys.stderr = self._saved
            self._saved = None
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> "LiveProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
