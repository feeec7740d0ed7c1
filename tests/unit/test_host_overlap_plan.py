"""The placement model's host-optimizer overlap (:func:`npu_train.planner.cost.exposed_host_time`).

Expected figures are worked out by hand from the schedule of the update: layer k of o offloaded
layers is ready at (k+1) h, the next forward needs it at A + (r+k) f. Mutation check (run, seen
failing: 5 tests): dropping the last layer's term ``o h - A - (r + o - 1) f`` from the formula.
"""
from __future__ import annotations

import dataclasses

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, make_plan, plan_table
from npu_train.planner.cost import exposed_host_time


def _by_simulation(host_s, o, r, f, a):
    """Walk the forward layer by layer: it waits at each offloaded layer until that layer is uploaded."""
    h, t, delay = host_s / o, a + r * f, 0.0
    for k in range(o):
        ready = (k + 1) * h
        if ready > t:
            delay += ready - t
            t = ready
        t += f
    return delay


@pytest.mark.parametrize("host_s,o,r,f,a", [(8.0, 4, 0, 1.0, 0.0), (8.0, 4, 2, 1.0, 0.0), (8.0, 4, 0, 3.0, 0.0),
                                            (8.0, 4, 1, 0.5, 1.5), (1.0, 4, 0, 1.0, 5.0), (6.0, 1, 0, 2.0, 1.0)])
def test_overlap_formula_matches_a_layer_walk(host_s, o, r, f, a):
    got = exposed_host_time("overlap", host_s, offloaded_layers=o, resident_layers=r, fwd_layer_s=f,
                            first_input_s=a, idle_s=0.0, cpu_card=False)
    assert got == pytest.approx(_by_simulation(host_s, o, r, f, a), abs=1e-12)


def test_modes_by_hand():
    kw = dict(offloaded_layers=4, resident_layers=0, fwd_layer_s=1.0, first_input_s=0.0, idle_s=5.0)
    # 4 layers x 2 s, forward 1 s per layer: layer 3 is ready at 8, needed at 3 -> waits 5
    assert exposed_host_time("overlap", 8.0, cpu_card=False, **kw) == pytest.approx(5.0)
    # host faster than the forward: only the first layer's 2 s are exposed
    assert exposed_host_time("overlap", 8.0, cpu_card=False, **dict(kw, fwd_layer_s=3.0)) == pytest.approx(2.0)
    assert exposed_host_time("serial", 8.0, cpu_card=False, **kw) == 8.0
    assert exposed_host_time("delayed", 8.0, cpu_card=False, **kw) == pytest.approx(3.0)  # 8 - 5 idle
    assert exposed_host_time("delayed", 4.0, cpu_card=False, **kw) == 0.0
    # cpu card: the forward uses the same cores, only the wait for the first input hides host work
    assert exposed_host_time("overlap", 8.0, cpu_card=True, **dict(kw, first_input_s=3.0)) == pytest.approx(5.0)


def test_plan_hides_host_time_and_shows_it():
    """8B on 2 RNGD cards, offload only: overlap takes the hidden part off the stage total, delayed hides
    at least as much, serial none; the table has the column."""
    shape = RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16")
    cards = make_cards("furiosa", 2)
    plans = {m: make_plan(PlanRequest(get_preset("llama-3.1-8b"), dataclasses.replace(shape, offload=m), cards,
                                      DEFAULT_RATES["furiosa"], resident_layers=0)) for m in ("serial", "overlap", "delayed")}
    for i in range(2):
        ser, ov, de = (plans[m].stages[i].time for m in ("serial", "overlap", "delayed"))
        assert ser["host_hidden"] == 0.0
        assert 0.0 < ov["host_hidden"] <= de["host_hidden"]
        assert ov["total"] == pytest.approx(ser["total"] - ov["host_hidden"])
        assert de["total"] == pytest.approx(ser["total"] - de["host_hidden"])
    assert plans["delayed"].step_time_s < plans["serial"].step_time_s
    assert "hidden" in plan_table(plans["overlap"], width=250)


def test_plan_says_what_the_host_update_does():
    """The plan explains the 'hidden s' column (host AdamW + upload) and says when
    train.offload_update=delayed changes nothing (every layer resident)."""
    from npu_train.planner.table import format_plan

    shape = RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16")
    cards = make_cards("furiosa", 2)
    mk = lambda mode, res: format_plan(make_plan(PlanRequest(get_preset("llama-3.1-8b"), dataclasses.replace(shape, offload=mode),  # noqa: E731
                                                             cards, DEFAULT_RATES["furiosa"], resident_layers=res)))
    off = mk("delayed", 0)
    assert "one step stale (train.offload_update=delayed)" in off and "upload included" in off
    assert "overlaps the next forward" in mk("overlap", 0)
    tiny = dataclasses.replace(shape, seq_len=64)
    all_res = format_plan(make_plan(PlanRequest(get_preset("llama-3.1-8b"), dataclasses.replace(tiny, offload="delayed"),
                                                make_cards("furiosa", 8), DEFAULT_RATES["furiosa"], resident_layers=4)))
    assert "train.offload_update=delayed has no effect: every layer is resident" in all_res
    assert "has no effect" not in mk("delayed", 0)


def test_plan_labels_oversubscribed_cpu_cores():
    """3 cpu card processes on 2 cores: the plan says its rates are stretched; 2 on 2 cores: no line."""
    from npu_train.planner.table import format_plan

    shape = RunShape(seq_len=64, micro_batch=1, micro_batches=4, dtype="fp32")
    text = {n: format_plan(make_plan(PlanRequest(get_preset("smollm2-135m"), shape, make_cards("cpu", n), DEFAULT_RATES["cpu"],
                                                 threads=1, host_cores=2, host_ram_bytes=None))) for n in (2, 3)}
    assert "oversubscribed: 3 cpu card process(es) x 1 thread(s) on 2 core(s)" in text[3] and "at 2/3 of" in text[3]
    assert "oversubscribed" not in text[2]
