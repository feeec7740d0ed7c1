"""ZeRO-1 keeps 1/dp of a stage's optimizer state, and the workspace shrinks with it at the card's own
workspace fraction (a calibration profile's, not the kind's default)."""
from __future__ import annotations

from dataclasses import replace

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import RunShape
from npu_train.planner.cost import CostModel
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS
from npu_train.planner.rates import DEFAULT_RATES


def test_zero1_workspace_uses_the_cards_fraction():
    cfg, shape, cards = get_preset("smollm2-135m"), RunShape(seq_len=128, micro_batch=2, micro_batches=4), make_cards("cpu", 2, 1 << 40)
    terms = [replace(DEFAULT_MEMORY_TERMS["cpu"], workspace_fraction=0.5)] * 2
    args = (cfg, shape, cards, [DEFAULT_RATES["cpu"]] * 2, None, 1, 2)
    one = CostModel(*args, terms=terms).cost(0, 15, 15).mem
    zero = CostModel(*args, terms=terms, dp=2, zero=1).cost(0, 15, 15).mem
    cut = one["optimizer"] - zero["optimizer"]
    assert cut == one["optimizer"] - int(one["optimizer"] * 0.5)
    assert one["workspace"] - zero["workspace"] == int(cut * 0.5)  # the profile's 50 %, not the default 4 %
    assert one["total"] - zero["total"] == cut + int(cut * 0.5)
