"""The launcher's automatic first-run calibration (``placement.calibrate``): the job preparation
(``runtime.job.prepare``, what ``launch/run.py`` runs before any card process starts) measures
the cpu kind on the first launch, caches it, and the next launch plans from the cache.
Quick sizes (``NPT_CALIBRATE_QUICK=1``); nothing is timed."""
from __future__ import annotations

import json

import pytest
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
    assert all(r.source("device_flops") == "measured" + at_once for r in prep["plan"].rates)
    assert f"calibration profile {auto_env}" in prep["plan"].table()
    before = auto_env.stat().st_mtime_ns
    prep2 = prepare(cfg, str(tmp_path / "run2"))
    assert "calibrating" not in capsys.readouterr().out and auto_env.stat().st_mtime_ns == before
    assert prep2["plan"].rates[0].device_flops == pytest.approx(prep["plan"].rates[0].device_flops)
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
        assert prep["plan"].rates[0].source("device_flops") == "assumed"
        assert "no calibration profile: assumed defaults" in prep["plan"].table()
    prepare(make_cfg(tiny_model), str(tmp_path / "run"), probe=False)  # a sweep's pre-check
    assert "calibrating" not in capsys.readouterr().out and not auto_env.exists()
    with pytest.raises(ConfigError, match="placement.calibrate='sometimes'"):
        prepare(make_cfg(tiny_model, "placement.calibrate=sometimes"), str(tmp_path / "run"))
