"""One live job per run directory / checkpoint root (issue 28): the second lock is refused naming the owner,
a dead owner's lock is taken over, a released lock leaves no file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npu_train.runtime.dirlock import DirInUseError, JobLocks, lock_dir, lock_path


def test_second_lock_refused_naming_owner_and_released_lock_leaves_nothing(tmp_path):
    a = lock_dir(str(tmp_path), "run", "hydra.run.dir", "use another hydra.run.dir")
    a.set_job("abc123")
    with pytest.raises(DirInUseError) as ei:  # a second open file description: flock refuses it
        lock_dir(str(tmp_path), "run", "hydra.run.dir", "use another hydra.run.dir")
    msg = str(ei.value)
    assert f"hydra.run.dir={tmp_path} is in use by job abc123 (pid {os.getpid()} on host" in msg, msg
    assert f"kill {os.getpid()}" in msg and "use another hydra.run.dir" in msg
    with open(lock_path(str(tmp_path), "run")) as f:
        rec = json.load(f)
    assert rec["pid"] == os.getpid() and rec["job_id"] == "abc123" and rec["host"] and rec["start"] > 0
    assert "command" in rec
    a.release()
    assert os.listdir(tmp_path) == []
    b = lock_dir(str(tmp_path), "run", "hydra.run.dir", "x")  # free again
    assert b.took_over is None
    b.release()


def test_lock_of_a_killed_owner_is_taken_over(tmp_path, capsys):
    """A launcher killed with SIGKILL leaves the file; the kernel dropped its flock, so the next launch takes it."""
    code = ("import sys, time; sys.path.insert(0, %r); from npu_train.runtime.dirlock import lock_dir; "
            "lk = lock_dir(%r, 'run', 'hydra.run.dir', 'x'); lk.set_job('dead01'); print('locked', flush=True); "
            "time.sleep(600)") % (os.path.join(os.path.dirname(__file__), "..", "..", "src"), str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(DirInUseError, match=f"job dead01 \\(pid {p.pid} "):
            lock_dir(str(tmp_path), "run", "hydra.run.dir", "x")
    finally:
        p.kill()
        p.wait()
    assert os.path.exists(lock_path(str(tmp_path), "run"))
    locks = JobLocks()
    locks.run_dir(str(tmp_path), 0)
    out = capsys.readouterr().out
    assert f"took over {lock_path(str(tmp_path), 'run')} of job dead01 (pid {p.pid}" in out, out
    assert "no longer running" in out
    locks.release()
    assert not os.path.exists(lock_path(str(tmp_path), "run"))


def test_without_flock_a_live_owner_refuses_and_a_dead_one_is_taken_over(tmp_path, monkeypatch):
    """On a filesystem without flock (ENOLCK) the owner record decides: pid alive on this host or not."""
    import errno

    from npu_train.ownership import process_identity
    from npu_train.runtime import dirlock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dirlock.fcntl, "flock", no_flock)
    path = lock_path(str(tmp_path), "checkpoint")
    parent = process_identity(os.getppid())  # alive, not us
    with open(path, "w") as f:
        json.dump(dict(parent, job_id="live01"), f)
    with pytest.raises(DirInUseError, match="checkpoint.dir=.* is in use by job live01"):
        lock_dir(str(tmp_path), "checkpoint", "checkpoint.dir", "x")
    with open(path, "w") as f:  # same pid, another start time: that process is gone
        json.dump(dict(parent, start=parent["start"] - 1000, job_id="old01"), f)
    lk = lock_dir(str(tmp_path), "checkpoint", "checkpoint.dir", "x")
    assert lk.took_over["job_id"] == "old01"
    lk.release()
    assert os.listdir(tmp_path) == []


def test_nodes_of_one_job_lock_their_own_names(tmp_path):
    """Multi-node: node k > 0 takes run-n<k>, so nodes sharing one run directory do not refuse each other."""
    n0, n1 = JobLocks(), JobLocks()
    n0.run_dir(str(tmp_path), 0)
    n1.run_dir(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path)) == [".npt-run-n1.lock", ".npt-run.lock"]
    n0.checkpoint_root(str(tmp_path))
    n0.checkpoint_root(str(tmp_path))  # the same launch again: already held
    n1.release()
    n0.release()
    assert os.listdir(tmp_path) == []
