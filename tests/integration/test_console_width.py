"""One width for everything the launcher prints on a terminal: ``min(terminal columns, 100)``, 100 on a terminal
that reports no size (issue 40, fresh-clone review: on a 120-column terminal the plan's prose was folded at 120
and again at 100, leaving lines like ``  [assumed], h2d``; at 80 the tables stayed 100 wide and the terminal
wrapped them; on a terminal of no size rich re-wrapped lines at 80 mid-phrase and cut the bar's step count).
The launcher runs on a pseudo-terminal of the given size, as a user starts it."""
from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from launch_util import BASE, LAUNCH, REPO

pytestmark = pytest.mark.timeout(600)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _on_pty(args: list[str], cols: int, timeout: float = 240.0) -> tuple[int, list[str]]:
    """``launch/run.py ARGS`` with stdin/stdout/stderr on a new pseudo-terminal of ``cols`` columns (0: one that
    reports no size): its exit status and its output lines (carriage returns and escape sequences removed)."""
    master, slave = os.openpty()
    if cols:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NPT_FAULT")}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    p = subprocess.Popen([sys.executable, LAUNCH, *args], stdin=slave, stdout=slave, stderr=slave, cwd=REPO,
                         env=env, start_new_session=True)
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout  # a hang guard, not a timing
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not data:
                break
            out += data
        rc = p.wait(30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(30)
        os.close(master)
    text = ANSI.sub("", out.decode(errors="replace"))
    return rc, [ln.split("\r")[-1] for ln in text.replace("\r\n", "\n").split("\n")]


def _is_prose(line: str) -> bool:
    """A line of folded prose (not a table row: no run of two spaces after its indent)."""
    return "  " not in line.strip()


def _check_folded_once(lines: list[str], width: int) -> None:
    """Every line at most ``width`` columns; each folded prose line was full: the next line's first word (a
    continuation, indented two spaces) would not have fit on it, so nothing was folded at one width and then
    again at a narrower one. No line ends with an ellipsis (a cut cell)."""
    assert all(len(ln) <= width for ln in lines), [(len(ln), ln) for ln in lines if len(ln) > width]
    assert not [ln for ln in lines if ln.rstrip().endswith("…")], lines
    for a, b in zip(lines, lines[1:]):
        if re.match(r"^ {2,4}\S", b) and _is_prose(a) and _is_prose(b) and a.strip():
            words = b.split()
            first = " ".join(words[:2]) if re.search(r"\d", words[0]) else words[0]  # a number keeps its unit
            assert len(a) + 1 + len(first) > width, (f"folded short at {width}", a, b)


@pytest.mark.parametrize("cols,width", [(80, 80), (100, 100), (120, 100), (0, 100)])
def test_plan_is_folded_once_at_the_consoles_width(tiny_model, tmp_path, cols, width):
    run_dir = str(tmp_path / "run")
    rc, lines = _on_pty([f"model.path={tiny_model}", *BASE, "plan=true", f"hydra.run.dir={run_dir}"], cols)
    text = "\n".join(lines)
    assert rc == 0, text[-4000:]
    assert any(ln.startswith("predicted: step ") for ln in lines), text
    assert any(ln.startswith("card ") for ln in lines), text  # the tables
    _check_folded_once(lines, width)
    # the tables: each row whole on a line (split into blocks of columns when narrower), never folded at words
    for ln in lines:
        if ln.startswith(("cpu:", "total ")):
            assert re.match(r"^(cpu:\d+|total)\s+\S+", ln), ln
    rows = [ln for ln in lines if ln.startswith("cpu:0 ")]
    assert rows and all(re.search(r"\d$", r) for r in rows), rows  # each row ends with a figure


@pytest.mark.parametrize("progress", ["plain", "rich"])
def test_a_step_line_fits_an_80_column_terminal(tiny_model, tmp_path, progress):
    """The step line's fields are fitted to the console's width (80 here), not to 100 and then folded at words
    by the launcher's stdout fold (or wrapped by the terminal); under the live bar (``rich``, a terminal's
    default) too, where a fresh-clone review saw the short step line fitted to 100 columns, and the bar itself
    on one line of at most 80 columns."""
    run_dir = str(tmp_path / "run")
    rc, lines = _on_pty([f"model.path={tiny_model}", *BASE, "train.steps=1", "data.eval_batches=0",
                         f"runtime.progress={progress}", f"hydra.run.dir={run_dir}"], 80)
    text = "\n".join(lines)
    assert rc == 0, text[-4000:]
    # a long path: a line of its own, or with its label ("  checkpoint: <path>"), run past the width, never folded
    wide = [(len(ln), ln) for ln in lines if len(ln) > 80 and len(ln.split()) > 1
            and not re.match(r"^ *[A-Za-z][\w-]*: \S+$", ln)]
    assert not wide, wide
    k = next(i for i, ln in enumerate(lines) if re.match(r"step 1/1 \| loss ", ln))
    step = [lines[k]] + [ln for ln in lines[k + 1:k + 4] if ln.startswith("  ")]
    # folded between its fields: each line a run of " | "-joined fields, none cut inside (a field's words stay
    # together: the step time with its plan, the memory with its unit)
    assert re.search(r"\d+(\.\d+)? (ms|s) \(plan [\d.]+\)$", lines[k]) or "(plan" not in text, step
    assert any(ln.lstrip().startswith("mem GiB ") or " | mem GiB " in ln for ln in step), step
    # the done: summary: each label on a line with its path (a review saw "checkpoint" end a folded line, its path
    # on the next)
    assert any(re.match(r"^done: 1 step, loss \S+ -> \S+, wall \d+:\d\d:\d\d$", ln) for ln in lines), text[-2000:]
    assert any(re.match(r"^  checkpoint: /\S+/checkpoints/step_000001$", ln) for ln in lines), text[-2000:]
    assert any(re.match(r"^  metrics: /\S+/metrics\.jsonl$", ln) for ln in lines), text[-2000:]
