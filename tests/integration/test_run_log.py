"""``<run dir>/run.log`` holds the launcher's console output (plan table, step and eval lines, notes,
the ``error:`` line), one file per job, also for each job of a ``-m`` sweep; the console shows every
line once. The launcher runs as a subprocess (as a user starts it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import launch_to_end
from launch_util import BASE, LAUNCH, REPO
from npu_train.errors import error_lines

pytestmark = pytest.mark.timeout(300)

PLAN_LINE = re.compile(r"^predicted: step .* tokens/s", re.M)


def _log(run_dir: str) -> str:
    with open(os.path.join(run_dir, "run.log")) as f:
        return f.read()


def test_run_log_holds_the_console_output(tiny_model, tmp_path):
    ok = launch_to_end(tmp_path, tiny_model, "plan=true", name="plan")
    log = _log(ok.run_dir)
    assert len(PLAN_LINE.findall(ok.stdout)) == 1, ok.stdout  # printed once on the console
    assert ok.stdout.strip() and ok.stdout in log, (ok.stdout, log)
    bad = launch_to_end(tmp_path, tiny_model, "plan=true", "train.lr=-1", name="bad", expect_rc=2)
    err = error_lines(bad.stderr)
    assert len(err) == 1 and "train.lr=-1" in err[0], bad.stderr
    assert not os.path.exists(bad.run_dir)  # a refused launch leaves no run dir (issue 40): the console had the line


@pytest.mark.heavy
def test_each_sweep_job_has_its_own_run_log(tiny_model, tmp_path):
    """``-m``: job 0 fails (bad input), job 1 prints its plan; each run.log holds its job's output only."""
    sweep_dir = os.path.join(str(tmp_path), "sweep")
    env = {k: v for k, v in os.environ.items() if k != "NPT_FAULT"}
    p = subprocess.run([sys.executable, LAUNCH, "-m", f"model.path={tiny_model}", *BASE, "plan=true",
                        "train.lr=-1,1e-3", f"hydra.sweep.dir={sweep_dir}"],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert p.returncode == 1, (p.stdout + p.stderr)[-4000:]  # a sweep with a failed job exits 1
    log0, log1 = _log(os.path.join(sweep_dir, "0")), _log(os.path.join(sweep_dir, "1"))
    assert "error: train.lr=-1" in log0 and not PLAN_LINE.search(log0), log0
    assert len(PLAN_LINE.findall(log1)) == 1 and "error:" not in log1, log1
    assert len(PLAN_LINE.findall(p.stdout)) == 1, p.stdout  # the console shows it once
    assert PLAN_LINE.search(p.stdout).group(0) in log1


def test_every_line_of_a_job_fits_100_columns(tiny_model, tmp_path):
    """A fresh-clone review found ``rates`` / ``memory`` / ``job`` lines up to 349 columns in redirected output
    (no terminal folds them): every line of a whole job (plan, rates, job line, start-up, steps, evals, saves,
    ``done:``), on the console and in ``run.log``, is at most 100 columns, folded at words (a single word
    wider than that, a long path, may stand alone on its line, or with its label: ``  checkpoint: <path>``)."""
    job = launch_to_end(tmp_path, tiny_model, "train.steps=2", name="width")
    log = _log(job.run_dir)
    for where, text in (("stdout", job.stdout), ("stderr", job.stderr), ("run.log", log)):
        wide = [ln for ln in text.splitlines() if len(ln) > 100 and " " in ln.strip()
                and not re.match(r"^ *[A-Za-z][\w-]*: \S+$", ln)]
        assert not wide, f"{where}: {wide}"
    for head in ("rates cpu:", "memory cpu:", "job ", "done: 2 steps"):
        assert any(ln.startswith(head) for ln in job.stdout.splitlines()), (head, job.stdout)


def test_the_launcher_imports_the_package_from_a_normalised_path(tmp_path):
    """A data path printed as ``.../launch/../src/npu_train/data/assets/...``: the launcher put ``launch/../src`` on
    ``sys.path``, so every path built from a module's ``__file__`` carried the ``..``. It is normalised."""
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('npt_launch', sys.argv[1]); "
            "s.loader.exec_module(importlib.util.module_from_spec(s)); import npu_train; print(npu_train.__file__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", code, LAUNCH], capture_output=True, text=True, cwd=str(tmp_path),
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    path = p.stdout.strip()
    assert path == os.path.normpath(path) and "/../" not in path and path.endswith("npu_train/__init__.py"), path
