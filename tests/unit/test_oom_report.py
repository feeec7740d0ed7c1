"""A card process killed by SIGKILL is reported as an OOM kill when cgroup memory.events' oom_kill rose."""
import signal
from types import SimpleNamespace

from npu_train.runtime import oom
from npu_train.runtime.coordinator import Coordinator, RankState
from npu_train.runtime.oom import OomWatch


def _events(path, n):
    path.write_text(f"low 0\nhigh 0\nmax 3\noom {n}\noom_kill {n}\n")


def _coordinator(watch):
    c = object.__new__(Coordinator)
    c.oom, c.hb_timeout, c.startup_timeout = watch, 60.0, 60.0
    return c


def _rank(pid=4242):
    rs = RankState.__new__(RankState)
    rs.done, rs.error, rs.heard, rs.proc = False, None, True, SimpleNamespace(pid=pid)
    return rs


def test_sigkill_with_oom_kill_counter_rise_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(oom, "dmesg_names", lambda pid: False)
    ev = tmp_path / "memory.events"
    _events(ev, 2)
    c = _coordinator(OomWatch(str(ev)))
    _events(ev, 3)
    cause = c._death(_rank(), -signal.SIGKILL, 0.0)
    assert "killed by the OOM killer" in cause and "oom_kill 2 -> 3" in cause


def test_plain_sigkill_stays_a_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(oom, "dmesg_names", lambda pid: False)
    ev = tmp_path / "memory.events"
    _events(ev, 2)
    c = _coordinator(OomWatch(str(ev)))
    assert c._death(_rank(), -signal.SIGKILL, 0.0) == "process killed by signal SIGKILL"


def test_dmesg_naming_the_pid_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(oom.subprocess, "run", lambda *a, **k: SimpleNamespace(
        stdout="[1.0] Out of memory: Killed process 4242 (python) total-vm:1kB\n"))
    c = _coordinator(OomWatch(str(tmp_path / "missing")))
    assert "dmesg names process 4242" in c._death(_rank(4242), -signal.SIGKILL, 0.0)
    assert c._death(_rank(4243), -signal.SIGKILL, 0.0) == "process killed by signal SIGKILL"
