"""Every planner refusal, as the launcher prints it, fits 100 columns and says each fix once (issue 40).

A fresh-clone review saw refusals of 142-451 columns on one line, and an 8-cpu-card Llama-3.1-8B refusal of
~5,000 characters that repeated the same fix for each of the 8 cards and said "21.89 GiB" and "24 GiB" for what
read as the same thing. Here each refusal the planner builds (over capacity with no placement, explicit resident
counts that do not fit, host RAM too small for the offloaded state, layout errors) goes through
:func:`npu_train.errors.refusal_text`; the figures of the 8-cpu-card refusal are checked against the formulas:
usable = capacity x (1 - headroom), the cards' total = 8 x usable, host RAM = 8 x capacity + the launcher's
reserve."""
from __future__ import annotations

import re
import pytest

from npu_train.errors import REFUSAL_COLUMNS, refusal_text
from npu_train.hardware import GIB, LAUNCHER_RESERVE_BYTES, make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlacementError, PlanRequest, RunShape, make_plan

SHAPE = RunShape(seq_len=128, micro_batch=2, micro_batches=4, schedule="1f1b", dtype="fp32")
#: a 24 GB host's RAM split over 8 cpu cards (the review's host)
CPU8_CARD = int(2.88 * GIB)


def _req(model: str, kind: str, n: int, card_bytes: int, shape: RunShape = SHAPE, **kw) -> PlanRequest:
    return PlanRequest(get_preset(model), shape, make_cards(kind, n, card_bytes), DEFAULT_RATES[kind],
                       threads=1, host_cores=2, **kw)


CASES = {
    # the review's refusal: weights, gradients and optimizer state over every card
    "8b-on-8-cpu-cards": _req("llama-3.1-8b", "cpu", 8, CPU8_CARD),
    # the state fits, the activations do not: recompute, micro-batch and heap fixes, said once for both cards
    "activations-on-2-cpu-cards": _req("smollm2-135m", "cpu", 2, 3 * GIB,
                                       RunShape(seq_len=2048, micro_batch=8, micro_batches=4, schedule="1f1b",
                                                dtype="fp32")),
    # accelerators: "more cards", with the fewest count that fits where planned
    "8b-on-2-small-rngd": _req("llama-3.1-8b", "furiosa", 2, 4 * GIB, RunShape(seq_len=512, micro_batch=1,
                                                                                micro_batches=4, dtype="bf16")),
    "resident-counts-over-capacity": _req("llama-3.1-8b", "furiosa", 2, 12 * GIB,
                                          RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16"),
                                          resident_layers=[16, 16]),
    "host-ram-too-small": _req("llama-3.1-8b", "furiosa", 2, 47 * GIB,
                               RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16"),
                               host_ram_bytes=8 * GIB),
    "split-sum": _req("smollm2-135m", "cpu", 2, 8 * GIB, split=[10, 10]),
    "more-cards-than-layers": _req("smollm2-135m", "cpu", 31, 8 * GIB),
    "resident-over-layers": _req("smollm2-135m", "cpu", 2, 8 * GIB, split=[15, 15], resident_layers=[16, 15]),
}


def _refusal(req: PlanRequest) -> str:
    with pytest.raises(PlacementError) as e:
        make_plan(req)
    return refusal_text(str(e.value))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_refusal_fits_100_columns_and_says_each_fix_once(name):
    text = _refusal(CASES[name])
    lines = text.splitlines()
    assert lines[0].startswith("error: ") and all(ln.startswith("  ") for ln in lines[1:]), text
    assert max(len(ln) for ln in lines) <= REFUSAL_COLUMNS, text
    # the message again on one line (what status.json keeps): each fix said once
    flat = " ".join(ln.strip() for ln in lines)
    fixes = re.findall(r"fix: ([^:;(]+)", flat)
    assert len(fixes) == len(set(f.strip() for f in fixes)), fixes
    if name == "8b-on-8-cpu-cards":
        assert flat.count("fix:") == 1 and len(text) < 2600, text  # was one line of 4,034 characters


