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


def test_the_bar_keeps_the_step_count_on_a_narrow_terminal():
    """At 80 columns a long phase and step figures wrap in their own cells; the step count ``1/10`` stays whole
    (rich cut every column alike, down to ``1…``)."""
    from rich.console import Console

    from npu_train.metrics.live import LiveProgress

    buf = io.StringIO()
    live = LiveProgress(10, 0, buf)
    live.console = Console(file=buf, width=80, color_system=None, highlight=False, emoji=False, markup=False)
    live.start()
    try:
        live.step({"step": 1, "loss": 2.3456, "tokens_per_s": 1234.0, "mfu": 0.121, "mem_peak_bytes": [2 ** 30] * 8,
                   "eta_s": 100})
        live.progress.update(live.task, description="card 0: loading the model; card 1: loading the model")
        out = io.StringIO()
        Console(file=out, width=80, color_system=None).print(live.progress.make_tasks_table(live.progress.tasks))
    finally:
        live.stop()
    text = out.getvalue()
    assert "1/10" in text and "…" not in text, text
    assert max(len(ln) for ln in text.splitlines()) <= 80, text
