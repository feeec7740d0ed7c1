"""Two launches into one run directory or checkpoint root (issue 28): while the first job runs, the second
is refused (one error line naming the job and its pid, exit 2) and the first job's files stay as they were;
once the first launcher is gone (kill -9), its lock is taken over."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from launch_util import BASE, LAUNCH, REPO, Job
from npu_train.errors import error_lines

pytestmark = pytest.mark.timeout(300)


def _launch(model: str, run_dir: str, *overrides: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, LAUNCH, f"model.path={model}", "backend=cpu,cpu", *BASE, "train.steps=2", *overrides,
            f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "NPT_FAULT"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=200)


def test_second_launch_into_a_live_jobs_dirs_is_refused(tiny_model, tmp_path):
    ck = str(tmp_path / "ckpt")
    a = Job(tmp_path, tiny_model, "train.steps=5000", f"checkpoint.dir={ck}")
    try:
        info = a.job_info()
        a.wait_steps(1)
        before = sorted(os.listdir(a.run_dir))
        lines_before = len(a.losses())
        # B: the same hydra.run.dir
        b = _launch(tiny_model, a.run_dir)
        errs = error_lines(b.stderr)
        assert b.returncode == 2 and len(errs) == 1 and "Traceback" not in b.stderr, b.stderr
        assert (f"hydra.run.dir={a.run_dir} is in use by job {info['job_id']} (pid {a.proc.pid} " in errs[0]
                and f"kill {a.proc.pid}" in errs[0] and "another hydra.run.dir" in errs[0]), errs[0]
        # C: its own run dir, A's checkpoint.dir
        c_dir = str(tmp_path / "c")
        c = _launch(tiny_model, c_dir, f"checkpoint.dir={ck}")
        errs = error_lines(c.stderr)
        assert c.returncode == 2 and len(errs) == 1, c.stderr
        assert (f"checkpoint.dir={ck} is in use by job {info['job_id']} (pid {a.proc.pid} " in errs[0]
                and "another checkpoint.dir" in errs[0]), errs[0]
        assert not os.path.exists(os.path.join(c_dir, ".npt-run.lock"))  # C released its own run-dir lock
        # A untouched: nothing moved to previous-<k>, no status.json of B, A still stepping
        after = sorted(os.listdir(a.run_dir))
        assert not any(f.startswith("previous-") for f in after) and "status.json" not in after, after
        assert set(before) <= set(after), (before, after)
        a.wait_steps(lines_before + 1)
        with open(os.path.join(a.run_dir, ".npt-run.lock")) as f:
            assert json.load(f)["job_id"] == info["job_id"]
    finally:
        a.kill_all()  # SIGKILL: the lock files stay, their flocks go with the process
    assert os.path.exists(os.path.join(a.run_dir, ".npt-run.lock"))
    d = _launch(tiny_model, a.run_dir, f"checkpoint.dir={ck}")
    assert d.returncode == 0, d.stderr[-3000:]
    flat = " ".join(d.stdout.split())  # the launcher folds stdout lines at 100 columns
    assert f"took over {os.path.join(a.run_dir, '.npt-run.lock')} of job {info['job_id']} (pid {a.proc.pid}" in flat
    assert not os.path.exists(os.path.join(a.run_dir, ".npt-run.lock"))
    assert not os.path.exists(os.path.join(ck, ".npt-checkpoint.lock"))
