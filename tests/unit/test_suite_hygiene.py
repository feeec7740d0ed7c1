"""The test suite's own output (issue 40, a fresh-clone review): a deselected module is not listed as skipped,
a session that used W&B ends without a traceback and leaves no process behind, and a process a test does
leave behind is named with the test that started it. Each check runs pytest in a subprocess."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _pytest(*args: str, cwd: str = ROOT, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), WANDB_MODE="offline", WANDB_SILENT="true")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_the_fast_step_does_not_list_the_deselected_contract_module():
    """``-m "not heavy and not contract"`` (scripts/test.sh's fast step) listed tests/contract as ``SKIPPED``:
    its module-level ``pytest.skip`` ran at collection, before the marker deselected it."""
    r = _pytest("-m", "not heavy and not contract", "tests/contract")
    assert r.returncode == 5, r.stdout + r.stderr  # 5: no test selected
    assert "skipped" not in (r.stdout + r.stderr).lower(), r.stdout + r.stderr


def test_a_session_with_wandb_ends_clean():
    """A session that opened a W&B run in-process ended with wandb's exit-hook traceback (``ConnectionResetError:
    Connection lost``): the end-of-session sweep had stopped wandb's service as a process the tests left running."""
    r = _pytest("tests/unit/test_trackers.py", "-k", "test_the_output_says_where_the_tracker_runs_went")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "Connection lost" not in out and "Traceback" not in out, out
    assert "left running" not in out, out


def test_a_process_left_running_is_named_with_its_test(tmp_path):
    """The sweep names each leftover's test and command line (it printed bare process ids)."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leaves_one.py").write_text(
        "import subprocess, sys\n\n\n"
        "def test_starts_a_sleeper():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)  # the leftover'])\n")
    r = _pytest("test_leaves_one.py", cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "stopping 1 process(es) the tests left running:" in out, out
    (line,) = [l for l in out.splitlines() if "the leftover" in l]
    assert "(test_leaves_one.py::test_starts_a_sleeper): " in line and "time.sleep(120)" in line, line


def test_the_sessions_own_resource_tracker_is_not_a_leftover(tmp_path):
    """A spawned card process starts ``multiprocessing``'s resource tracker as a child of pytest; it exits with
    pytest, so the sweep leaves it be (it was reported as a process the tests left running and stopped)."""
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_spawns.py").write_text(
        "import multiprocessing, time\n\n\n"
        "def test_spawns_a_process():\n"
        "    p = multiprocessing.get_context('spawn').Process(target=time.sleep, args=(0,))\n"
        "    p.start()\n"
        "    p.join()\n"
        "    assert p.exitcode == 0\n")
    r = _pytest("test_spawns.py", cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "passed" in out, out
    assert "left running" not in out, out


def _test_script(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``bash scripts/test.sh ARGS`` without its setup run, on this interpreter's venv."""
    env = dict(os.environ, NPT_SETUP="0", NPT_VENV=os.path.dirname(os.path.dirname(sys.executable)))
    return subprocess.run(["bash", "scripts/test.sh", *args, "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def _two_tests(tmp_path) -> str:
    (tmp_path / "test_two.py").write_text("def test_passes():\n    pass\n\n\ndef test_fails():\n    assert False\n")
    return str(tmp_path / "test_two.py")


def test_a_phase_that_selects_nothing_does_not_stop_the_script(tmp_path):
    """``bash scripts/test.sh -k "doc_links or refusal_width"`` passed its fast phase, then stopped with exit 5
    (``set -e``) because the heavy phase selected nothing: a phase with no test goes on, and nothing failed is
    exit 0."""
    r = _test_script(tmp_path, _two_tests(tmp_path), "-k", "passes")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "== heavy tests" in out and "== furiosa-torch contract tests" in out, out


def test_a_failure_or_a_usage_error_stops_the_script_with_its_code(tmp_path):
    """A failed test (pytest exit 1) or a usage error (4) stops the script at that phase with that code."""
    path = _two_tests(tmp_path)
    r = _test_script(tmp_path, path)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "1 failed, 1 passed" in out and "== heavy tests" not in out, out
    r = _test_script(tmp_path, path, "--no-such-option")
    out = r.stdout + r.stderr
    assert r.returncode == 4 and "== heavy tests" not in out, out


def test_no_test_selected_in_any_phase_is_exit_5(tmp_path):
    """A ``-k`` that matches nothing anywhere (a typo) is not a pass: each phase goes on, the script exits 5."""
    r = _test_script(tmp_path, _two_tests(tmp_path), "-k", "no_such_test_name")
    out = r.stdout + r.stderr
    assert r.returncode == 5 and "== furiosa-torch contract tests" in out, out
    assert "no phase selected a test" in out, out


def test_ci_runs_exactly_the_readmes_test_command():
    """``.ci/run`` runs the command the README gives for the whole suite (and nothing else)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    after = readme.split("what `.ci/run` runs", 1)[1]
    command = after.split("```bash\n", 1)[1].split("\n```", 1)[0].strip()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        lines = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
    assert lines[-1] == command == "bash scripts/test.sh", (lines, command)
    assert all(l.startswith(("set ", "cd ")) for l in lines[:-1]), lines
