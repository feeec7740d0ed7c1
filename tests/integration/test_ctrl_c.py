"""Ctrl-C stops ``bash scripts/test.sh`` (issue 40, fresh-clone review: after a SIGINT to the foreground process
group pytest kept launching jobs; only SIGTERM stopped it). A test that runs the launcher in-process
(``run_pipeline``) gets the SIGINT in the launcher's own handlers: the job stops (exit 130) and that test fails;
``tests/conftest.py`` then stops the session, and the script stops instead of going on to its next phase."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROBE = "NPT_CTRL_C_PROBE"


@pytest.mark.parametrize("n", [1, 2])
def test_probe_a_long_in_process_job(tiny_model, n):
    """Run only by :func:`test_ctrl_c_stops_the_test_script` (``NPT_CTRL_C_PROBE``: where to write): a long
    tiny job in this process, the kind of test that swallowed the SIGINT."""
    from conftest import run_pipeline

    probe = os.environ.get(PROBE)
    if not probe:
        pytest.skip("a probe for test_ctrl_c_stops_the_test_script")
    open(os.path.join(probe, f"started-{n}"), "w").close()
    run_pipeline(tiny_model, os.path.join(probe, f"run{n}"), "train.steps=2000", "data.eval_batches=0")


def _job(run_dir: str):
    try:
        with open(os.path.join(run_dir, "job.json")) as f:
            info = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return info if f.read().count("\n") >= 1 else None
    except (OSError, ValueError):
        return None


def _group(pgid: int) -> list:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def _cmdline(p) -> str:
    """``p``'s command line ("" while it exits, "(gone)" once it has)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return "(gone)"


def _gone(pgid: int, within_s: float) -> None:
    """Wait until no live process of group ``pgid`` is left, or ``within_s`` seconds have passed."""
    deadline = time.monotonic() + within_s
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_ctrl_c_stops_the_test_script(tmp_path):
    """``bash scripts/test.sh`` (no setup run, this interpreter's venv) on the two probe tests, a SIGINT to its
    process group while the first one's job trains: the script exits 130, the second probe never starts, nor
    does the heavy phase, and no process of the group or shared-memory segment of the job is left."""
    probe = tmp_path / "probe"
    probe.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NPT_FAULT"}
    env.update({PROBE: str(probe), "NPT_SETUP": "0", "NPT_VENV": os.path.dirname(os.path.dirname(sys.executable))})
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:
        p = subprocess.Popen(["bash", "scripts/test.sh", "tests/integration/test_ctrl_c.py", "-k", "probe",
                              "-p", "no:cacheprovider"], cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        deadline = time.monotonic() + 400
        info = None
        while info is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            info = _job(str(probe / "run1"))
        assert info is not None, (p.poll(), out_path.read_text()[-3000:], os.listdir(probe))
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C
        rc = p.wait(240)  # a hang guard, not a timing
        text = out_path.read_text()
        assert rc == 130, text[-3000:]
        assert sorted(os.listdir(probe)) == ["run1", "started-1"], (os.listdir(probe), text[-3000:])
        assert "== heavy tests" not in text and "interrupted by SIGINT (Ctrl-C)" in text, text[-3000:]
        # Right after the script, a process may still be on its way out: pytest's multiprocessing resource
        # tracker (started by the first spawned card process; it exits once pytest's pipe to it closes), or one
        # already exiting (its memory released: an empty command line). Nothing else may be there, and within
        # 30 s nothing at all.
        left = [(q.pid, _cmdline(q)) for q in _group(p.pid)]
        assert all(c in ("", "(gone)") or "multiprocessing.resource_tracker" in c for _, c in left), left
        _gone(p.pid, 30)  # a hang guard, not a timing
        assert not _group(p.pid), [(q.pid, _cmdline(q)) for q in _group(p.pid)]
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"npt_{info['job_id']}_")]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)
        for q in _group(p.pid):
            q.kill()
        from npu_train.runtime.leftovers import sweep_dead_jobs

        sweep_dead_jobs()  # a failed run's segments (its launcher killed)
