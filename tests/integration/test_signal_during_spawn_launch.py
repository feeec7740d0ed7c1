"""A Ctrl-C that reaches the launcher while it starts the card processes stops the job (the launcher set SIGINT to
SIG_IGN around each ``Process.start()``, and a SIGINT then was lost: the job went on). A real launch
(``spawn_signal_launcher.py``) sends SIGINT to itself from inside the first card's ``start()``: it exits 130 with
the interrupt line of a Ctrl-C during start-up, the second card never starts, and neither the started card
process nor a shared-memory segment of the job is left."""
from __future__ import annotations

import json
import os
import signal
import sys

from launch_util import BASE, Job, job_segments, pid_gone

WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spawn_signal_launcher.py")


def test_sigint_while_a_card_process_starts_stops_the_job(tiny_model, tmp_path):
    log = tmp_path / "spawned.jsonl"
    job = Job(tmp_path, tiny_model, argv=[sys.executable, WRAPPER, f"model.path={tiny_model}", "backend=cpu,cpu",
                                          *BASE, "train.steps=4"], env={"NPT_TEST_SPAWN_LOG": str(log)})
    try:
        rc = job.wait(180)
    finally:
        job.kill_all()
    assert rc == 128 + signal.SIGINT, job.tail()
    cards = [json.loads(ln) for ln in log.read_text().splitlines()]
    assert len(cards) == 1, cards  # stopped before the second card process was started
    assert "interrupted by SIGINT: all card processes stopped" in job.flat_stderr, job.tail()
    assert pid_gone(cards[0]["pid"]), "the started card process was left running"
    assert job_segments(cards[0]["job_id"]) == [], "shared-memory segments left in /dev/shm"
    with open(os.path.join(job.run_dir, "status.json")) as f:
        status = json.load(f)
    assert status["status"] == "interrupted" and status["exit_code"] == 130, status
