"""What a plan advises names only what would change it (issue 40, a fresh-clone review): the ``bound:`` line
never names the setting the plan already has (an 8-card Qwen3-30B-A3B LoRA plan chose zb-h2 and advised
``train.schedule=zb-h2``)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan
from npu_train.planner.table import bound_line

GIB = 2 ** 30
M = replace(get_preset("llama-3.2-1b"), num_layers=4)


def _plan(schedule: str, offload: str = "serial", recompute: bool = False):
    shape = RunShape(seq_len=256, micro_batch=1, micro_batches=4, schedule=schedule, dtype="bf16",
                     offload=offload, recompute=recompute)
    return make_plan(PlanRequest(M, shape, make_cards("cpu", 2, 64 * GIB), load_rates("cpu"), split=[2, 2]))


def _dominated_by(plan, key: str):
    """``plan`` with every card's step made of ``key`` (0.6 s) and compute (0.3 s): the term the line names."""
    for st in plan.stages:
        st.time = {k: 0.0 for k in st.time} | {"compute": 0.3, key: 0.6, "total": 0.9}
    plan.step_time_s = 0.9
    return plan


@pytest.mark.parametrize("schedule, advised", [("1f1b", True), ("zb-h1", True), ("zb-h2", False), ("zbv", False)])
def test_the_bubble_advice_never_names_the_schedule_already_chosen(schedule, advised):
    line = bound_line(_dominated_by(_plan(schedule), "bubble"))
    assert line.startswith("bound: the pipeline bubble 0.6 of 0.9 s"), line
    assert ("train.schedule=zb-h2" in line) == advised, line
    assert "more micro-batches (train.accum)" in line and "fewer pipeline stages" in line, line


@pytest.mark.parametrize("offload", ["serial", "delayed"])
def test_the_host_advice_never_names_a_delayed_update_already_chosen(offload):
    line = bound_line(_dominated_by(_plan("1f1b", offload=offload), "host_optimizer"))
    assert line.startswith("bound: host AdamW of offloaded layers 0.6 of 0.9 s"), line
    assert ("train.offload_update=delayed" in line) == (offload != "delayed"), line


def test_recompute_false_is_advised_only_where_a_card_recomputes():
    off = _dominated_by(_plan("1f1b"), "compute")
    assert "train.recompute=false" not in bound_line(off), bound_line(off)
    on = _dominated_by(_plan("1f1b", recompute=True), "compute")
    on.stages[0].time["recompute"] = 0.1
    assert "train.recompute=false where set" in bound_line(on), bound_line(on)
