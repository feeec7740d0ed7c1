"""The stage-boundary copies in the step time (issue 38): on an accelerator a boundary tensor goes card -> host
into the shared-memory slot on the sender (``TensorLink.send``) and host -> card out of it on the receiver
(``TensorLink.recv``), both in the card process's thread between its actions (``runtime/links.py``). Expected
values are written from that: ``X = e b S H`` bytes per crossing; a virtual stage's F receives the activation from
its predecessor (``X / h2d``) and sends its own (``X / d2h``), its B receives the gradient from its successor
(``X / h2d``) and sends one back (``X / d2h``); a neighbour on the same card (ZB-V's turn) costs nothing, and nor
does a cpu card (memory copies inside its fitted compute rate)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.pipeline.schedule import stage_timeline
from npu_train.planner import RunShape, load_rates
from npu_train.planner.cost import CostModel

GIB = 2 ** 30


def _model(kind: str, schedule: str, P: int, M: int = 4, layers: int = 8, copy_scale: float = 1.0):
    """``(model, shape, CostModel)``; ``copy_scale`` multiplies the card<->host rates (1e12: copies of ~0 s)."""
    m = replace(get_preset("llama-3.1-8b"), num_layers=layers)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=M, schedule=schedule, dtype="bf16")
    r = load_rates(kind)
    r = replace(r, h2d_bytes_per_s=r.h2d_bytes_per_s * copy_scale, d2h_bytes_per_s=r.d2h_bytes_per_s * copy_scale)
    return m, shape, CostModel(m, shape, make_cards(kind, P, int(47.5 * GIB)), [r] * P, None, 1, 16)


def _rates(cm: CostModel, i: int) -> tuple[float, float]:
    return cm.rates[i].h2d_bytes_per_s, cm.rates[i].d2h_bytes_per_s


def test_one_chunk_per_card_copies_each_neighbours_tensor_once_each_way():
    m, shape, cm = _model("furiosa", "1f1b", 3)
    X = 2 * 2 * 512 * m.hidden_size  # bf16, micro-batch 2, S = 512
    h2d, d2h = _rates(cm, 0)
    assert cm.boundary_copies(0) == pytest.approx((X / d2h, X / h2d))
    assert cm.boundary_copies(1) == pytest.approx((X / h2d + X / d2h, X / h2d + X / d2h))
    assert cm.boundary_copies(2) == pytest.approx((X / h2d, X / d2h))
    assert cm.card_copies(1) == pytest.approx((X / h2d + X / d2h, X / h2d + X / d2h))


def test_zbv_turn_on_the_last_card_copies_nothing():
    """P = 2: virtual stages 0, 1, 2, 3 on cards 0, 1, 1, 0; 1 -> 2 is the hand-over inside card 1."""
    m, shape, cm = _model("furiosa", "zbv", 2)
    X = 2 * 2 * 512 * m.hidden_size
    h2d, d2h = _rates(cm, 0)
    assert cm.boundary_copies(0) == pytest.approx((X / d2h, X / h2d))
    assert cm.boundary_copies(1) == pytest.approx((X / h2d, X / d2h))
    assert cm.boundary_copies(2) == pytest.approx((X / d2h, X / h2d))
    assert cm.boundary_copies(3) == pytest.approx((X / h2d, X / d2h))
    assert cm.card_copies(0) == pytest.approx((X / d2h + X / h2d, X / h2d + X / d2h))
    assert cm.card_copies(1) == pytest.approx((X / h2d + X / d2h, X / d2h + X / h2d))


def test_cpu_cards_add_nothing():
    _, _, cm = _model("cpu", "1f1b", 3)
    assert [cm.boundary_copies(v) for v in range(3)] == [(0.0, 0.0)] * 3


def test_the_step_carries_the_copies_on_each_action():
    """1F1B, P = 3, M = 4: the phase is the timeline of F and B each lengthened by its stage's copies (W none), and
    the time table reports ``M x`` each card's copies as ``boundary``, out of the bubble."""
    m, shape, cm = _model("furiosa", "1f1b", 3)
    _, _, free = _model("furiosa", "1f1b", 3, copy_scale=1e12)  # the same compute, copies of ~0 s
    X = 2 * 2 * 512 * m.hidden_size
    h2d, d2h = _rates(cm, 0)
    split = [3, 3, 2]
    costs = [cm.cost(i, n, n) for i, n in enumerate(split)]
    plain = [free.cost(i, n, n) for i, n in enumerate(split)]
    add_f = [X / d2h, X / h2d + X / d2h, X / h2d]
    add_b = [X / h2d, X / h2d + X / d2h, X / d2h]
    end, _ = stage_timeline("1f1b", 3, 4, [c.t_f + a for c, a in zip(plain, add_f)],
                            [c.t_b + a for c, a in zip(plain, add_b)], [c.t_w for c in plain])
    assert cm.phase(costs) == pytest.approx(max(end))
    assert max(end) > free.phase(plain)
    times, free_times = cm.stage_times(split, costs), free.stage_times(split, plain)
    for i, (tm, ft) in enumerate(zip(times, free_times)):
        assert tm["boundary"] == pytest.approx(4 * (add_f[i] + add_b[i]))
        assert tm["compute"] == pytest.approx(ft["compute"])  # the copies are not compute
        assert tm["compute"] + tm["boundary"] + tm["bubble"] == pytest.approx(max(end))