def test_the_8_cpu_card_refusal_labels_its_gib():
    """Host RAM total, a card's capacity, usable (less placement.headroom) and the plan, each labelled and each
    consistent with the others; no unlabelled "24 GiB" beside "21.89 GiB"."""
    req = CASES["8b-on-8-cpu-cards"]
    flat = " ".join(ln.strip() for ln in _refusal(req).splitlines())
    cap = CPU8_CARD / GIB
    usable = CPU8_CARD * (1 - req.headroom) / GIB
    host = (8 * CPU8_CARD + LAUNCHER_RESERVE_BYTES) / GIB
    assert f"more than the {8 * usable:.2f} GiB usable on the 8 cards together" in flat, flat
    assert f"host RAM {host:.2f} GiB in total: 8 cpu card(s) x {cap:.2f} GiB" in flat, flat
    assert f"usable = a card's capacity ({cap:.2f} GiB) less placement.headroom={req.headroom:g}" in flat, flat
    for plan_gib, usable_gib in re.findall(r"plan ([\d.]+) GiB > usable ([\d.]+) GiB", flat):
        assert float(usable_gib) == pytest.approx(usable, abs=0.006) and float(plan_gib) > usable
    assert f"(this one: {host:.2f} GiB)" in flat, flat
    # every GiB figure is labelled: preceded by one of the quantities' names within a few words
    for m in re.finditer(r"([\d.]+) GiB", flat):
        before = flat[max(0, m.start() - 60):m.start()]
        assert re.search(r"plan|usable|capacity|RAM|need|least|about|one:|x ", before), (m.group(0), before)


def test_refusal_text_folds_at_words_and_keeps_long_words_whole():
    path = "/very/long/" + "x" * 120
    text = refusal_text(f"cannot read {path}: fix it\nfix: another line " + "word " * 40)
    lines = text.splitlines()
    assert any(ln.strip() == path + ":" for ln in lines), text  # a word wider than a line: whole, on its own
    assert all(len(ln) <= REFUSAL_COLUMNS or ln.strip() == path + ":" for ln in lines), text
    assert " ".join(ln.strip() for ln in lines) == ("error: cannot read " + path + ": fix it fix: another line "
                                                     + ("word " * 40).strip())



def test_a_long_first_word_stays_on_the_error_line():
    """A message that starts with a path wider than the line: the path follows ``error:`` on its line (a fresh-clone
    review saw ``error:`` alone, and tests that read the refusal from its ``error: `` missed it)."""
    path = "/tmp/pytest-of-root/" + "y" * 110 + "/stage_000.safetensors:"
    lines = refusal_text(f"{path} cannot read tensor 'w': the shard is truncated").splitlines()
    assert lines[0] == "error: " + path, lines
    assert all(ln.startswith("  ") for ln in lines[1:]) and len(lines) >= 2, lines

def test_the_activation_fixes_are_said_once_for_both_cards():
    flat = " ".join(ln.strip() for ln in _refusal(CASES["activations-on-2-cpu-cards"]).splitlines())
    for fix in ("train.recompute=true", "data.seq_len="):
        assert flat.count(fix) == 1, flat


@pytest.mark.parametrize("width", range(40, 101))
def test_folds_keep_a_number_with_its_unit(width):
    """At every width, the shared fold (refusals, :func:`fold_long_line`, the plan's prose, the end-of-run line)
    never ends a line with a number whose unit or count starts the next: a fresh-clone review saw
    ``... step_000003 (0.0`` / ``  s to publish)`` and ``micro-batch`` / ``  2 x 4`` (issue 40)."""
    from npu_train.metrics.report import fold_long_line
    from npu_train.planner.table import _wrap
    from npu_train.runtime.job import fold_words

    line = ("checkpoint step 3 saved to /tmp/h/run/ckpt/step_000003 (0.0 s to publish); plan: searching (12 s, "
            "3 plan(s)): zb-h2 on 2 cards, dp 2, micro-batch 2 x 4, peak 1.25 GiB, 40 % of 6,940 tok/s; peak: matmul "
            "measured here 153.8 GFLOP/s fp32 at 1 thread(s), 2.5 TFLOP/s, 989 TFLOPS, 3.35 GB/s, 800 MB/s; "
            "16 GiB / 30 B/param = 417 M; host AdamW 1,000 M params/s, 1,234 tokens/s, 8,192 tokens/step, "
            "2 stage(s), 4 replica(s), 15 sequences, 7 layers; loading the model, planning ...")
    for folded in (fold_long_line(line, width), _wrap(line, width), fold_words(line, width),
                   refusal_text(line, width=width)):
        text = " ".join(ln.strip() for ln in folded.splitlines())
        assert text.endswith(line), folded  # nothing lost or changed but the folds
        for pair in ("0.0 s", "12 s", "step 3", "2 cards", "dp 2", "micro-batch 2 x 4", "1.25 GiB", "40 %",
                     "6,940 tok/s",
                     "153.8 GFLOP/s", "1 thread(s)", "2.5 TFLOP/s", "989 TFLOPS", "3.35 GB/s", "800 MB/s",
                     "30 B/param", "= 417 M;", "1,000 M params/s", "1,234 tokens/s", "8,192 tokens/step",
                     "2 stage(s)", "4 replica(s)", "15 sequences", "planning ..."):
            assert any(pair in ln for ln in folded.splitlines()), (pair, folded)
