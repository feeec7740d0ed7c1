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
    # the attention core alone recomputed (an 8-card Qwen3-30B-A3B LoRA plan): train.recompute is off already
    core = _dominated_by(_plan("1f1b"), "compute")
    core.shape = replace(core.shape, recompute_attention=True)
    core.stages[0].time["recompute"] = 0.1
    assert "train.recompute=false" not in bound_line(core), bound_line(core)


# --- train.schedule=auto when only recompute fits: one short line ------------------------------------------------

def _tiny_request(cap_gib: float):
    """The tests' tiny Llama (6 layers, hidden 64) at micro-batch 16 x 256 tokens on two cpu cards of ``cap_gib``."""
    from npu_train.model.config import LlamaConfig

    m = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                    tie_word_embeddings=True)
    shape = RunShape(seq_len=256, micro_batch=16, micro_batches=4, schedule="1f1b", dtype="fp32")
    return PlanRequest(m, shape, make_cards("cpu", 2, int(cap_gib * GIB)), load_rates("cpu"), threads=1,
                       host_cores=2)


def _recompute_choices():
    """``{counts: ScheduleChoice}`` of auto over capacities from 0.30 to 0.60 GiB where it fell back on recompute."""
    from npu_train.planner.schedule_choice import choose_schedule

    out = {}
    for c in range(30, 61, 2):
        ch = choose_schedule(_tiny_request(c / 100))
        if ch.recompute:
            out.setdefault(tuple(st.recompute_layers for st in ch.plan.stages), ch)
    return out


def test_auto_says_recompute_in_one_short_line_each_fix_once():
    """A fresh-clone review's recompute-only plan pasted every schedule's whole refusal into the auto line (109
    lines, ``fix: train.recompute=true`` 6 times) and said "the fewest layers (0/0 per card)". Now: one line, each
    refused schedule named once, each other fix once, and what recompute does when no layer is recomputed."""
    from npu_train.planner.schedule_choice import CANDIDATES

    choices = _recompute_choices()
    assert (0, 0) in choices and any(sum(k) for k in choices), sorted(choices)  # both cases at these capacities
    assert any("train.micro_batch=" in ch.why for ch in choices.values()), choices  # a figure named and planned
    for counts, ch in choices.items():
        why = ch.why
        assert "\n" not in why and len(why) < 600, why
        assert "0/0" not in why and "recompute being" not in why, why
        assert why.startswith(f"train.schedule=auto: {ch.schedule} with train.recompute=true"), why
        assert why.count("train.recompute=true") == 1, why  # not offered as a fix of what it chose
        refused = why.split("without recompute ")[1]
        head = refused.split("; to fit")[0]
        assert all(head.count(s + ",") + head.count(s + ":") == 1 for s in CANDIDATES), refused
        fixes = refused.split("to fit without it on 1f1b: ")[1].split("; ")
        assert len(fixes) == len(set(fixes)), fixes
        _each_fix_fits(counts, fixes)
        if sum(counts):
            said = " / ".join(f"{k} of {st.num_layers}" for k, st in zip(counts, ch.plan.stages))
            assert f"the fewest layers that fit recomputed ({said} per card)" in why, why
        else:
            assert "no layer is recomputed whole: under it the cpu cards return freed memory" in why, why


def _each_fix_fits(counts, fixes: list) -> None:
    """Every figure the auto line names to fit without recompute plans to fit on 1F1B without it (at the capacity
    that gave ``counts``), one more does not."""
    import re

    from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS

    cap = {c: ch for c, ch in _recompute_choices().items()}[counts].plan.stages[0].card.capacity_bytes / GIB
    base = _tiny_request(cap)

    def fits(**kw) -> bool:
        return make_plan(replace(base, strict=False, shape=replace(base.shape, **kw))).fits

    named = re.findall(r"(train\.micro_batch|data\.seq_len)=(\d+)", " ".join(fixes))
    for key, v in named:
        field = "micro_batch" if key == "train.micro_batch" else "seq_len"
        assert fits(**{field: int(v)}), (key, v)
        if field == "micro_batch":
            assert not fits(micro_batch=int(v) + 1), (key, v)
    if "runtime.keep_host_memory=false" in fixes:
        terms = [replace(DEFAULT_MEMORY_TERMS["cpu"], heap_fraction=0.0)] * 2
        assert make_plan(replace(base, strict=False, memory_terms=terms)).fits


