"""``train.schedule=auto``: the fastest schedule whose plan fits, recompute only when nothing else fits,
and the resumed checkpoint's schedule kept. The expected choice is worked out here from each schedule's own
plan (make_plan with the schedule named), not from the chooser."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan
from npu_train.pipeline.schedule import CHUNKED_SCHEDULES
from npu_train.planner.schedule_choice import ACCEL_CHUNK_MARGIN, CANDIDATES, CHUNK_MARGIN, choose_schedule, chunk_margin
from npu_train.planner.spec import PlacementError

GIB = 2 ** 30


def _req(cap_gib: float, layers: int = 8, recompute: bool = False, strict: bool = True) -> PlanRequest:
    m = replace(get_preset("llama-3.2-1b"), num_layers=layers)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=8, schedule="1f1b", dtype="bf16", recompute=recompute)
    return PlanRequest(m, shape, make_cards("furiosa", 2, int(cap_gib * GIB)), [load_rates("furiosa")] * 2,
                       resident_layers=4, host_ram_bytes=None, strict=strict)


def _plans(req):
    out = {}
    for s in CANDIDATES:
        try:
            p = make_plan(replace(req, shape=replace(req.shape, schedule=s)))
        except PlacementError:
            continue
        if p.fits:
            out[s] = p
    return out


def test_auto_takes_the_fastest_schedule_that_fits():
    req = _req(47.5)
    plans = _plans(req)
    assert len(plans) == len(CANDIDATES)  # everything fits on a big card
    # a two-chunk schedule must be the cards' margin faster than the best one-chunk schedule (furiosa cards)
    m = ACCEL_CHUNK_MARGIN
    cost = {s: plans[s].step_time_s / ((1 - m) if s in CHUNKED_SCHEDULES else 1.0) for s in plans}
    want = min(plans, key=lambda s: (cost[s], CANDIDATES.index(s)))
    got = choose_schedule(req)
    assert got.schedule == want and not got.recompute
    assert got.plan.step_time_s == pytest.approx(plans[want].step_time_s)
    assert got.why.startswith(f"train.schedule=auto: {want} (predicted step")
    assert all(s in got.why for s in CANDIDATES)


def test_auto_skips_a_schedule_that_does_not_fit():
    """A card just big enough for the schedules that hold fewer micro-batches: the ones holding more are
    out, whatever their step time."""
    full = _plans(_req(47.5))
    # memory each schedule needs on its fullest card; a capacity between the smallest and the largest need
    need = {s: max(st.mem["total"] for st in p.stages) for s, p in full.items()}
    if len(set(need.values())) < 2:
        pytest.skip("every schedule needs the same memory at this shape")
    cap = (min(need.values()) + max(need.values())) / 2 / GIB  # explicit resident counts: the full capacity
    req = _req(cap)
    fits = _plans(req)
    assert fits and set(fits) != set(CANDIDATES)
    got = choose_schedule(req)
    assert got.schedule in fits
    m = ACCEL_CHUNK_MARGIN
    cost = {s: p.step_time_s / ((1 - m) if s in CHUNKED_SCHEDULES else 1.0) for s, p in fits.items()}
    assert cost[got.schedule] == pytest.approx(min(cost.values()))


def test_two_chunk_schedules_are_candidates():
    """ZB-V and interleaved 1F1B are planned by auto (interleaved only when the micro-batches divide by the
    stages) and named in the line that says why."""
    assert "zbv" in CANDIDATES and "interleaved" in CANDIDATES
    got = choose_schedule(_req(47.5))
    assert "zbv" in got.why and "interleaved" in got.why
    odd = replace(_req(47.5), shape=replace(_req(47.5).shape, micro_batches=7))
    why = choose_schedule(odd).why
    assert "interleaved needs the micro-batches per step (M=7) to be a multiple" in why, why
    assert "interleaved schedule interleaved" not in why, why  # named once, not twice


def test_recompute_when_only_that_fits():
    req = _req(47.5)
    rec = make_plan(replace(req, shape=replace(req.shape, recompute=True)))
    need_rec = max(st.mem["total"] for st in rec.stages)
    need_min = min(max(st.mem["total"] for st in p.stages) for p in _plans(req).values())
    assert need_rec < need_min
    cap = (need_rec + need_min) / 2 / GIB
    # the attention core's own recompute is left out here (tests/unit/test_attention_recompute.py): with it a
    # zero-bubble plan may fit at this capacity
    got = choose_schedule(_req(cap), recompute_attention=False)
    # with recompute: 1F1B or interleaved 1F1B (held to the two-chunk margin), the faster of their own plans that fit
    rec = {}
    for s in ("1f1b", "interleaved"):
        p = make_plan(replace(_req(cap, strict=False), shape=replace(req.shape, schedule=s, recompute=True)))
        if p.fits:
            rec[s] = p.step_time_s / ((1 - ACCEL_CHUNK_MARGIN) if s in CHUNKED_SCHEDULES else 1.0)
    want = min(rec, key=lambda s: (rec[s], s != "1f1b"))
    assert (got.schedule, got.recompute) == (want, True) and "), the only way to fit" in got.why


def test_nothing_fits_raises_the_placement_error():
    with pytest.raises(PlacementError):
        choose_schedule(_req(0.5))
    assert not choose_schedule(_req(0.5, strict=False)).plan.fits


def test_recompute_asked_keeps_to_the_schedules_that_recompute():
    got = choose_schedule(_req(47.5, recompute=True))
    assert got.schedule in ("1f1b", "gpipe", "interleaved") and got.recompute


@pytest.mark.parametrize("kind, zbv_s, margin_said", [("cpu", 4.74, True), ("cpu", 4.5, False),
                                                    ("furiosa", 4.8, True), ("furiosa", 4.74, False)])
def test_a_faster_two_chunk_schedule_passed_over_is_named(monkeypatch, kind, zbv_s, margin_said):
    """cpu cards (5 % margin): zbv predicted 4.74 s against zb-h1's 4.86 s is not 5 % faster (4.74 > 0.95 x 4.86
    = 4.617), so zb-h1 is chosen and the line says why zbv, the faster, was passed over (issue 40); zbv at 4.5 s
    (< 4.617) is chosen and there is nothing to explain. furiosa cards (2 %: copies modelled): 4.8 > 0.98 x 4.86 =
    4.763 is passed over, 4.74 is chosen. interleaved (4.95 s) is slower than zb-h1 and is never named for it."""
    from types import SimpleNamespace

    from npu_train.planner import schedule_choice

    times = {"1f1b": 6.0, "zb": 5.0, "zb-h1": 4.86, "zb-h2": 5.2, "zbv": zbv_s, "interleaved": 4.95}

    def fake(req, s, recompute, core=True):
        return SimpleNamespace(step_time_s=times[s], shape=SimpleNamespace(recompute_attention=False, vocab_parallel=False)), ""

    monkeypatch.setattr(schedule_choice, "_try", fake)
    req = _req(47.5)
    if kind == "cpu":
        req = replace(req, cards=make_cards("cpu", 2, int(47.5 * GIB)), rates=[load_rates("cpu")] * 2)
    pct = {"cpu": CHUNK_MARGIN, "furiosa": ACCEL_CHUNK_MARGIN}[kind]
    assert chunk_margin(req.cards) == pct and (CHUNK_MARGIN, ACCEL_CHUNK_MARGIN) == (0.05, 0.02)
    got = choose_schedule(req)
    assert got.schedule == ("zb-h1" if margin_said else "zbv")
    assert (f"zbv is within the {pct * 100:.0f} % two-chunk margin" in got.why) == margin_said, got.why
    assert "interleaved is within" not in got.why and "are within" not in got.why, got.why


def _one_card(req: PlanRequest) -> PlanRequest:
    return replace(req, cards=list(req.cards)[:1], rates=[load_rates("furiosa")])


def test_one_card_keeps_two_chunk_schedules_out():
    """rev4 BUG 1: on one pipeline stage a two-chunk schedule's chunk 0 has no next card to hand its activations
    to (the card crashed in ``ch.comm.send_act``): auto neither tries nor names zbv / interleaved there, with or
    without recompute, and make_plan refuses them by name; on 2 cards they stay candidates."""
    for recompute in (False, True):
        got = choose_schedule(_one_card(_req(47.5, recompute=recompute)))
        assert got.schedule not in CHUNKED_SCHEDULES, got.why
        assert not any(s in got.why for s in CHUNKED_SCHEDULES), got.why
    for s in CHUNKED_SCHEDULES:
        with pytest.raises(ValueError, match=rf"schedule {s} needs at least 2 pipeline stages \(P=1\): use 1f1b"):
            make_plan(replace(_one_card(_req(47.5)), shape=replace(_req(47.5).shape, schedule=s)))
    assert all(s in choose_schedule(_req(47.5)).why for s in CHUNKED_SCHEDULES)
