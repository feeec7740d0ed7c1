"""The launcher's automatic first-run calibration (``placement.calibrate``): the job preparation
(``runtime.job.prepare``, what ``launch/run.py`` runs before any card process starts) measures
the cpu kind on the first launch, caches it, and the next launch plans from the cache.
Quick sizes (``NPT_CALIBRATE_QUICK=1``); nothing is timed."""
from __future__ import annotations

import json

import pytest
from scripts import pids_gone
from conftest import make_cfg

from npu_train.errors import ConfigError
from npu_train.planner.threads import usable_cores
from npu_train.runtime.job import prepare


@pytest.fixture
def auto_env(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CALIBRATE", raising=False)  # tests/conftest.py sets never
    monkeypatch.setenv("NPT_CALIBRATE_QUICK", "1")
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "calibration" / "cpu.json"


def test_first_launch_calibrates_and_the_second_reuses(tiny_model, tmp_path, auto_env, capsys):
    cfg = make_cfg(tiny_model, "backend=[cpu,cpu]")
    prep = prepare(cfg, str(tmp_path / "run1"))
    out = capsys.readouterr().out
    conc = min(2, usable_cores())  # the job's 2 cpu card processes at once, 1 thread each
    at_once = ", 2 processes at once" if conc == 2 else ""
    assert f"calibrating cpu (first run on this machine{at_once}, ~12 s; cached in {auto_env})" in out
    doc = json.loads(auto_env.read_text())
    assert doc["rates"]["threads"] == 1  # the job's thread count (runtime.threads=1)
    assert doc["details"]["auto"]["threads"] == 1 and doc["details"]["auto"]["dtype"] == "fp32"
    assert doc["rates"]["concurrent"] == conc and doc["details"]["auto"]["concurrent"] == conc
    assert all(r.source("device_flops") == "measured" + at_once for r in prep.plan.rates)
    assert f"calibration profile {auto_env}" in prep.plan.table()
    before = auto_env.stat().st_mtime_ns
    prep2 = prepare(cfg, str(tmp_path / "run2"))
    assert "calibrating" not in capsys.readouterr().out and auto_env.stat().st_mtime_ns == before
    assert prep2.plan.rates[0].device_flops == pytest.approx(prep.plan.rates[0].device_flops)
    # a one-card job on the same machine runs alone: the 2-process figures do not fit it
    if conc == 2:
        prepare(make_cfg(tiny_model, "backend=[cpu]"), str(tmp_path / "run3"))
        assert "measured with 2 process(es) at once, the job runs 1" in capsys.readouterr().out
        assert json.loads(auto_env.read_text())["rates"]["concurrent"] == 1


def test_no_calibration_for_never_a_chosen_profile_or_a_dry_run(tiny_model, tmp_path, auto_env, capsys):
    for extra in (["placement.calibrate=never"], [f"placement.profile={tmp_path / 'mine.json'}"],
                  ["plan=true"]):
        prep = prepare(make_cfg(tiny_model, *extra), str(tmp_path / "run"))
        assert "calibrating" not in capsys.readouterr().out and not auto_env.exists()
        assert prep.plan.rates[0].source("device_flops") == "assumed"
        assert "no calibration profile: assumed defaults" in prep.plan.table()
    prepare(make_cfg(tiny_model), str(tmp_path / "run"), probe=False)  # a sweep's pre-check
    assert "calibrating" not in capsys.readouterr().out and not auto_env.exists()
    with pytest.raises(ConfigError, match="placement.calibrate='sometimes'"):
        prepare(make_cfg(tiny_model, "placement.calibrate=sometimes"), str(tmp_path / "run"))


def _spy_early(monkeypatch):
    """Record what ``start_early`` returns when ``prepare`` calls it."""
    from npu_train.planner import autocal

    started, real = [], autocal.start_early

    def spy(*a, **k):
        started.append(real(*a, **k))
        return started[-1]

    monkeypatch.setattr(autocal, "start_early", spy)
    return started


@pytest.mark.skipif(usable_cores() < 2, reason="a 2-process job needs 2 usable cores")
def test_the_launch_starts_the_helpers_before_reading_the_model_and_reuses_them(tiny_model, tmp_path, auto_env,
                                                                                 monkeypatch):
    from npu_train.model import weights

    started = _spy_early(monkeypatch)
    seen = []
    real_load = weights.load_config

    def load_config(path):  # the helper is already running while the model is read
        seen.extend(started)
        return real_load(path)

    monkeypatch.setattr("npu_train.model.load_config", load_config)
    prepare(make_cfg(tiny_model, "backend=[cpu,cpu]"), str(tmp_path / "run1"))
    assert len(seen) == 1 and seen[0] is started[0] and len(started[0].pids) == 1
    auto = json.loads(auto_env.read_text())["details"]["auto"]
    assert auto["load_pids"] == started[0].pids and pids_gone(started[0].pids)


@pytest.mark.skipif(usable_cores() < 2, reason="a 2-process job needs 2 usable cores")
def test_a_job_rejected_after_the_early_start_leaves_no_helper(tiny_model, tmp_path, auto_env, monkeypatch):
    started = _spy_early(monkeypatch)
    with pytest.raises(ConfigError, match="data.seq_len=100000 exceeds"):
        prepare(make_cfg(tiny_model, "backend=[cpu,cpu]", "data.seq_len=100000"), str(tmp_path / "run"))
    assert len(started) == 1 and started[0].pids and pids_gone(started[0].pids)
    assert not auto_env.exists()
