"""Metrics files stay strict JSON with non-finite values (issue 12): no bare NaN / Infinity."""
from __future__ import annotations

import io
import json
import os
import math

import pytest


def _rep(step, loss, gnorm, skipped=False):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": gnorm, "tokens": 64, "time_s": 1.0,
            "compute_s": 0.5, "wait_s": 0.1, "send_s": 0.0, "optimizer_s": 0.2, "host_optimizer_s": 0.0,
            "transfer_s": 0.0, "mem_peak": 1, "mem_now": 1, "skipped": skipped}


def _strict(text):
    def bad(c):
        raise ValueError(f"non-JSON constant {c}")
    return json.loads(text, parse_constant=bad)


def test_nonfinite_values_are_written_as_null(tmp_path):
    from npu_train.metrics.report import Reporter

    out = io.StringIO()
    r = Reporter(str(tmp_path), 3, stream=out, tensorboard=False)
    r.step([_rep(1, 5.0, 1.0), _rep(1, 5.0, 1.0)])
    r.step([_rep(2, float("nan"), float("inf"), True), _rep(2, float("nan"), float("inf"), True)])
    r.step([_rep(3, 4.0, 1.0), _rep(3, 4.0, 1.0)])
    r.eval(3, float("nan"), 128)
    summ = r.finish({"note": float("-inf")})
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [_strict(l) for l in f]
    assert recs[1]["loss"] is None and recs[1]["grad_norm"] is None and recs[1]["skipped"] is True
    assert "skipped" not in recs[0]
    with open(tmp_path / "eval.jsonl") as f:
        ev = _strict(f.read())
    assert ev["val_loss"] is None and ev["val_ppl"] is None
    with open(tmp_path / "summary.json") as f:
        s = _strict(f.read())
    assert s["skipped_steps"] == 1 and s["first_loss"] == 5.0 and s["last_loss"] == 4.0 and s["note"] is None
    assert summ["skipped_steps"] == 1
    steps = out.getvalue().split("\nstep ")  # each step folded over lines of at most 100 columns
    assert "SKIPPED" in steps[1] and "SKIPPED" not in steps[0] + steps[2]
    with pytest.raises(ValueError):  # the strict parser really rejects what json.dumps writes by default
        _strict(json.dumps({"x": math.nan}))


def test_idle_split_into_bubble_and_collectives(tmp_path):
    """metrics.jsonl carries the slowest card's bubble_s (waits inside the schedule) and
    collective_s (end-of-step collectives) next to idle_s; reports without them (older cards)
    leave the fields out."""
    from npu_train.metrics.report import Reporter

    r = Reporter(str(tmp_path), 2, stream=io.StringIO(), tensorboard=False)
    fast = dict(_rep(1, 5.0, 1.0), time_s=1.0, bubble_s=0.05, collective_s=0.3, compute_s=0.9)
    slow = dict(_rep(1, 5.0, 1.0), time_s=1.5, bubble_s=0.2, collective_s=0.1)
    r.step([fast, slow])
    r.step([_rep(2, 4.0, 1.0), _rep(2, 4.0, 1.0)])
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [_strict(l) for l in f]
    assert recs[0]["bubble_s"] == 0.2 and recs[0]["collective_s"] == 0.1  # the slowest card's
    assert recs[0]["idle_s"] == pytest.approx(1.5 - 0.5 - 0.2 - 0.0 - 0.0)
    # over all cards (the bubble-rate definition): 1 - (busy_fast + busy_slow) / (2 * wall)
    busy = [r["compute_s"] + r["optimizer_s"] + r["transfer_s"] + r["send_s"] for r in (fast, slow)]
    assert recs[0]["idle_share"] == pytest.approx(1.0 - sum(busy) / (2 * 1.5)) == pytest.approx(0.4)
    assert "bubble_s" not in recs[1] and "collective_s" not in recs[1] and "idle_s" in recs[1]
    # every card's own figures, by rank (the stage imbalance), and the tied all-reduce's time
    assert recs[0]["bubble_s_cards"] == [0.05, 0.2] and recs[0]["collective_s_cards"] == [0.3, 0.1]
    assert recs[0]["compute_s_cards"] == [fast["compute_s"], slow["compute_s"]]
    assert "bubble_s_cards" not in recs[1] and "tied_s" not in recs[0]
    r.step([dict(_rep(3, 4.0, 1.0), tied_s=0.4), dict(_rep(3, 4.0, 1.0), time_s=2.0, tied_s=0.25)])
    with open(tmp_path / "metrics.jsonl") as f:
        last = _strict(f.readlines()[-1])
    assert last["tied_s"] == 0.25 and last["tied_s_cards"] == [0.4, 0.25]  # the slowest card's, and each card's


def test_carry_over_continues_the_records_of_a_resumed_run(tmp_path):
    """A resume into the same run dir: the earlier launch's lines up to the checkpoint's step come back
    into the new metrics.jsonl / eval.jsonl (later steps were not kept; a torn last line is dropped)."""
    from npu_train.metrics.report import carry_over, rotate_previous_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - s}) + "\n" for s in (1, 2, 3))
                                       + '{"step": 4, "lo')
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "val_loss": 4.1}) + "\n"
                                    + json.dumps({"step": 3, "val_loss": 3.5}) + "\n")
    prev = rotate_previous_run(str(run))
    assert not (run / "metrics.jsonl").exists()
    assert carry_over(prev, str(run), 2) == 2
    assert [json.loads(l)["step"] for l in open(run / "metrics.jsonl")] == [1, 2]
    assert [json.loads(l)["step"] for l in open(run / "eval.jsonl")] == [0]
    assert len(open(os.path.join(prev, "metrics.jsonl")).read().splitlines()) == 4  # the originals stay


def test_smoothed_loss_continues_after_a_resume(tmp_path):
    """The step line's average (a bias-corrected EMA) continues over the carried-over records of a
    resumed launch: the same values as one uninterrupted launch."""
    from npu_train.metrics.report import Reporter

    losses = [5.0, 4.0, 4.5, 3.0, 3.5]
    whole = tmp_path / "whole"
    whole.mkdir()
    r = Reporter(str(whole), 5, stream=io.StringIO(), tensorboard=False)
    for i, l in enumerate(losses, 1):
        r.step([_rep(i, l, 1.0)])
    r.jsonl.close()
    ref = [_strict(l)["loss_smoothed"] for l in open(whole / "metrics.jsonl")]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    # what carry_over leaves: the first three steps' records (one of them skipped: loss null)
    (resumed / "metrics.jsonl").write_text("".join(open(whole / "metrics.jsonl").readlines()[:3])
                                           + json.dumps({"step": 0, "loss": None}) + "\n")
    r2 = Reporter(str(resumed), 5, stream=io.StringIO(), tensorboard=False)
    for i, l in list(enumerate(losses, 1))[3:]:
        r2.step([_rep(i, l, 1.0)])
    r2.jsonl.close()
    got = [_strict(l).get("loss_smoothed") for l in open(resumed / "metrics.jsonl")][4:]
    assert got == pytest.approx(ref[3:], rel=1e-12)
