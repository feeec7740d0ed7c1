"""``checkpoint.save=false`` end to end (the tiny model, two card processes): the job trains, writes no
checkpoint (not at the end, not on SIGTERM), says once at launch that it cannot be resumed, and neither
its ``done:`` line, its interrupt message nor ``status.json`` offers a resume command."""
from __future__ import annotations

import json
import os
import signal

from conftest import launch_to_end
from launch_util import Job

from npu_train.runtime.saving import NO_SAVE_NOTE


def _status(job) -> dict:
    with open(os.path.join(job.run_dir, "status.json")) as f:
        return json.load(f)


def test_finished_job_writes_no_checkpoint(tiny_model, tmp_path):
    job = launch_to_end(tmp_path, tiny_model, "train.steps=2", "checkpoint.save=false")
    assert not os.path.exists(os.path.join(job.run_dir, "checkpoints")), os.listdir(job.run_dir)
    assert len(job.losses()) == 2
    assert job.flat_stdout.count(" ".join(NO_SAVE_NOTE.split())) == 1, job.tail()  # folded at 100 columns
    assert "first save will fail" not in job.stdout
    done = [l for l in job.stdout.splitlines() if l.startswith("done:")]
    assert len(done) == 1 and "no checkpoint (checkpoint.save=false)" in job.stdout_line("done:"), job.tail()
    assert "train.resume" not in job.stdout + job.stderr
    status = _status(job)
    assert status["status"] == "ok" and status["exit_code"] == 0 and not status.get("resume"), status


def test_interrupted_job_saves_nothing_and_offers_no_resume(tiny_model, tmp_path):
    """SIGTERM with train.save_on_interrupt=true (the default): checkpoint.save=false wins, the job stops
    at once (exit 143) without a checkpoint and says why there is nothing to resume."""
    job = Job(tmp_path, tiny_model, "train.steps=5000", "checkpoint.save=false")
    try:
        job.job_info()
        job.wait_steps(2)
        os.kill(job.proc.pid, signal.SIGTERM)
        rc = job.wait(60)
    finally:
        job.kill_all()
    assert rc == 128 + signal.SIGTERM, job.tail()
    flat = job.flat_stderr  # the interrupt line is folded at words to 100 columns
    assert "interrupted by SIGTERM" in flat and "checkpoint.save=false: this run cannot be resumed" in flat
    wide = [ln for ln in job.stderr.splitlines() if len(ln) > 100 and " " in ln.strip()]
    assert not wide, wide
    assert "train.resume" not in job.stderr and "saving a checkpoint" not in job.stderr, job.tail()
    assert "Traceback" not in job.stderr
    assert not os.path.exists(os.path.join(job.run_dir, "checkpoints"))
    status = _status(job)
    assert status["status"] == "interrupted" and status["checkpoint"] is None and status["resume"] is None, status
