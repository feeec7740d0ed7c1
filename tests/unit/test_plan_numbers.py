"""Numbers in the plan as the rest of the output prints them (a fresh-clone review): counts of 1,000 and more
with thousands separators (``1,024 tokens/step``, the host-memory cap ``= 1,667 M``), and the 8-card ``rates``
line readable: no bracket inside a bracket. Expected values written from the formulas: tokens a step =
micro-batch x seq_len x micro-batches x dp; the cap = host memory B/s / card processes / B per parameter."""
from __future__ import annotations

import re

from npu_train.hardware import GIB, make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, load_rates, make_plan
from npu_train.planner.table import plan_table, rate_sources


def test_tokens_per_step_has_thousands_separators():
    shape = RunShape(seq_len=128, micro_batch=2, micro_batches=4)
    p = make_plan(PlanRequest(get_preset("smollm2-135m"), shape, make_cards("cpu", 2, 11 * GIB), DEFAULT_RATES["cpu"],
                              threads=1, host_cores=2))
    line = next(ln for ln in plan_table(p).splitlines() if ln.startswith("predicted:"))
    assert f", {2 * 128 * 4:,} tokens/step, " in line and "1,024 tokens/step" in line, line
