"""The stage-boundary copies in copy threads, as the plan prices them (issue 38; ``runtime/copies.py``).

What the runtime does, and the expected values are written from: a send is handed to the card's send thread when
the action's compute ends (once the previous send is out) and reaches the other card when its copy ends; before
an action computes, the card looks whether the next action's input has arrived: if so the fetch thread copies it
onto the card meanwhile and the next action starts no earlier than ``look + copy``, else the card copies it itself
when it gets there (exposed). Memory: at most one send in flight and one input fetched ahead, so two more
``[b, S, H]`` tensors in the compute dtype per card (``2 e b S H``)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.pipeline.schedule import ALL_SCHEDULES, copy_timeline, stage_timeline
from npu_train.planner import RunShape, load_rates
from npu_train.planner.cost import CostModel
from npu_train.planner.memory import MemoryModel

GIB = 2 ** 30


@pytest.mark.parametrize("kind", ALL_SCHEDULES)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_copies_of_zero_seconds_give_the_plain_timeline(kind, P):
    from npu_train.pipeline.schedule import chunks_per_card

    V = P * chunks_per_card(kind)
    for M in (P, 2 * P):
        if kind == "interleaved" and M % P:
            continue
        tf, tb, tw = [1.0 + 0.1 * v for v in range(V)], [2.0] * V, [0.5] * V
        end, busy = stage_timeline(kind, P, M, tf, tb, tw)
        end2, busy2, exposed = copy_timeline(kind, P, M, tf, tb, tw, [(0.0,) * 4] * V)
        assert end2 == pytest.approx(end) and busy2 == pytest.approx(busy) and exposed == [0.0] * P


def test_two_card_1f1b_by_hand():
    """P = 2, M = 2, F 1 s, B 2 s, each copy 0.1 s. Card 0: F0 F1 B0 B1; card 1: F0 B0 F1 B1.
    card 0: F0 0-1 (its send out at 1.1), F1 1-2 (out at 2.1); B0 needs card 1's gradient, out at 4.3: it was not
    there when card 0 looked (1, at F1's start), so card 0 copies it itself: 4.3 + 0.1 = 4.4, B0 4.4-6.4; B1's
    gradient (out at 7.3) likewise: 7.4-9.4. card 1: F0's activation arrived at 1.1 with no look-ahead before the
    first action: 1.2-2.2; B0 2.2-4.2 (its send out at 4.3); F1's activation (out at 2.1) was there when card 1
    looked at B0's start (2.2): fetched meanwhile (2.2-2.3), F1 4.2-5.2; B1 5.2-7.2, its send out at 7.3."""
    copies = [(0.0, 0.1, 0.1, 0.0), (0.1, 0.0, 0.0, 0.1)]
    end, busy, exposed = copy_timeline("1f1b", 2, 2, 1.0, 2.0, 0.0, copies)
    assert end == pytest.approx([9.4, 7.3])
    assert busy == pytest.approx([6.0, 6.0])
    assert exposed == pytest.approx([0.2, 0.1])
    # the same copies in the card threads (inside F and B): card 0 F 1.1, B 2.1; card 1 F 1.1, B 2.1
    sync_end, _ = stage_timeline("1f1b", 2, 2, [1.1, 1.1], [2.1, 2.1], 0.0)
    assert max(sync_end) > max(end)


def test_a_send_waits_for_the_previous_one():
    """One card sending copies longer than its forwards: P = 2, gpipe, M = 3, F 1 s, copy out 3 s (no copy in):
    card 0's F0 0-1, its send 1-4; F1 1-2, its send waits for the first: 4-7 (card 0's thread free at 4); F2 4-5,
    its send 7-10. Card 1's forwards (1 s each, no copy in) at 4-5, 7-8, 10-11."""
    copies = [(0.0, 3.0, 0.0, 0.0), (0.0, 0.0, 0.0, 0.0)]
    end, _, _ = copy_timeline("gpipe", 2, 3, [1.0, 1.0], [0.0, 0.0], 0.0, copies)
    # card 1: F 4-5, 7-8, 10-11, then its B's (0 s)
    assert end[1] == pytest.approx(11.0)


def _cm(kind: str, schedule: str, P: int, overlap, M: int = 8):
    m = replace(get_preset("llama-3.1-8b"), num_layers=8)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=M, schedule=schedule, dtype="bf16",
                     overlap_copies=overlap)
    return m, shape, CostModel(m, shape, make_cards(kind, P, int(47.5 * GIB)), [load_rates(kind)] * P, None, 1, 16)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zbv", "interleaved"])
def test_overlapped_copies_leave_compute_and_are_no_slower(schedule):
    _, _, sync = _cm("furiosa", schedule, 4, False)
    _, _, ovl = _cm("furiosa", schedule, 4, None)  # auto: on for RNGD cards
    assert ovl.overlapped == [True] * 4 and sync.overlapped == [False] * 4
    split = [2, 2, 2, 2]
    cs, co = [sync.cost(i, 2, 2) for i in range(4)], [ovl.cost(i, 2, 2) for i in range(4)]
    for a, b in zip(cs, co):
        assert b.t_copy == (0.0, 0.0)
        assert b.t_f == pytest.approx(a.t_f - a.t_copy[0]) and b.t_b == pytest.approx(a.t_b - a.t_copy[1])
    assert ovl.step_time(split, [2] * 4) < sync.step_time(split, [2] * 4)
    # the table's boundary column: only the copies a card's own thread made
    for ts, to in zip(sync.stage_times(split, cs), ovl.stage_times(split, co)):
        assert to["boundary"] <= ts["boundary"] + 1e-12
        assert to["compute"] == pytest.approx(ts["compute"])


def test_overlap_needs_a_thread_local_card_kind():
    for kind, setting, on in (("furiosa", None, True), ("furiosa", False, False), ("cuda", None, False),
                              ("cuda", True, True), ("cpu", None, False), ("cpu", True, True)):
        assert _cm(kind, "1f1b", 2, setting)[2].overlapped == [on, on], (kind, setting)
    assert _cm("furiosa", "1f1b", 1, None)[2].overlapped == [False]  # one card: no boundary


@pytest.mark.parametrize("schedule,P", [("1f1b", 3), ("zbv", 2), ("interleaved", 2)])
def test_the_copy_threads_memory_is_two_boundary_tensors_per_card(schedule, P):
    m, shape, _ = _cm("furiosa", schedule, P, None)
    X = 2 * 512 * 2 * m.hidden_size  # bf16 x S x b x H
    cards = make_cards("furiosa", P, int(47.5 * GIB))
    on = MemoryModel(m, shape, cards, None)
    off = MemoryModel(m, replace(shape, overlap_copies=False), cards, None)
    for i in range(P):
        a, b = on.stage(i, 2, 2, 0.0).mem, off.stage(i, 2, 2, 0.0).mem
        assert a["transient"] - b["transient"] == 2 * X
        assert a["total"] - b["total"] >= 2 * X
    one = MemoryModel(m, shape, make_cards("furiosa", 1, int(47.5 * GIB)), None)
    assert one.overlap_bytes(0) == 0
