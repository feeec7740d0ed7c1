"""Vocabulary parallelism as schedule data (Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary
Parallelism"): every card's list gains one joint ``V(m)`` per micro-batch, run by all cards together after the
head stage's ``F(m)`` and before its ``B(m)``. Expected values from those definitions: each card keeps its own
actions in their order, the ``V`` actions in micro-batch order, no deadlock for P <= 8 and M <= 4P with bounded
links, and the timeline's joint action (every card starts it together and spends its share)."""
from __future__ import annotations

import pytest

from npu_train.pipeline import schedule as sch
from npu_train.pipeline.schedule import (ALL_SCHEDULES, VOCAB, Action, build_schedule, head_position, simulate,
                                         stage_timeline, step_time)

CASES = [(P, M) for P in range(1, 9) for M in range(1, 4 * P + 1)]


def _cases(kind: str) -> list:
    return [(P, M) for P, M in CASES if kind != "interleaved" or M % P == 0]


@pytest.mark.parametrize("kind", ALL_SCHEDULES)
def test_vocab_actions_complete_ordered_and_deadlock_free(kind):
    """P <= 8, M <= 4P: each card's list is its list without vocabulary parallelism with ``V(0..M-1)`` added in
    order; on the head card ``V(m)`` comes right after the head's ``F(m)``; every card runs against the others
    with unbounded, 2-, 3- and min(M, P)+1-slot links (the launcher's default) without deadlock. One-slot links are
    refused with vocabulary parallelism (runtime/job.py::check_vocab; test_one_slot_links_can_deadlock)."""
    for P, M in _cases(kind):
        h, hc = head_position(kind, P)
        for s in range(P):
            acts = build_schedule(kind, P, M, s, vocab=True)
            assert [a for a in acts if a.kind != VOCAB] == build_schedule(kind, P, M, s), (kind, P, M, s)
            assert [a for a in acts if a.kind == VOCAB] == [Action(VOCAB, m) for m in range(M)]
            if s == h:
                for m in range(M):
                    i = acts.index(Action(VOCAB, m))
                    assert acts[i - 1] == Action("F", m, hc), (kind, P, M, m)
        for slots in (None, 2, 3, min(M, P) + 1):
            simulate(kind, P, M, slots=slots, vocab=True)


def test_one_slot_links_can_deadlock():
    """Why runtime.slots=1 is refused with vocabulary parallelism: ZB-H2 on 3 cards, 5 micro-batches: card 0's
    fifth forward waits for a free slot that card 1 frees only after ``V(1)``, which card 0 has not reached."""
    simulate("zb-h2", 3, 5, slots=1)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate("zb-h2", 3, 5, slots=1, vocab=True)


def test_a_vocab_action_before_the_head_forward_deadlocks(monkeypatch):
    """Broken on purpose: the head card's ``V(m)`` before its ``F(m)`` (the final hidden state does not exist
    yet): simulate() must find the deadlock."""
    real = sch.vocab_positions

    def early(kind, P, M):
        pos = real(kind, P, M)
        h = head_position(kind, P)[0]
        pos[h] = [max(0, p - 1) for p in pos[h]]
        return pos

    monkeypatch.setattr(sch, "vocab_positions", early)
    sch._with_vocab.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="deadlock"):
            simulate("1f1b", 2, 2, vocab=True)
    finally:
        sch._with_vocab.cache_clear()


def test_one_card_runs_forward_vocab_backward():
    """P = 1: each micro-batch is F, V, B, so the step is M (t_f + t_v + t_b)."""
    assert [a.kind for a in build_schedule("1f1b", 1, 3, 0, vocab=True)] == list("FVBFVBFVB")
    assert step_time("1f1b", 1, 3, t_f=1.0, t_b=2.0, t_w=0.0, t_v=0.5) == pytest.approx(3 * 3.5)