def test_the_schedule_line_of_a_recompute_plan_recomputing_no_layer():
    from npu_train.planner.table import schedule_line

    line = schedule_line(_recompute_choices()[(0, 0)].plan)
    assert "0/0" not in line and "no layer recomputed whole (train.recompute=true" in line, line


def test_refused_schedules_are_said_once_when_one_fits():
    from npu_train.planner.schedule_choice import refusals_summary

    long = ("no placement of tiny fits with any number of resident layers on any split\ncard 0 (cpu:0) ...\n"
            "fix: train.recompute=true\nfix: a smaller train.micro_batch (now 16) or data.seq_len (now 256)")
    assert refusals_summary([("zb-h1", long), ("zb-h2", long), ("zbv", "does not fit")]) == "zb-h1, zb-h2, zbv do not fit"
    assert refusals_summary([("zb", long)], without="train.recompute=true") == (
        "zb: no placement fits with any number of resident layers on any split; to fit without it: a smaller "
        "train.micro_batch or data.seq_len")


# --- small times and the cap column: no 0.00 s for a tiny model, capacity to the others' precision ----------------

@pytest.mark.parametrize("s, text", [(0.56, "0.56 s"), (4.861, "4.86 s"), (0.1, "0.10 s"), (0.0203, "20.3 ms"),
                                     (0.00412, "4.12 ms"), (0.000412, "0.412 ms"), (0.0, "0 s")])
def test_a_duration_is_milliseconds_below_a_tenth_of_a_second(s, text):
    from npu_train.planner.spec import duration

    assert duration(s) == text


def test_a_tiny_models_plan_says_milliseconds_and_its_cap_to_two_decimals():
    """The tests' tiny Llama at 2 x 32 tokens on two 0.45 GiB cpu cards: a step of a few ms (it read 0.00 and 0.02 s
    in the time table, the MFU line and the schedule line) and a cap column that read 0.4 beside 0.43."""
    from npu_train.model.config import LlamaConfig
    from npu_train.planner import plan_table

    m = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                    tie_word_embeddings=True)
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=4, schedule="1f1b", dtype="fp32")
    p = make_plan(PlanRequest(m, shape, make_cards("cpu", 2, int(0.45 * GIB)), load_rates("cpu"), threads=1,
                              host_cores=2, strict=False))
    assert p.step_time_s < 0.1, p.step_time_s
    text = plan_table(p)
    ms = p.step_time_s * 1e3
    d = 1 if ms >= 10 else 2 if ms >= 1 else 3
    step_row = [ln for ln in text.splitlines() if ln.startswith("step ")]
    assert step_row and step_row[0].split()[-1] == f"{ms:.{d}f}", step_row
    assert any(ln.split()[-1] == "ms" for ln in text.splitlines() if ln.startswith("card ")), text
    for st in p.stages:
        row = next(ln for ln in text.splitlines() if ln.startswith(st.card.name) and ln.split()[-1] == f"{st.time['total'] * 1e3:.{d}f}")
        assert f" {st.time['compute'] * 1e3:.{d}f} " in row, row
    assert f"predicted: step {ms:.3g} ms," in text, text
    assert "pipeline phase " in text and " 0.00 s" not in text and "0.0 s" not in text, text
    mem_rows = [ln for ln in text.splitlines() if ln.startswith("cpu:")][:2]
    assert all(" 0.45 " in ln for ln in mem_rows) and " 0.4 " not in " ".join(mem_rows), mem_rows
    total = next(ln for ln in text.splitlines() if ln.startswith("total"))
    assert " 0.90 " in total, total


def test_the_predicted_mfu_line_of_a_tiny_step_says_milliseconds():
    from types import SimpleNamespace

    from npu_train.model.config import LlamaConfig
    from npu_train.runtime.flops import predicted_mfu_line

    m = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                    tie_word_embeddings=False)
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=4, schedule="1f1b", dtype="bf16")
    p = make_plan(PlanRequest(m, shape, make_cards("furiosa", 2), load_rates("furiosa"), threads=1, host_cores=2))
    assert p.step_time_s < 0.1, p.step_time_s
    line = predicted_mfu_line(SimpleNamespace(shape=shape, plan=p, model_cfg=m, dtype="bf16", threads=1, dp=1))
    assert f"per step in {p.step_time_s * 1e3:.3g} ms;" in line, line
