"""Two chunks per card: ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory") and interleaved
1F1B (Narayanan et al. 2021 §2.2) as pure action lists. Expected values come from the papers' definitions:
where each chunk sits, one F/B/W per micro-batch and chunk, peak memory, and the step time of unit actions."""
from __future__ import annotations

import pytest

from npu_train.pipeline.schedule import (Action, bubble_fraction, build_schedule, card_of, chunks_per_card,
                                         peak_in_flight, peak_pending_weight_grads, simulate, stage_timeline,
                                         step_time, virtual_stage)

CASES = [(P, M) for P in range(1, 9) for M in range(1, 4 * P + 1)]


def _check_complete(kind: str, P: int, M: int) -> None:
    kinds = "FBW" if kind == "zbv" else "FB"
    for r in range(P):
        acts = build_schedule(kind, P, M, r)
        assert all(isinstance(a, Action) and a.chunk in (0, 1) for a in acts)
        for c in (0, 1):
            for k in kinds:  # exactly one F, one B (and one W) per micro-batch and chunk
                assert sorted(a.micro for a in acts if a.kind == k and a.chunk == c) == list(range(M)), (r, c, k)
        pos = {(a.kind, a.micro, a.chunk): i for i, a in enumerate(acts)}
        for m in range(M):
            for c in (0, 1):
                assert pos[("F", m, c)] < pos[("B", m, c)], (r, m, c)
                if kind == "zbv":
                    assert pos[("B", m, c)] < pos[("W", m, c)], (r, m, c)
        assert len(acts) == len(kinds) * 2 * M


@pytest.mark.parametrize("P,M", CASES)
def test_zbv_complete_and_deadlock_free(P, M):
    """P <= 8, M <= 4P: every card's list is complete and ordered, and the cards run against each other
    without deadlock with unbounded, 1-slot, 2-slot and the launcher's default min(M, P) + 1 slot rings."""
    _check_complete("zbv", P, M)
    for slots in (None, 1, 2, min(M, P) + 1):
        simulate("zbv", P, M, slots=slots)


@pytest.mark.parametrize("P,M", [(P, M) for P, M in CASES if M % P == 0])
def test_interleaved_complete_and_deadlock_free(P, M):
    _check_complete("interleaved", P, M)
    for slots in (None, 1, 2, min(M, P) + 1):
        simulate("interleaved", P, M, slots=slots)


def test_where_the_chunks_sit():
    """ZB-V: card r holds virtual stages r and 2P-1-r, so card 0 holds the first (embedding) and the last
    (head); interleaved: r and P+r."""
    for P in range(1, 9):
        assert chunks_per_card("zbv") == chunks_per_card("interleaved") == 2 and chunks_per_card("zb-h2") == 1
        for r in range(P):
            assert (virtual_stage("zbv", P, r, 0), virtual_stage("zbv", P, r, 1)) == (r, 2 * P - 1 - r)
            assert (virtual_stage("interleaved", P, r, 0), virtual_stage("interleaved", P, r, 1)) == (r, P + r)
        assert card_of("zbv", P, 0) == (0, 0) and card_of("zbv", P, 2 * P - 1) == (0, 1)
        for kind in ("zbv", "interleaved"):
            assert sorted(virtual_stage(kind, P, *card_of(kind, P, v)) for v in range(2 * P)) == list(range(2 * P))


@pytest.mark.parametrize("P", range(1, 9))
def test_zbv_memory_and_bubble(P):
    """ZB-V holds at most 2P chunk micro-batches (1F1B's first-stage peak of P whole-stage micro-batches, the
    paper's claim), and with unit F = B = W per chunk and M >= 2P reaches the lower bound 6M + P - 1: the last
    card cannot start before P - 1 chunk forwards, then has 6M units of work."""
    for M in range(1, 4 * P + 1):
        peaks = [peak_in_flight("zbv", r, P, M) for r in range(P)]
        assert max(peaks) <= 2 * P, peaks
        assert max(peaks) == min(2 * P, 2 * M)
        for r in range(P):  # a chunk's B..W wait holds its weight ops' output gradients; never above the peak
            assert peak_pending_weight_grads("zbv", r, P, M) <= peaks[r]
        if M >= 2 * P:
            assert step_time("zbv", P, M) == pytest.approx(6 * M + P - 1)
            assert bubble_fraction("zbv", P, M) == pytest.approx((P - 1) / (6 * M + P - 1))
            if P > 1:  # half of ZB-H2's (P-1)/(3M+P-1) at the same chunk unit
                assert bubble_fraction("zbv", P, M) < bubble_fraction("zb-h2", P, M)


@pytest.mark.parametrize("P", range(1, 9))
def test_interleaved_bubble_and_memory(P):
    """Narayanan et al. 2021 §2.2: v = 2 chunks shrink the 1F1B bubble to (P-1)/(vM + P-1) at unit chunk F and
    B + W = 2; the first card holds 2(P-1) + P + 1 chunk micro-batches at most (its warm-up plus one)."""
    for M in range(P, 4 * P + 1, P):
        assert bubble_fraction("interleaved", P, M) == pytest.approx((P - 1) / (2 * M + P - 1))
        for r in range(P):
            assert peak_in_flight("interleaved", r, P, M) == min(2 * (P - r - 1) + P + 1, 2 * M)


def test_per_chunk_durations():
    """Durations are per virtual stage for two-chunk schedules: 2P values; the first virtual stage's B is
    the whole backward (B + W), as in the one-chunk zero-bubble schedules."""
    P, M = 2, 4
    end, busy = stage_timeline("zbv", P, M, t_f=[1.0] * 4, t_b=[1.0] * 4, t_w=[1.0] * 4)
    assert busy == pytest.approx([6 * M, 6 * M])
    with pytest.raises(ValueError, match="one value per stage"):
        stage_timeline("zbv", P, M, t_f=[1.0] * P)
    slow_head = step_time("zbv", P, M, t_f=[1, 1, 1, 2], t_b=[1, 1, 1, 2], t_w=[1, 1, 1, 2])
    assert slow_head > step_time("zbv", P, M)


def test_order_examples():
    # ZB-V, P = 2, M = 4 (torch's ScheduleZBVZeroBubble writes the same order for card 0)
    want = "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 B2.1 W2.1 B1 W1 F3.1 B3.1 W3.1 B2 W2 B3 W3"
    assert " ".join(map(repr, build_schedule("zbv", 2, 4, 0))) == want
    # interleaved 1F1B, P = 2, M = 2, card 1: P = 2 warm-up forwards (chunk 0 micro-batches 0, 1), then 1F1B
    want = "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    assert " ".join(map(repr, build_schedule("interleaved", 2, 2, 1))) == want


def test_errors():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        build_schedule("interleaved", 4, 6, 0)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zbx", 2, 2, 0)


def test_an_empty_chunk_is_labelled_none():
    """A two-chunk card whose second chunk holds no layer (ZB-V's card 0 with one layer) prints ``none`` for it,
    not a backwards range such as ``32-31``."""
    from npu_train.hardware import make_cards
    from npu_train.planner.plan import StagePlan

    card = make_cards("furiosa", 1)[0]

    def label(first, last, second):
        return StagePlan(card, first, last, True, True, [], [], {}, {}, 0, second=second).layers_label

    assert label(0, 1, (32, 32)) == "0,none +emb +head"
    assert label(4, 5, (5, 6)) == "4,5 +emb +head"  # one layer per chunk: its number, not "4-4"
    assert label(0, 2, (30, 32)) == "0-1,30-31 +emb +head"
    assert label(0, 16, None) == "0-15 +emb +head"
