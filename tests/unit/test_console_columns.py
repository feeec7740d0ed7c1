"""The one console width (issue 40, fresh-clone review): ``min(terminal columns, 100)``, 100 for a file, a pipe
or a terminal that reports no size; the live bar's console uses it and does not wrap the lines printed above
the bar again (rich guessed 80 columns on a terminal of no size and re-wrapped lines mid-phrase there). Each
check opens a pseudo-terminal of a given size."""
from __future__ import annotations

import fcntl
import io
import os
import select
import struct
import termios

import pytest

from npu_train.errors import console_columns


def _pty(cols: int):
    """A pseudo-terminal of ``cols`` columns (0: no size): (its master fd, a text stream on its slave)."""
    master, slave = os.openpty()
    if cols:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    return master, os.fdopen(slave, "w", buffering=1)


def _read(master: int) -> str:
    out = b""
    while select.select([master], [], [], 0.5)[0]:  # a wait for the written bytes, not a timing
        data = os.read(master, 65536)
        if not data:
            break
        out += data
    return out.decode(errors="replace").replace("\r\n", "\n")


class _Tee:
    """A wrapper like launch/run.py's log tee (``inner``: the console stream)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("cols,want", [(80, 80), (100, 100), (120, 100), (0, 100)])
def test_the_width_is_the_terminals_at_most_100(monkeypatch, cols, want):
    monkeypatch.delenv("COLUMNS", raising=False)
    master, stream = _pty(cols)
    try:
        assert console_columns(stream) == want
        assert console_columns(_Tee(_Tee(stream))) == want  # looked through the launcher's tees
    finally:
        stream.close()
        os.close(master)


def test_a_file_or_a_capture_is_100_and_columns_names_an_unsized_terminal(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "70")
    with open(tmp_path / "out.txt", "w") as f:
        assert console_columns(f) == 100  # not a terminal: COLUMNS does not apply
    assert console_columns(io.StringIO()) == 100
    master, stream = _pty(0)
    try:
        assert console_columns(stream) == 70
    finally:
        stream.close()
        os.close(master)


def test_the_bar_console_does_not_wrap_a_folded_line_again(monkeypatch):
    """On a terminal of no size, a 95-column line printed above the bar reaches the terminal as one line (rich
    folded it at its guess of 80 columns), and the bar's console is 100 wide."""
    from npu_train.metrics.live import LiveProgress

    monkeypatch.delenv("COLUMNS", raising=False)
    master, stream = _pty(0)
    try:
        live = LiveProgress(10, 0, stream)
        assert live.width == 100 and live.console.width == 100
        line = " ".join(["word"] * 19)  # 94 columns
        live.print(line, line)
        stream.flush()
        got = [ln for ln in _read(master).split("\n") if ln.strip()]
        assert got == [line], got
    finally:
        stream.close()
        os.close(master)


def _bar_lines(width: int, total: int, phases: list[tuple[int, str]], rec=None) -> list[str]:
    """The live bar's rendered lines at ``width`` columns after ``phases`` (``(card, text)``) and step ``rec``."""
    from rich.console import Console

    from npu_train.metrics.live import LiveProgress

    buf = io.StringIO()
    live = LiveProgress(total, 0, buf)
    live.width = width
    live.console = Console(file=buf, width=width, color_system=None, highlight=False, emoji=False, markup=False)
    live.start()
    try:
        for rank, text in phases:
            live.phase(text, rank)
        if rec is not None:
            live.step(rec)
        out = io.StringIO()
        Console(file=out, width=width, color_system=None).print(live.progress.make_tasks_table(live.progress.tasks))
    finally:
        live.stop()
    return [ln.rstrip() for ln in out.getvalue().splitlines() if ln.strip()]


#: the fresh-clone review's step (issue 40): at 80 and 120 columns the bar took two lines, "MFU" / "28.0%"
REVIEW_STEP = {"step": 1, "loss": 4.0859, "tokens_per_s": 99.0, "mfu": 0.28, "mem_peak_bytes": [2.67 * 2 ** 30,
                                                                                                  2.01 * 2 ** 30],
               "eta_s": 21}
STEP_FIELDS = ["loss 4.0859", "99 tok/s", "MFU 28.0%", "mem 2.67/2.01 GiB"]


@pytest.mark.parametrize("width,total,fields", [(100, 20, 4), (80, 3, 3), (60, 20, 2), (40, 1000, 0)])
def test_the_bar_is_one_line_and_drops_whole_fields_from_the_end(width, total, fields):
    """The bar with a step's figures is one line within the width; where they do not all fit, the last ones
    (memory, then MFU, tokens/s, loss) are left out whole, never a label without its value, and the step count
    stays whole. Room for the description, bar and figures: width - 1 (spinner) - 5 (spaces between six
    columns) - len(" 1/20") - len("ETA 21s"); the figures take 11 + 3 + 8 + 3 + 9 + 3 + 17 = 54 columns, the
    first three 34, two 22, the loss 11; with "training" (8) and a bar of at least 10: 100 -> 82 >= 72 (all
    four), 80 ("1/3") -> 64 < 72 but >= 52 (three), 60 -> 42 (two), 40 ("   1/1000") -> 18 < 29 (none)."""
    got = _bar_lines(width, total, [(0, "loading the model")], dict(REVIEW_STEP))
    assert len(got) == 1 and len(got[0]) <= width, got
    line = got[0]
    assert f"{1:{len(str(total))}d}/{total}" in line and "training" in line and "ETA 21s" in line, line
    info = line.split("ETA 21s", 1)[1].strip()
    assert info == " | ".join(STEP_FIELDS[:fields]), line


def test_a_long_phase_is_shortened_at_a_clause_or_word_on_one_line():
    """Two cards' phases that do not fit keep the first whole clause and ``; …`` (a review saw ``text[:60]``:
    ``card 1: peak FLOP/s (a matmu``); one that does not fit is cut after a word, with ``…``."""
    from npu_train.metrics.live import shorten_label

    two = [(0, "peak FLOP/s (a matmul)"), (1, "peak FLOP/s (a matmul)")]
    both = "card 0: peak FLOP/s (a matmul); card 1: peak FLOP/s (a matmul)"
    wide = _bar_lines(100, 3, two)
    assert len(wide) == 1 and both in wide[0], wide
    narrow = _bar_lines(80, 3, two)
    assert len(narrow) == 1 and len(narrow[0]) <= 80, narrow
    assert "card 0: peak FLOP/s (a matmul); …" in narrow[0] and "card 1" not in narrow[0], narrow
    assert "0/3" in narrow[0], narrow
    assert shorten_label("loading the model weights", 20) == "loading the model…"
    assert shorten_label("loading", 20) == "loading"
    assert shorten_label("supercalifragilistic", 5) == "…"
    assert shorten_label("a b; c d; e f", 9) == "a b; …"  # "a b; c d; …" is 11
