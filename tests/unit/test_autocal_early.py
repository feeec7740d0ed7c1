"""The first-run calibration's processes started early (``planner.autocal.start_early`` +
``planner.loadgen.BackgroundLoad``): the launcher starts them before it reads the model and the
calibration reuses them; they are stopped or killed on every path (used, unused, a failed
measurement, a launcher that dies); the process baseline is measured in the first load process
with the same figure as in a process of its own, and its failure leaves the load running.

Quick sizes; nothing is timed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from npu_train.planner import autocal, make_cards
from npu_train.planner.autocal import auto_calibrate, ensure_profile, measure_for_job, start_early
from npu_train.planner.baseline import measure_process_baseline
from npu_train.planner.loadgen import BackgroundLoad
from npu_train.planner.threads import usable_cores

from scripts import pids_gone

TINY = {"dtype": "fp32", "layer": (8, 16, 2, 1, 1, 4), "head": (10, 8, 4), "adamw_params": 64}
#: modules of a small process baseline (torch, ZeroMQ and gloo are always part of it)
MODS = ("npu_train.backends",)
two_cores = pytest.mark.skipif(usable_cores() < 2, reason="a 2-process job needs 2 usable cores")


@pytest.fixture(autouse=True)
def _auto(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CALIBRATE", raising=False)  # tests/conftest.py sets never
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))


def _cards(n=2):
    return make_cards("cpu", n, capacity_bytes=8 * 2**30)


def _early(**kw):
    return start_early(_cards(), "auto", threads=1, dtype="fp32", quick=True, **kw)


@two_cores
def test_the_calibration_reuses_the_early_helpers_and_they_are_gone_after():
    early = _early()
    assert isinstance(early, BackgroundLoad) and early.n == 1 and len(early.pids) == 1
    assert psutil.pid_exists(early.pids[0])  # started before anything is measured
    res = auto_calibrate(_cards(), "auto", threads=1, dtype="fp32", quick=True, early=early)
    assert res[0]["calibrated"]
    doc = json.loads(open(res[0]["path"]).read())
    assert doc["details"]["auto"]["load_pids"] == early.pids  # the same process, not a new one
    assert doc["details"]["auto"]["load_steps"][0]["layer"] > 0
    assert pids_gone(early.pids)
    # the profile fits now: nothing starts early on the next launch
    assert _early() is None


def test_nothing_starts_early_when_nothing_will_be_measured():
    assert start_early(_cards(), "never", threads=1, dtype="fp32", quick=True) is None
    assert start_early(make_cards("cuda", 2, capacity_bytes=2**30), "auto", threads=1, dtype="fp32") is None
    # one card process and a quick profile: no helper and no baseline to start
    assert start_early(_cards(1), "auto", threads=1, dtype="fp32", quick=True) is None


@two_cores
def test_early_helpers_are_stopped_when_the_measurement_fails(monkeypatch):
    def boom(*a, on_phase=None, **k):
        on_phase("layer")
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(autocal, "measure_at", boom)
    early = _early()
    with pytest.raises(RuntimeError, match="measurement failed"):
        auto_calibrate(_cards(), "auto", threads=1, dtype="fp32", quick=True, early=early)
    assert early.pids and pids_gone(early.pids) and early.procs == []


@two_cores
def test_unused_early_helpers_are_killed(tmp_path):
    path = tmp_path / "cache" / "calibration" / "cpu.json"
    early = _early()
    # another launcher measured meanwhile: the profile fits, nothing is measured here
    ensure_profile("cpu", None, threads=1, dtype="fp32", mode="auto", quick=True, path=path,
                   log=lambda s: None, concurrent=2)
    res = auto_calibrate(_cards(), "auto", threads=1, dtype="fp32", quick=True, early=early)
    assert not res[0]["calibrated"] and pids_gone(early.pids)


def test_helpers_that_do_not_fit_the_measurement_are_replaced():
    early = BackgroundLoad(1, threads=1)
    early.spawn()
    _, _, det = measure_for_job("cpu", None, 1, "fp32", quick=True, concurrent=1, load=early)
    assert det["load_pids"] == [] and pids_gone(early.pids)  # a one-process job: no helper


def test_helpers_of_a_launcher_that_dies_exit_by_themselves(tmp_path):
    code = ("import json, time; from npu_train.planner.loadgen import BackgroundLoad\n"
            "b = BackgroundLoad(2, threads=1); b.spawn(); print(json.dumps(b.pids), flush=True); time.sleep(600)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    pids = json.loads(launcher.stdout.readline())
    launcher.kill()  # kill -9: no clean-up runs in the launcher
    launcher.wait()
    procs = [psutil.Process(p) for p in pids if psutil.pid_exists(p)]
    _, alive = psutil.wait_procs(procs, timeout=120)  # end-of-file on stdin after their imports
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:
        p.kill()
    assert alive == []


def test_an_early_close_kills_helpers_still_importing():
    load = BackgroundLoad(2, threads=1, baseline=(None, MODS))
    load.spawn()
    load.close()  # e.g. the launcher rejected the job while reading the model
    assert pids_gone(load.pids) and load.steps == [None, None]
    assert load.returncodes == [-signal.SIGKILL] * 2  # killed at once, not waited for


def test_the_first_helper_measures_the_process_baseline_as_its_own_process_does():
    with BackgroundLoad(1, threads=1, baseline=(None, MODS)) as load:
        load.spawn()
        load.start(**TINY)
        in_load = load.baseline_bytes()
        load.phase("head")
        time.sleep(0.2)
    assert pids_gone(load.pids) and sum(load.steps[0].values()) > 0
    alone = measure_process_baseline(None, 1, modules=MODS)
    # the same interpreter doing the same imports and set-up before the RSS is read: the same
    # figure up to allocator noise (a few hundred KB of ~400 MB)
    assert in_load == pytest.approx(alone, rel=0.01)


def test_a_failed_baseline_leaves_the_load_running():
    with BackgroundLoad(1, threads=1, baseline=(None, ("npu_train.no_such_module",))) as load:
        load.start(**TINY)
        assert all(p.poll() is None for p in load.procs)  # ready, running the work
        with pytest.raises(RuntimeError, match="no_such_module"):
            load.baseline_bytes()
    assert pids_gone(load.pids)


def test_without_helpers_the_baseline_runs_in_its_own_process():
    load = BackgroundLoad(0, threads=1, baseline=(None, MODS))
    load.spawn()
    assert load.pids == [] and load.baseline_pid and psutil.pid_exists(load.baseline_pid)
    with load:
        load.start(**TINY, baseline_first=True)  # no core left: done before the figures
        assert load.baseline_bytes() > 50 * 2**20
    # closed before it finished: killed and reaped
    load2 = BackgroundLoad(0, threads=1, baseline=(None, MODS))
    load2.spawn()
    load2.close()
    assert pids_gone([load2.baseline_pid])
    with pytest.raises(ValueError, match="commas"):
        BackgroundLoad(0, threads=1, baseline=(None, ("a,b",)))


def test_cpu_snapshot_counts_running_children():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() < t + 60: pass"])
    try:
        while psutil.Process(child.pid).cpu_times().user < 0.2:
            time.sleep(0.05)
        ct = psutil.Process(child.pid).cpu_times()
        own = os.times()
        _, _, counted = autocal.cpu_snapshot()
        # this process's and its reaped children's CPU, plus at least what the running child used
        assert counted >= own.user + own.system + own.children_user + own.children_system + ct.user + ct.system
    finally:
        child.kill()
        child.wait()
