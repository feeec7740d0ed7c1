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


# (node_counts, runtime.transport, dp, P, runtime.vocab_exchange) -> shm expected, written from the rule: every
# card on one host, runtime.transport=shm and vocab_exchange=shm
LAYOUTS = [
    ([2], "shm", 1, 2, "shm", True),            # one host
    ([4], "shm", 2, 2, "shm", True),            # one host, two replicas
    ([4], "shm", 1, 4, "gloo", False),          # the default exchange
    ([4], "inline", 1, 4, "shm", False),        # one host, ZeroMQ TCP boundaries (the plan priced shm)
    ([2, 2], "shm", 1, 4, "shm", False),        # the pipeline across two nodes (TCP at boundary 1)
    ([2, 2], "shm", 2, 2, "shm", False),        # a replica per node: each pipeline's boundary shm, the job's not
    ([3, 1], "shm", 2, 2, "shm", False),        # mixed: replica 1 across the nodes
    ([1, 1], "shm", 1, 2, "shm", False),        # TCP across nodes
]


@pytest.mark.parametrize("node_counts,transport,dp,P,exchange,want", LAYOUTS)
def test_the_plan_launcher_and_cards_agree_on_the_vocab_exchange(node_counts, transport, dp, P, exchange, want):
    """One rule (pipeline/hosts.py::vocab_exchange_shm) in three places: the launcher's /dev/shm check
    (``job.vocab_on_shm``), every card's choice (``StageTrainer._vocab_shm`` on its WorkerSpec: on one node the
    spec has no per-boundary list and takes ``runtime.transport``, across nodes the node plan's) and the plan's
    price (``CostModel.vocab_shm`` from ``cards_per_host = max(node_counts)``, as the launcher plans). The cards
    checked only replica 0's pipeline (a replica per node took shm), the plan ignored ``runtime.transport``."""
    from dataclasses import replace as dc_replace
    from types import SimpleNamespace

    from npu_train.hardware import make_cards
    from npu_train.model.presets import get_preset
    from npu_train.pipeline.hosts import boundary_transports, node_of_rank
    from npu_train.planner import RunShape, load_rates
    from npu_train.planner.cost import CostModel
    from npu_train.runtime.job import vocab_on_shm
    from npu_train.runtime.spec import WorkerSpec
    from npu_train.runtime.trainer import StageTrainer

    world = dp * P
    assert sum(node_counts) == world
    runtime = SimpleNamespace(vocab_exchange=exchange, transport=transport)
    boundary = boundary_transports(node_of_rank(node_counts), transport)
    launcher = vocab_on_shm(SimpleNamespace(parallel=SimpleNamespace(vocab=True), runtime=runtime), boundary)
    per_spec = () if len(node_counts) == 1 else boundary  # build_worker_specs: NodePlan's tuple across nodes
    cards = []
    for rank in range(world):
        spec = SimpleNamespace(runtime=runtime, world_size=world, boundary_transport=per_spec)
        spec.boundary_mode = lambda b, s=spec: WorkerSpec.boundary_mode(s, b)
        cards.append(StageTrainer._vocab_shm(SimpleNamespace(spec=spec, P=P)))
    m = dc_replace(get_preset("smollm2-135m"), num_layers=8, tie_word_embeddings=False)
    shape = RunShape(seq_len=64, micro_batch=1, micro_batches=4, dtype="fp32", vocab_parallel=True,
                     vocab_exchange=exchange, transport=transport)
    plan = CostModel(m, shape, make_cards("cpu", P, 8 << 30), [load_rates("cpu")] * P, None, 1, 16, dp=dp,
                     cards_per_host=max(node_counts)).vocab_shm
    assert (launcher, plan, set(cards)) == (want, want, {want})
    assert vocab_on_shm(SimpleNamespace(parallel=SimpleNamespace(vocab=False), runtime=runtime), boundary) is False
