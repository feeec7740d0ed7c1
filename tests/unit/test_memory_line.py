"""The plan's memory paragraph in plain words (issue 40): a fresh-clone review found "heap holes 1 x (a
micro-batch's layer activations + 2.5 layers' + 32 MiB, guarded) (a guard returns holes past one backward's
frees)" hard to read. It now says what the heap keeps and what returns the rest, in at most 4 lines of 100
columns, with no "holes" / "guarded" jargon, and that nothing is kept where freed memory is returned."""
from __future__ import annotations

from dataclasses import replace

from npu_train.hardware import GIB, make_cards
from npu_train.metrics.report import fold_long_line
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, make_plan
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS
from npu_train.planner.table import memory_sources


def _memory_line(terms) -> str:
    req = PlanRequest(get_preset("smollm2-135m"), RunShape(seq_len=128, micro_batch=2, micro_batches=4),
                      make_cards("cpu", 2, 11 * GIB), DEFAULT_RATES["cpu"], threads=1, host_cores=2,
                      memory_terms=[terms, terms])
    return next(ln for ln in memory_sources(make_plan(req)) if ln.startswith("memory cpu:"))


def test_the_cpu_memory_paragraph_is_plain_and_short():
    line = _memory_line(DEFAULT_MEMORY_TERMS["cpu"])
    folded = fold_long_line(line).splitlines()
    assert len(folded) <= 4 and max(len(ln) for ln in folded) <= 100, folded
    for jargon in ("holes", "guarded", "const 0.00", "weights/grads/optimizer"):
        assert jargon not in line, (jargon, line)
    assert "freed memory the heap keeps, at most a micro-batch's layer activations + 2.5 layers' + 32 MiB" in line
    assert "a guard returns the rest after each backward" in line
    assert "weights, gradients, optimizer state: exact" in line


def test_returned_freed_memory_is_said_plainly():
    terms = replace(DEFAULT_MEMORY_TERMS["cpu"], heap_fraction=0.0,
                    sources=dict(DEFAULT_MEMORY_TERMS["cpu"].sources,
                                 heap_fraction="runtime.keep_host_memory=false: freed blocks returned"))
    line = _memory_line(terms)
    assert "no freed memory kept (runtime.keep_host_memory=false" in line and "holes" not in line, line


def test_the_measured_workspace_names_its_unit():
    """A fresh-clone review read "(measured: 4 jobs, 0.14-1.24 B)" and could not tell billions of parameters from
    bytes: every count of ``B`` in the paragraph is ``B params`` (model sizes) or ``B/param`` (bytes each)."""
    import re

    line = _memory_line(DEFAULT_MEMORY_TERMS["cpu"])
    assert "0.14-1.24 B params" in line, line
    assert not re.findall(r"\d B\b(?! params|/param)", line), line