def test_the_time_table_shows_them_with_the_transfers():
    """The ``xfer`` column is the card<->host transfers: the offloaded layers' plus the boundary copies, so a row
    still adds up to its stage's total."""
    from npu_train.planner import PlanRequest, make_plan
    from npu_train.planner.table import plan_table

    m = replace(get_preset("llama-3.1-8b"), num_layers=8)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=4, schedule="1f1b", dtype="bf16")
    plan = make_plan(PlanRequest(m, shape, make_cards("furiosa", 3, int(47.5 * GIB)), [load_rates("furiosa")] * 3,
                                 host_ram_bytes=None))
    text = plan_table(plan)
    # the time table's rows: card, layers, ..., xfer, dp-comm, stage (the second row of each card's name)
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("furiosa:")][len(plan.stages):]
    for st, row in zip(plan.stages, rows):
        tm = st.time
        assert tm["boundary"] > 0
        assert row[-3] == f"{tm['transfer'] + tm['boundary']:.2f}"
        assert tm["compute"] + tm["boundary"] + max(0.0, tm["bubble"]) + tm["host_optimizer"] - tm["host_hidden"] \
            + tm["device_optimizer"] + tm["transfer"] + tm["dp_comm"] == pytest.approx(tm["total"])


def test_two_chunks_carry_each_virtual_stages_own_copies():
    """ZB-V, P = 2, cards of 3 and 2 layers: each virtual stage's F and B are the copy-free ones plus that virtual
    stage's own copies (card 1's turn from virtual stage 1 to 2 copies nothing), not a layer share of the card's."""
    m, shape, cm = _model("furiosa", "zbv", 2, layers=5)
    _, _, free = _model("furiosa", "zbv", 2, layers=5, copy_scale=1e12)
    X = 2 * 2 * 512 * m.hidden_size
    h2d, d2h = _rates(cm, 0)
    split = [3, 2]
    got = cm.stage_durations([cm.cost(i, n, n) for i, n in enumerate(split)])
    base = free.stage_durations([free.cost(i, n, n) for i, n in enumerate(split)])
    own_f = [X / d2h, X / h2d, X / d2h, X / h2d]
    own_b = [X / h2d, X / d2h, X / h2d, X / d2h]
    assert got[0] == pytest.approx([b + a for b, a in zip(base[0], own_f)])
    assert got[1] == pytest.approx([b + a for b, a in zip(base[1], own_b)])
    assert got[2] == pytest.approx(base[2])
