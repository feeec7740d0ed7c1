"""The plan prices vocabulary parallelism's exchange by the path the runtime takes (``runtime.vocab_exchange``;
pipeline/vocabshm.py on one host, gloo across hosts), at the measured shared-memory rates of planner/rates.py."""
from __future__ import annotations

import pytest


def test_the_plan_prices_the_path_the_runtime_takes():
    """``CostModel.vocab_latency``: with ``runtime.vocab_exchange=shm`` and every card on one host, the hidden state
    takes ``e b S H / VOCAB_SHM_X_BYTES_PER_S`` and the partial gradients' sum ``(P / 2) e b S H /
    VOCAB_SHM_SUM_BYTES_PER_S`` (measured at P = 2; the head reads P partials); across hosts (fewer cards per host
    than the job has), and by default, ``e b S H / dp_bytes_per_s`` each (gloo); the statistics ``12 P b S /
    dp_bytes_per_s`` always."""
    from dataclasses import replace as dc_replace

    from npu_train.hardware import make_cards
    from npu_train.model.presets import get_preset
    from npu_train.planner import RunShape, load_rates
    from npu_train.planner.cost import CostModel
    from npu_train.planner.rates import VOCAB_SHM_SUM_BYTES_PER_S, VOCAB_SHM_X_BYTES_PER_S

    m = dc_replace(get_preset("llama-3.1-8b"), num_layers=8, tie_word_embeddings=False)
    P, r = 4, load_rates("furiosa")
    cards = make_cards("furiosa", P, 48 << 30)
    x = 2 * 2 * 512 * m.hidden_size  # bf16, micro-batch 2 x 512 tokens
    stats = 12 * P * 2 * 512 / r.dp_bytes_per_s

    def lat(exchange, per_host=0):
        shape = RunShape(seq_len=512, micro_batch=2, micro_batches=8, schedule="1f1b", dtype="bf16",
                         vocab_parallel=True, vocab_exchange=exchange)
        return CostModel(m, shape, cards, [r] * P, None, 1, 16, cards_per_host=per_host).vocab_latency()

    assert lat("shm") == pytest.approx((x / VOCAB_SHM_X_BYTES_PER_S, stats, 2 * x / VOCAB_SHM_SUM_BYTES_PER_S))
    assert lat("gloo") == pytest.approx((x / r.dp_bytes_per_s, stats, x / r.dp_bytes_per_s))
    assert lat("shm", per_host=2) == lat("gloo")  # two hosts: the runtime keeps gloo
