"""The automatic calibration under the job's concurrency (``planner.autocal`` +
``planner.loadgen``): the profile records how many processes ran at once, a profile of another
concurrency is measured again, the helper processes are gone afterwards, profiles written before
the field still load, and the plan's rate line names the concurrency.

Quick mode (tiny sizes); nothing is timed."""
from __future__ import annotations

import json

import psutil
import pytest
from scripts import pids_gone

from npu_train.planner import load_rates, make_cards, make_plan
from npu_train.planner.autocal import ensure_profile, job_concurrency, measure_for_job, profile_status
from npu_train.planner.loadgen import BackgroundLoad
from npu_train.planner.spec import RunShape

from test_calibrate import tiny


@pytest.fixture(autouse=True)
def _auto(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CALIBRATE", raising=False)  # tests/conftest.py sets never
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))


def _quick(path, concurrent=1, threads=1):
    lines = []
    res = ensure_profile("cpu", None, threads=threads, dtype="fp32", mode="auto", quick=True,
                         path=path, log=lines.append, concurrent=concurrent)
    return res, lines


def _is_helper(proc) -> bool:
    try:
        return any("npu_train.planner.loadgen" in a for a in proc.cmdline())
    except psutil.Error:
        return False


def test_job_concurrency_counts_cpu_cards_capped_by_cores():
    cards = make_cards("cpu", 3, capacity_bytes=2**30)
    assert job_concurrency(cards, threads=1, cores=8) == 3
    assert job_concurrency(cards, threads=2, cores=4) == 2  # 4 cores // 2 threads
    assert job_concurrency(cards, threads=4, cores=2) == 1
    assert job_concurrency(make_cards("cuda", 2, capacity_bytes=2**30), threads=1, cores=8) == 1


def test_helpers_run_during_the_measurement_and_are_gone_afterwards():
    entry, _, det = measure_for_job("cpu", None, 1, "fp32", quick=True, concurrent=2)
    assert entry["concurrent"] == 2 and det["concurrent"] == 2
    assert len(det["load_pids"]) == 1 and pids_gone(det["load_pids"])
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in det["load_pids"]]
    steps = det["load_steps"][0]  # the helper followed the measured figures' kinds of work
    assert steps["layer"] > 0 and steps["adamw"] > 0
    # alone: no helper
    entry1, _, det1 = measure_for_job("cpu", None, 1, "fp32", quick=True)
    assert entry1["concurrent"] == 1 and det1["load_pids"] == [] and det1["load_steps"] == []


def test_helpers_are_stopped_when_the_measurement_fails(monkeypatch):
    from npu_train.planner import autocal

    pids = []

    def boom(*a, on_phase=None, **k):
        on_phase("layer")
        pids.extend(p.pid for p in psutil.Process().children() if _is_helper(p))
        raise RuntimeError("measurement failed")

    monkeypatch.setattr(autocal, "measure_at", boom)
    with pytest.raises(RuntimeError, match="measurement failed"):
        measure_for_job("cpu", None, 1, "fp32", quick=True, concurrent=3)
    assert len(pids) == 2 and pids_gone(pids)


def test_a_helper_that_cannot_start_fails_loudly_and_leaves_nothing():
    load = BackgroundLoad(1, threads=1)
    with pytest.raises(RuntimeError, match="not ready"):
        load.start(dtype="fp64", layer=(8, 16, 2, 1, 1, 4), head=(10, 8, 4), adamw_params=8, timeout=60)
    assert load.procs == [] and pids_gone(load.pids)


def test_a_profile_of_another_concurrency_is_measured_again_and_merged(tmp_path):
    path = tmp_path / "cpu.json"
    res, lines = _quick(path, concurrent=1)
    doc = json.loads(path.read_text())
    assert doc["rates"]["concurrent"] == 1 and res["calibrated"]
    assert profile_status(path, "cpu", 1, "fp32", quick=True, concurrent=1) == ("ok", "cached")
    status, why = profile_status(path, "cpu", 1, "fp32", quick=True, concurrent=2)
    assert status == "partial" and why == ("figures at 1 thread(s) measured with 1 process(es) at once, "
                                           "the job runs 2")
    res, lines = _quick(path, concurrent=2)
    assert res["calibrated"] and len(lines) == 1
    assert lines[0].startswith(f"calibrating cpu ({why}, 2 processes at once, ~")
    doc = json.loads(path.read_text())
    assert doc["rates"]["concurrent"] == 2 and doc["details"]["auto"]["concurrent"] == 2
    assert profile_status(path, "cpu", 1, "fp32", quick=True, concurrent=2) == ("ok", "cached")
    assert load_rates("cpu", path, threads=1).concurrent == 2
    # another thread count is merged beside it with its own concurrency
    _quick(path, concurrent=1, threads=2)
    rates = load_rates("cpu", path)
    assert rates.threads == 2 and rates.concurrent == 1 and rates.by_threads[1]["concurrent"] == 2
    assert rates.concurrent_at(1) == 2 and rates.concurrent_at(2) == 1
    assert load_rates("cpu", path, threads=1).concurrent == 2
    assert profile_status(path, "cpu", 1, "fp32", quick=True, concurrent=2)[0] == "ok"
    assert profile_status(path, "cpu", 2, "fp32", quick=True, concurrent=2)[0] == "partial"


def test_a_profile_without_the_field_loads_as_measured_alone(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path, concurrent=2)
    doc = json.loads(path.read_text())
    del doc["rates"]["concurrent"]
    doc["rates"]["by_threads"] = {"2": {"device_flops": 7e9}}  # an older entry, no field either
    path.write_text(json.dumps(doc))
    rates = load_rates("cpu", path)
    assert rates.concurrent == 1 and rates.concurrent_at(2) == 1
    assert load_rates("cpu", path, threads=1).source("device_flops") == "measured"
    assert profile_status(path, "cpu", 1, "fp32", quick=True) == ("ok", "cached")
    assert profile_status(path, "cpu", 1, "fp32", quick=True, concurrent=2)[0] == "partial"


def test_the_plan_says_how_many_processes_ran_at_once(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path, concurrent=2)
    model, shape = tiny(), RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    rates = load_rates("cpu", path, threads=1)
    assert rates.source("device_flops") == "measured, 2 processes at once"
    line = [ln for ln in make_plan(model, shape, cards, [rates] * 2, threads=1).table().splitlines()
            if ln.startswith("rates cpu")][0]
    assert line.count("[measured, 2 processes at once]") == 6
    assert "process baseline 0.35 GiB [assumed (profile)]" in line
