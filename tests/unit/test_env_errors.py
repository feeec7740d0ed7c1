"""One env prefix (NPT_), one cache root, one user-error base with its exit codes."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from npu_train import env
from npu_train.errors import ConfigError, Interrupted, JobFailed, UserError, exit_code_for


def test_cache_root_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CACHE", raising=False)
    monkeypatch.delenv("NPU_TRAIN_CACHE", raising=False)
    assert env.cache_root() == Path.home() / ".cache" / "npu-train"
    monkeypatch.setenv("NPT_CACHE", str(tmp_path))
    assert env.cache_dir("data") == tmp_path / "data"


def test_old_prefix_still_read_with_deprecation(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CACHE", raising=False)
    monkeypatch.setenv("NPU_TRAIN_CACHE", str(tmp_path))
    with pytest.warns(DeprecationWarning, match="NPT_CACHE"):
        assert env.cache_root() == tmp_path
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "new"))  # the new name wins
    assert env.cache_root() == tmp_path / "new"


def test_no_source_reads_the_old_prefix_or_home_cache_directly():
    src = Path(__file__).resolve().parents[2] / "src" / "npu_train"
    bad = []
    for p in src.rglob("*.py"):
        if p.name == "env.py":
            continue
        text = p.read_text()
        if 'environ.get("NPU_TRAIN' in text or "'.cache', 'npu-train'" in text or '".cache", "npu-train"' in text:
            bad.append(str(p.relative_to(src)))
    assert not bad, f"use npu_train.env.getenv / cache_dir in {bad}"


def test_exit_codes():
    assert exit_code_for(ConfigError("x")) == 2
    assert exit_code_for(FileNotFoundError("x")) == 2
    assert exit_code_for(JobFailed("x")) == 1
    assert exit_code_for(Interrupted(signal.SIGINT)) == 130
    assert exit_code_for(Interrupted(signal.SIGTERM)) == 143
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)
    with pytest.raises(TypeError):
        exit_code_for(RuntimeError("a bug is not a job outcome"))


def test_interrupt_while_preparing_says_no_card_process_had_started():
    """A signal while the launch prepares (the handler :func:`launch_signals` installs) is an Interrupted marked
    ``preparing``, whose line says no card process had started; the coordinator's, after the cards started, says
    they were all stopped."""
    from npu_train.runtime.job import launch_signals

    with pytest.raises(Interrupted) as got:
        with launch_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    e = got.value
    assert e.preparing and exit_code_for(e) == 143
    assert e.headline() == "interrupted by SIGTERM while preparing: no card process had started"
    assert Interrupted(signal.SIGINT).headline() == "interrupted by SIGINT: all card processes stopped"


def test_a_signal_before_run_job_is_held_and_stops_it_on_entry():
    """A SIGTERM while ``run_job``'s module imports (seconds of torch import, after launch/run.py's run_one took
    the signals) was only noted and the job then trained to the end with exit 0: it is now held and
    ``launch_signals`` raises it on entry (preparing); once the outcome is decided a signal is only noted."""
    from scripts import LAUNCH_RUN, load_script

    from npu_train.errors import PENDING_SIGNALS
    from npu_train.runtime.job import launch_signals

    run = load_script(LAUNCH_RUN, "_npt_run_signals")
    held = run._hold_signals()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs as os.kill returns: held, not raised
        assert PENDING_SIGNALS == [signal.SIGTERM]
        with pytest.raises(Interrupted) as got:
            with launch_signals():
                pass
        assert got.value.preparing and exit_code_for(got.value) == 143 and PENDING_SIGNALS == []
        run._SIGNALS_HELD_FOR_JOB[0] = False  # main has the outcome: only noted now
        os.kill(os.getpid(), signal.SIGTERM)
        assert PENDING_SIGNALS == []
    finally:
        run._release_signals(held)
        PENDING_SIGNALS.clear()


def test_unwritable_cache_is_one_error_naming_npt_cache(monkeypatch, tmp_path):
    """NPT_CACHE under a file, or (as root) on a read-only mount: CacheDirError naming NPT_CACHE and the fix."""
    import subprocess

    blocker = tmp_path / "f"
    blocker.write_text("")
    monkeypatch.setenv("NPT_CACHE", str(blocker / "cache"))
    with pytest.raises(env.CacheDirError) as ei:
        env.writable_cache_dir()
    msg = str(ei.value)
    assert f"NPT_CACHE={blocker / 'cache'}" in msg and "set NPT_CACHE to a writable directory" in msg, msg
    assert isinstance(ei.value, UserError) and exit_code_for(ei.value) == 2
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "ok"))
    assert env.writable_cache_dir("data") == tmp_path / "ok" / "data" and os.listdir(tmp_path / "ok" / "data") == []
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(ro)], capture_output=True).returncode:
        return  # not root: the through-a-file case above stands for it
    try:
        monkeypatch.setenv("NPT_CACHE", str(ro))
        with pytest.raises(env.CacheDirError, match=r"\[Errno 30\] Read-only file system; NPT_CACHE="):
            env.writable_cache_dir()
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)
