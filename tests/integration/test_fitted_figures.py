"""A finished run refits the figures the next plan uses (``planner.fit``): before it the rates are
assumed, after one finished tiny run the next ``plan=true`` says ``[fitted from 1 run]``; the
removed ``placement.calibrate`` key is one error line naming ``calibrate=true``."""
from __future__ import annotations

import os

from conftest import launch_to_end


def _rates_line(job) -> str:
    return next(ln for ln in job.stdout.splitlines() if ln.startswith("rates cpu"))


def test_the_next_plan_uses_figures_fitted_from_a_finished_run(tiny_model, tmp_path):
    before = _rates_line(launch_to_end(tmp_path, tiny_model, "plan=true", name="before"))
    assert "compute 50 GFLOP/s [assumed]" in before and "fitted" not in before
    run = launch_to_end(tmp_path, tiny_model, "train.steps=3", "checkpoint.save=false", name="run")
    assert os.path.isfile(os.path.join(os.environ["NPT_CACHE"], "fitted", "cpu-1t-fp32.json")), run.tail()
    after = _rates_line(launch_to_end(tmp_path, tiny_model, "plan=true", name="after"))
    assert "[fitted from 1 run]" in after.split("compute ", 1)[1].split(",", 1)[0], after
    assert "host AdamW" in after and "fitted = from this job's finished runs" in after


def test_placement_calibrate_is_gone_with_a_pointer_to_calibrate_true(tiny_model, tmp_path):
    job = launch_to_end(tmp_path, tiny_model, "plan=true", "placement.calibrate=auto", name="old", expect_rc=2)
    err = [ln for ln in job.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "calibrate=true" in err[0], job.stderr
