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
    # every position of the step's sequences: a chat step's line names its trained tokens apart (issue: fresh review)
    assert f"{p.tokens_per_s:,.0f} tokens/s (all positions); " in line, line


def _depth(text: str) -> int:
    """The deepest nesting of brackets of any kind ("[a (b)]": 2, "[a [b]]": 2)."""
    depth = most = 0
    for c in text:
        if c in "[(":
            depth += 1
            most = max(most, depth)
        elif c in "])":
            depth -= 1
    return most


def _eight_card_plan(cards: int = 8):
    shape = RunShape(micro_batch=1, seq_len=2048, micro_batches=16, dtype="bf16")
    return make_plan(PlanRequest(get_preset("llama-3.1-8b"), shape, make_cards("furiosa", cards),
                                 load_rates("furiosa"), threads=1, strict=False))


def test_eight_card_rates_line_has_no_bracket_in_a_bracket():
    """The host AdamW figure of 8 cards is capped by the shared host memory: its source said
    ``[capped: host memory 100 GB/s [assumed: ...] / 8 card processes / 30 B/param = 417 M; 1 thread(s) 1000 M
    [assumed: ... (1.56e9 ...)]]``. Now each figure's source is one level inside the bracket, the bounding figure
    first; the cap is 100 GB/s / 8 processes / 30 B/param = 417 M, under 1 thread's 1,000 M."""
    p = _eight_card_plan()
    line = next(ln for ln in rate_sources(p) if ln.startswith("rates furiosa"))
    assert "[[" not in line.replace(" ", "") and _depth(line) <= 2, line
    for chunk in re.findall(r"\[[^\]]*\]", line):  # inside a [...]: no second [ and parentheses one deep
        assert "[" not in chunk[1:] and _depth(chunk[1:-1]) <= 1, chunk
    cap = 100e9 / 8 / 30 / 1e6
    assert f"host AdamW {cap:,.0f} M params/s [capped: host memory 100 GB/s (assumed: one server socket) / 8 card " \
           f"processes / 30 B/param = {cap:,.0f} M; 1 thread(s) alone: 1,000 M (assumed: " in line, line


def test_the_uncapped_host_rate_names_its_cap_with_separators():
    """2 card processes: the cap 100 GB/s / 2 / 30 B/param = 1,667 M is above 1 thread's 1,000 M: the per-thread
    figure leads, the cap follows with a thousands separator (it printed ``= 1667 M``)."""
    p = _eight_card_plan(2)
    line = next(ln for ln in rate_sources(p) if ln.startswith("rates furiosa"))
    cap = 100e9 / 2 / 30 / 1e6
    assert f"host AdamW 1,000 M params/s [assumed: 1e9 per thread" in line, line
    assert f"; cap: host memory 100 GB/s (assumed: one server socket) / 2 card processes / 30 B/param = {cap:,.0f} M]" \
        in line and "= 1,667 M]" in line, line
    assert _depth(line) <= 2, line
