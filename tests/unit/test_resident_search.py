"""The resident-layer search when memory falls with the resident count (fp32 cpu cards).

On a cpu card the offloaded state is host RAM of the same process: a resident fp32 layer holds its
masters as the compute weights plus two moments (8 B/param beyond the weights), an offloaded one a
separate fp32 master plus two moments (12 B/param). Before, ``max_resident`` bisected as if memory
only grew with the count and refused Llama-3.2-1B's shape with 6 layers on 2 cpu cards of 11.18 GiB
('no placement fits even with no resident layers') although every layer resident fits."""
from __future__ import annotations

from dataclasses import replace

import pytest

from npu_train.hardware import make_cards
from npu_train.model.config import LlamaConfig
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, make_plan
from npu_train.planner.cost import CostModel
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS

GIB = 2 ** 30
# Llama-3.2-1B's layer shape with 6 layers, tied 128k vocabulary: 0.63 B parameters
L32_6 = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=6, num_heads=32,
                    num_kv_heads=8, tie_word_embeddings=True, name="llama-3.2-1b-6l")
SHAPE = RunShape(seq_len=256, micro_batch=1, micro_batches=4, schedule="1f1b", dtype="fp32", recompute=False)
LAYER_PARAMS = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048  # q, o + k, v (8 kv heads) + MLP + norms
#: cards that return freed memory (runtime.keep_host_memory=false): without the heap's holes, which grow with
#: the last stage's head transients, one capacity lies between every stage's all- and none-resident totals
TERMS = [replace(DEFAULT_MEMORY_TERMS["cpu"], heap_fraction=0.0)] * 2


def _model(cap_gib: float) -> CostModel:
    cards = make_cards("cpu", 2, int(cap_gib * GIB))
    return CostModel(L32_6, SHAPE, cards, [DEFAULT_RATES["cpu"]] * 2, None, threads=1, host_cores=2, terms=TERMS)


def test_memory_falls_with_each_resident_layer():
    pm = _model(100)
    for n in (2, 3, 4):
        totals = [pm.cost(0, n, r).mem["total"] for r in range(n + 1)]
        # each layer made resident drops at least its separate fp32 master (4 B per parameter of the layer);
        # the last one also moves the embedding's state onto the card
        assert all(a - b >= 4 * LAYER_PARAMS for a, b in zip(totals, totals[1:])), totals


def test_auto_finds_the_resident_counts_that_fit():
    pm = _model(100)
    all_res = max(pm.cost(i, 3, 3).mem["total"] for i in range(2))
    none_res = min(pm.cost(i, 3, 0).mem["total"] for i in range(2))
    assert all_res < none_res
    cap = (all_res + none_res) / 2 / 0.95 / GIB  # every layer resident fits within the headroom, none does not
    plan = make_plan(PlanRequest(L32_6, SHAPE, make_cards("cpu", 2, int(cap * GIB)), DEFAULT_RATES["cpu"], split=[3, 3],
                                 memory_terms=TERMS))
    assert plan.resident_counts == [3, 3]
    assert all(st.mem["total"] <= cap * GIB for st in plan.stages)
    assert _model(cap).max_resident(0, 3) == 3
