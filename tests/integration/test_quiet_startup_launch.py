"""The coordinator tells the reporter each card's phase while it waits for the cards, so a silent start-up
gets ``still: ...`` lines (``Reporter.STARTUP_QUIET_S`` 0 here: at every loop turn until the first step line;
the unit tests of the wording and the interval are in tests/unit/test_quiet_startup.py)."""
from __future__ import annotations

from conftest import run_pipeline

from npu_train.metrics.report import Reporter


def test_a_job_says_what_its_cards_do_before_the_first_step(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(Reporter, "STARTUP_QUIET_S", 0.0)
    run_pipeline(tiny_model, str(tmp_path), "train.steps=1", "checkpoint.save=false")
    out = capsys.readouterr().out.splitlines()
    first_step = next(i for i, l in enumerate(out) if l.startswith("step 1/1"))
    still = [i for i, l in enumerate(out) if l.startswith("still: cpu:0 ")]
    assert still and still[0] < first_step, out[:40]
    assert all(i < first_step for i in still)  # none after the first step line
    assert any(", cpu:1 " in out[i] for i in still), [out[i] for i in still][:5]
