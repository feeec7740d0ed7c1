"""Reliability round 4 (issue 41): faults a new user and a cluster produce, each run as the user would, through
``launch/run.py`` as a subprocess (:mod:`launch_util`), on the tiny test model."""
from __future__ import annotations

import json
import os
import shlex

import pytest

from launch_util import Job

pytestmark = pytest.mark.timeout(300)


def _status(job: Job) -> dict:
    with open(os.path.join(job.run_dir, "status.json")) as f:
        return json.load(f)


def test_resume_command_runs_as_printed_from_a_dir_with_a_space_and_an_apostrophe(tiny_model, tmp_path):
    """Fault 20: the run dir ``.../Bob's run/out``; the ``resume`` command of ``status.json`` (shell- and
    Hydra-quoted) runs as printed and continues the run (it failed in Hydra's parser:
    ``LexerNoViableAltException``)."""
    name = "Bob's run"
    first = Job(tmp_path, tiny_model, "train.steps=2", "train.stop_after=1", name=name)
    try:
        assert first.wait(240) == 0, first.tail()
    finally:
        first.kill_all()
    resume = _status(first)["resume"]
    assert resume and f"{name}/out/checkpoints" in shlex.split(resume)[-1], resume
    again = Job(tmp_path, tiny_model, name=name, argv=shlex.split(resume))
    try:
        rc = again.wait(240)
    finally:
        again.kill_all()
    assert rc == 0, again.tail()
    assert "resuming from" in again.stdout and "step_000001" in again.stdout, again.tail()
    assert _status(again)["status"] == "ok"
