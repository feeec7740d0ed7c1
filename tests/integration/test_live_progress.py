"""The live progress display in a real terminal (tmux): while the job starts the bar shows its phase and
``k/N``, the step lines above it are the short form, the terminal is left clean (the bar is transient), and
``run.log`` keeps the whole plain lines with no terminal control codes. Without a terminal (every other
test) the output is the plain lines."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from launch_util import BASE, LAUNCH, REPO

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=30).stdout


def test_live_progress_in_a_terminal(tiny_model, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    run_dir = tmp_path / "run"
    session = f"npt-live-{os.getpid()}"
    cmd = " ".join([sys.executable, LAUNCH, f"model.path={tiny_model}", "backend=cpu,cpu", *BASE, "train.steps=6",
                    f"hydra.run.dir={run_dir}"]) + f"; echo EXIT=$? > {tmp_path}/rc; sleep 120"
    _tmux("new-session", "-d", "-s", session, "-x", "150", "-y", "50", f"cd {REPO} && {cmd}")
    seen_bars = []
    try:
        t_end = time.monotonic() + 240
        while time.monotonic() < t_end and not (tmp_path / "rc").exists():
            pane = _tmux("capture-pane", "-p", "-t", session)
            seen_bars += [l for l in pane.splitlines() if "━" in l and "/6" in l]
            time.sleep(0.2)
        pane = _tmux("capture-pane", "-p", "-S", "-200", "-t", session)
    finally:
        _tmux("kill-session", "-t", session)
    assert (tmp_path / "rc").read_text().strip() == "EXIT=0", pane[-3000:]
    assert seen_bars, pane[-3000:]
    phases = " ".join(seen_bars)
    assert "card 0:" in phases or "starting the card processes" in phases or "data:" in phases, seen_bars
    steps = [l for l in pane.splitlines() if re.match(r"step +\d+/", l)]  # not the time table's "step" row
    assert [l.split(" |")[0] for l in steps] == [f"step {k}/6" for k in range(1, 7)], pane[-3000:]
    assert all("[fwd/bwd" not in l and "| lr " not in l for l in steps)  # the short form on the terminal
    assert not [l for l in pane.splitlines() if "━" in l]  # transient: no bar left behind
    log = (run_dir / "run.log").read_text()
    assert "\x1b" not in log
    assert sum(1 for l in log.splitlines() if re.match(r"step +\d+/6 \| loss ", l)) == 6
    assert sum(1 for l in log.splitlines() if l.startswith("  [fwd/bwd") and "| ETA" in l) == 6
