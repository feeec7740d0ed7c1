"""``parallel.vocab=auto``: every schedule candidate is also planned with vocabulary parallelism and keeps it when it
is predicted VOCAB_MARGIN faster. The expected choice is worked out from each schedule's own plans (make_plan with
and without ``RunShape.vocab_parallel``), not from the chooser."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.pipeline.schedule import CHUNKED_SCHEDULES
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan
from npu_train.planner.schedule_choice import CANDIDATES, VOCAB_MARGIN, choose_schedule, chunk_margin
from npu_train.planner.spec import PlacementError

GIB = 2 ** 30


def _req(kind: str, layers: int, vocab: int, tied: bool = False) -> PlanRequest:
    m = replace(get_preset("llama-3.2-1b"), num_layers=layers, tie_word_embeddings=tied, vocab_size=vocab)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=8, schedule="1f1b",
                     dtype="fp32" if kind == "cpu" else "bf16")
    return PlanRequest(m, shape, make_cards(kind, 2, int(47.5 * GIB)), [load_rates(kind)] * 2, host_ram_bytes=None,
                       threads=1, host_cores=2)


def _expected(req):
    """(schedule, vocab) the rule picks: per schedule the vocabulary-parallel plan when VOCAB_MARGIN faster, then the
    fastest schedule with the cards' two-chunk margin against two-chunk ones (first of equals)."""
    best = {}
    for s in CANDIDATES:
        try:
            off, on = (make_plan(replace(req, shape=replace(req.shape, schedule=s, vocab_parallel=v)))
                       for v in (False, True))
        except (PlacementError, ValueError):
            continue
        best[s] = (on, True) if on.step_time_s < off.step_time_s * (1 - VOCAB_MARGIN) else (off, False)
    m = chunk_margin(req.cards)
    cost = {s: p.step_time_s / ((1 - m) if s in CHUNKED_SCHEDULES else 1.0) for s, (p, _) in best.items()}
    s = min(best, key=lambda k: (cost[k], CANDIDATES.index(k)))
    return s, best[s][1], best[s][0].step_time_s


@pytest.mark.parametrize("kind,layers,vocab,want_vocab", [("cpu", 2, 128256, True), ("furiosa", 8, 128256, False)])
def test_auto_keeps_vocabulary_parallelism_only_when_faster(kind, layers, vocab, want_vocab):
    """A head as heavy as the layers on cpu cards (2 layers, 128k vocabulary): vocabulary parallelism wins; on RNGD
    cards with 8 layers the exchange at the assumed gloo rate costs more than the head's share saves."""
    req = _req(kind, layers, vocab)
    s, v, step = _expected(req)
    got = choose_schedule(req, vocab=True)
    assert (got.schedule, got.plan.shape.vocab_parallel) == (s, v)
    assert v == want_vocab
    assert got.plan.step_time_s == pytest.approx(step)
    assert ("vocabulary parallel" in got.why) == v
    plain = choose_schedule(req)  # without parallel.vocab=auto: never
    assert not plain.plan.shape.vocab_parallel


def test_a_tied_head_is_refused_by_the_planner():
    """RunShape.vocab_parallel with a tied embedding and head: a PlacementError naming the fix."""
    req = _req("cpu", 2, 32000, tied=True)
    with pytest.raises(PlacementError, match="use parallel.vocab=false"):
        make_plan(replace(req, shape=replace(req.shape, vocab_parallel=True)))
