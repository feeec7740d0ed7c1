"""Data parallelism without processes: ParallelLayout (ranks, neighbours, groups, link names), the
ZeRO-1 partition, the parallel.* config checks, and the planner's dp memory / time terms (the
expected figures are written from the formulas in planner/cost.py's docstring)."""
from __future__ import annotations

import pytest

from npu_train.config import check_dp_cards
from npu_train.errors import ConfigError
from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, make_plan, plan_table
from npu_train.runtime.layout import ParallelLayout
from npu_train.runtime.replicas import zero_owners


def test_layout_ranks_and_neighbours():
    lay = ParallelLayout(dp=3, pp=2)
    assert lay.world == 6
    assert [lay.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(lay.rank(*lay.coords(r)) == r for r in range(6))
    assert [lay.prev(r) for r in range(6)] == [None, 0, None, 2, None, 4]
    assert [lay.next(r) for r in range(6)] == [1, None, 3, None, 5, None]
    assert lay.stage_groups() == [[0, 2, 4], [1, 3, 5]]
    assert lay.tied_groups() == [[0, 1], [2, 3], [4, 5]]
    assert ParallelLayout(2, 1).tied_groups() == []
    assert lay.where(3) == "replica 1, stage 1" and ParallelLayout(1, 3).where(2) == "stage 2"
    with pytest.raises(ValueError):
        lay.rank(3, 0)
    with pytest.raises(ValueError):
        ParallelLayout(0, 2)


def test_link_names_unique_per_replica_and_unchanged_for_dp1():
    lay = ParallelLayout(dp=2, pp=3)
    names = [lay.link_name(kind, s, k) for k in range(2) for s in range(3) for kind in ("act", "grad")]
    assert len(set(names)) == len(names)
    assert [ParallelLayout(1, 2).link_name("act", 0, 0), ParallelLayout(1, 2).link_name("grad", 1, 0)] == ["act0", "grad1"]


def test_zero_owners_balanced_and_deterministic():
    numels = {f"p{i}": n for i, n in enumerate([100, 90, 80, 10, 10, 5, 5, 1])}
    own = zero_owners(numels, 2)
    assert own == zero_owners(dict(reversed(list(numels.items()))), 2)  # independent of dict order
    assert set(own) == set(numels) and set(own.values()) == {0, 1}
    load = [sum(n for k, n in numels.items() if own[k] == r) for r in range(2)]
    # greedy onto the least-loaded replica: the loads differ by at most the largest parameter
    assert abs(load[0] - load[1]) <= max(numels.values()), load
    assert load == [131, 170]  # 100 | 90+80, then every small one onto replica 0
    assert set(zero_owners({"a": 5}, 3).values()) == {0}


def test_dp_config_checks():
    assert check_dp_cards(8, 4) == 2
    with pytest.raises(ConfigError, match=r"parallel.dp=3 does not divide the 8 card"):
        check_dp_cards(8, 3)


def _plan(dp, zero, resident):
    m = get_preset("llama-3.1-8b")
    shape = RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16")
    return make_plan(PlanRequest(m, shape, make_cards("furiosa", 2), DEFAULT_RATES["furiosa"], split=[16, 16],
                                 resident_layers=resident, threads=1, host_cores=8, dp=dp, zero=zero))


def test_planner_dp_terms():
    rt = DEFAULT_RATES["furiosa"]
    one, four = _plan(1, 0, 5), _plan(4, 0, 5)
    assert four.tokens_per_step == 4 * one.tokens_per_step == 4 * 512 * 4
    for a, b in zip(one.stages, four.stages):
        assert a.mem == b.mem  # no ZeRO: every replica's card holds the same as a single pipeline's
        assert a.time["dp_comm"] == 0.0
        params = a.mem["weights"] // 2  # bf16 weights
        # ring all-reduce of the fp32 gradient over gloo + the gradient's d2h and h2d on the card
        want = 2 * 3 / 4 * 4 * params / rt.dp_bytes_per_s + 2 * params * (1 / rt.d2h_bytes_per_s + 1 / rt.h2d_bytes_per_s)
        assert b.time["dp_comm"] == pytest.approx(want, rel=1e-12)
        # four replicas put 4x the card processes on the host, sharing its memory bandwidth: the host update is
        # slower there (planner/rates.py), and the step grows by that and by the all-reduce
        assert b.time["host_optimizer"] > a.time["host_optimizer"]
        grow = want + b.time["host_optimizer"] - a.time["host_optimizer"]
        assert b.time["total"] == pytest.approx(a.time["total"] + grow, rel=1e-12)
    assert four.host_bytes_all == 4 * four.host_bytes
    text = plan_table(four)
    assert "dp=4 x pp=2 (8 cards)" in text and "dp-comm" in text


def test_planner_zero1_shards_optimizer_state():
    rt = DEFAULT_RATES["furiosa"]
    z0, z1 = _plan(4, 0, 4), _plan(4, 1, 4)
    for a, b in zip(z0.stages, z1.stages):
        assert b.mem["optimizer"] == pytest.approx(a.mem["optimizer"] / 4, abs=1)
        assert b.mem["total"] < a.mem["total"]
        assert b.host_bytes == pytest.approx(a.host_bytes / 4, abs=1)
        assert b.time["host_optimizer"] == pytest.approx(a.time["host_optimizer"] / 4, rel=1e-12)
        params = a.mem["weights"] // 2
        # + broadcast of the updated bf16 weights from their owners
        assert b.time["dp_comm"] - a.time["dp_comm"] == pytest.approx(3 / 4 * 2 * params / rt.dp_bytes_per_s, rel=1e-9)