def test_two_card_1f1b_timeline_by_hand():
    """P = 2, M = 2, 1F1B, F = 1, B = 2 (t_b 1 + t_w 1), V = 0.5 on both cards. Orders (placement from the unit
    timeline: the head card 1 ends F0 at 2, F1 at 5; card 0 has ended F0, F1 by 2 and nothing more by 5):
    card 0 F0 F1 V0 V1 B0 B1, card 1 F0 V0 B0 F1 V1 B1. Times: card 0 F0 0-1, F1 1-2; card 1 F0 1-2; V0 2-2.5 (both);
    card 1 B0 2.5-4.5, F1 4.5-5.5; V1 5.5-6 (both); card 0 B0 6-8; card 1 B1 6-8; card 0 B1 8-10."""
    assert [repr(a) for a in build_schedule("1f1b", 2, 2, 0, vocab=True)] == ["F0", "F1", "V0", "V1", "B0", "B1"]
    assert [repr(a) for a in build_schedule("1f1b", 2, 2, 1, vocab=True)] == ["F0", "V0", "B0", "F1", "V1", "B1"]
    end, busy = stage_timeline("1f1b", 2, 2, t_f=1.0, t_b=1.0, t_w=1.0, t_v=0.5)
    assert end == pytest.approx([10.0, 8.0])
    assert busy == pytest.approx([7.0, 7.0])  # 2 F + 2 B (2 each) + 2 V on each card


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zbv", "interleaved"])
def test_timeline_adds_at_least_each_cards_vocab_share(kind):
    """Every card spends ``M t_v`` more: the step is at least the base step's busy time of the busiest card plus
    ``M t_v``, and joint actions end together (the busy time is the card's work)."""
    P, M = 4, 8
    base_end, base_busy = stage_timeline(kind, P, M)
    end, busy = stage_timeline(kind, P, M, t_v=0.25)
    assert busy == pytest.approx([b + M * 0.25 for b in base_busy])
    assert max(end) >= max(base_busy) + M * 0.25 - 1e-9


@pytest.mark.parametrize("kind", ["zb", "zbv"])
def test_a_free_vocab_action_costs_zb_and_zbv_nothing(kind):
    """At unit times with ``V`` taking no time, ZB and ZB-V keep their step for P <= 8, M <= 4P: the joint actions sit
    where the cards are aligned anyway (10.2 of experiments/2026-12-06-eight-cards.md)."""
    for P, M in CASES:
        assert step_time(kind, P, M, t_v=0.0) == step_time(kind, P, M), (P, M)


def test_the_offsets_bring_zb_h1_close_to_its_step():
    """ZB-H1, P = 8, M = 32 (the 8B layout): 103 units without ``V``; 128 with every card's ``V(m)`` at the head's
    ``F(m)`` (offset 0), 111 with the +1 offset :func:`vocab_positions` picks."""
    assert step_time("zb-h1", 8, 32) == 103.0
    assert step_time("zb-h1", 8, 32, t_v=0.0) == 111.0


def test_the_exchange_overlaps_where_nothing_waits_for_it():
    """The joint V(m) with pipeline/vocab.py's overlap, by hand (1f1b, P = 2, M = 1; F 1, B 1; per card s 0.5,
    g 0.25, w 0.25; the hidden state 0.5 to card 0, the statistics 0.1, the sum 0.4 back): card 0's F ends at 1,
    the head's (card 1) at 2; card 0 starts its logits slice when the hidden state arrives (2.5), the head at 2; they
    meet at max(3.0, 2.5) + 0.1 = 3.1; both go on at 3.1 + 0.5 = 3.6, but the head's B waits for the sum:
    3.1 + 0.25 + 0.4 = 3.75, ends 4.75; card 0's B 5.75. Busy 1 + 1 + 1 on each card: the exchange is no card's work."""
    end, busy = stage_timeline("1f1b", 2, 1, t_f=1.0, t_b=1.0, t_w=0.0, t_v=[(0.5, 0.25, 0.25)] * 2,
                               lat=(0.5, 0.1, 0.4))
    assert end == pytest.approx([5.75, 4.75])
    assert busy == pytest.approx([3.0, 3.0])
    # a card's whole share before the cards meet (the joint action as one block of 2): V ends at 2 + 2, B 5, 6
    assert step_time("1f1b", 2, 1, t_f=1.0, t_b=1.0, t_w=0.0, t_v=2.0) == pytest.approx(5.0 + 1.0 + 0.0)
