"""Per-card activation recompute (``train.recompute_layers``, issue 38): each card recomputes whole only its first
``k`` layers in execution order and the others keep their activations. Expected values are written from the
formulas (a layer recomputed whole keeps its input ``[b, S, H]`` and runs its forward again in the backward;
Korthikanti et al. 2022 §4), not from the code under test."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

from npu_train.hardware import make_cards
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.model.presets import get_preset
from npu_train.planner import RunShape, load_rates
from npu_train.planner.cost import CostModel
from npu_train.planner.memory import MemoryModel, activation_bytes_per_layer

GIB = 2 ** 30
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2)


def _forward_calls(module: StageModule, chunks=(None,)) -> Counter:
    """How many times each decoder layer's forward runs over one forward + backward of every chunk in turn."""
    calls: Counter = Counter()
    for name, layer in module.model.layers.items():
        layer.register_forward_pre_hook(lambda m, a, n=name: calls.update([n]))
    x = torch.randint(0, CFG["vocab_size"], (2, 16))
    for c in chunks:
        kw = {} if c is None else {"chunk": c}
        x = module(x, **kw)
    x.float().sum().backward()
    return calls


@pytest.mark.parametrize("k", [0, 2, 4])
def test_only_the_first_k_layers_run_their_forward_again(k):
    """With recompute and ``recompute_layers=k`` of 4 layers: the first k forwards run twice (F and the backward's
    recompute), the others once; None: all of them twice."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG)
    calls = _forward_calls(StageModule(cfg, 0, 4, True, True, recompute=True, recompute_layers=k))
    assert [calls[str(i)] for i in range(4)] == [2] * k + [1] * (4 - k)
    calls = _forward_calls(StageModule(cfg, 0, 4, True, True, recompute=True))
    assert [calls[str(i)] for i in range(4)] == [2] * 4


def test_two_chunks_recompute_chunk_zero_first():
    """A two-chunk card (layers 0-1 then 4-5): ``recompute_layers=3`` recomputes chunk 0's two layers and chunk 1's
    first one (execution order), not layer 5."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG)
    m = StageModule(cfg, 0, 2, True, True, recompute=True, second=(4, 6), recompute_layers=3)
    calls = _forward_calls(m, chunks=(0, 1))
    assert {n: calls[n] for n in ("0", "1", "4", "5")} == {"0": 2, "1": 2, "4": 2, "5": 1}


def test_gradients_do_not_depend_on_which_layers_recompute():
    """Recompute changes memory and time, never values: the same gradients with 0, 2 and all layers recomputed."""
    cfg = LlamaConfig(**CFG)
    grads = []
    for k in (0, 2, None):
        torch.manual_seed(0)
        m = StageModule(cfg, 0, 4, True, True, recompute=True, recompute_layers=k)
        torch.manual_seed(1)
        m(torch.randint(0, CFG["vocab_size"], (2, 16))).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


def test_negative_count_is_refused():
    with pytest.raises(ValueError, match="recompute_layers=-1"):
        StageModule(LlamaConfig(**CFG), 0, 2, True, False, recompute=True, recompute_layers=-1)


def _memory(schedule: str, P: int, M: int, **kw) -> MemoryModel:
    model = get_preset("llama-3.1-8b")
    shape = RunShape(seq_len=2048, micro_batch=1, micro_batches=M, schedule=schedule, recompute=True,
                     recompute_fewest=True, **kw)
    return MemoryModel(model, shape, make_cards("furiosa", P), None)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_held_activations_of_a_one_chunk_card(k):
    """1F1B, a middle card (stage 1 of 4 holds min(M, P - 1) = 3 micro-batches) with 5 layers, k recomputed whole:
    3 x (k inputs + (5 - k) layers' eager activations) + one layer's activations recomputed at a time (k > 0)."""
    mm = _memory("1f1b", 4, 8)
    model, shape = mm.model, mm.shape
    act = activation_bytes_per_layer(model, shape, "eager")
    inp = 2048 * 1 * model.hidden_size * 2
    want = 3 * (k * inp + (5 - k) * act) + (act if k else 0)
    assert mm.activations(1, 5, k=k) == want
    if k == 5:  # every layer recomputed: the shape's own full-recompute figure
        assert mm.activations(1, 5, k=5) == MemoryModel(model, replace(shape, recompute_fewest=False),
                                                        make_cards("furiosa", 4), None).activations(1, 5)


def test_two_chunk_card_recomputes_the_chunk_holding_more():
    """Interleaved: each held chunk micro-batch of chunk 0 keeps ``m0`` layers, of chunk 1 ``m1``; recomputing
    chunk 0's layers first saves more than the same count in chunk 1 would, and k = n matches all recomputed."""
    mm = _memory("interleaved", 4, 8)
    n = 6
    a = [mm.activations(0, n, k=k) for k in range(n + 1)]
    assert all(x > y for x, y in zip(a, a[1:]))  # each layer recomputed whole saves memory
    full = MemoryModel(mm.model, replace(mm.shape, recompute_fewest=False), make_cards("furiosa", 4), None)
    assert a[n] == full.activations(0, n)


def _cost(counts=()) -> tuple[CostModel, MemoryModel]:
    model = get_preset("llama-3.1-8b")
    shape = RunShape(seq_len=2048, micro_batch=1, micro_batches=8, schedule="1f1b", recompute=True,
                     recompute_fewest=True, recompute_counts=counts)
    cards = make_cards("furiosa", 4)
    cm = CostModel(model, shape, cards, [load_rates("furiosa") for _ in cards], None, threads=1, host_cores=8,
                   headroom=0.05)
    return cm, cm.memory


def test_the_fewest_layers_that_fit_and_their_time():
    """Card 1 of 4 with 8 layers: the planner recomputes the smallest k whose memory fits the card's limit (so k - 1
    does not fit), and the backward costs k layer forwards more than with none recomputed: t_b(k) - t_b(0) =
    k x t_f / 8 (the forward is the same for every k; ``t_f`` here is the layers' forward, without the card's
    stage-boundary copies, which ``StageCost.t_f`` also holds)."""
    cm, mm = _cost()
    c = cm.cost(1, 8, 8)
    k = c.recomputed
    cap = cm.limit(1)
    base = cm.rates[1].process_baseline_bytes
    assert mm.stage(1, 8, 8, base, k).mem["total"] <= cap
    assert k == 0 or mm.stage(1, 8, 8, base, k - 1).mem["total"] > cap
    assert 0 < k < 8  # this card needs some, not all (8B at S = 2048 on 8 layers x 3 micro-batches)
    cm0, _ = _cost(counts=(0, 0, 0, 0))
    c0 = cm0.cost(1, 8, 8)
    assert c.t_f == pytest.approx(c0.t_f)
    fwd = c0.t_f - c0.t_copy[0]  # the 8 layers' forward
    assert c.t_copy == c0.t_copy
    assert c.t_b - c0.t_b == pytest.approx(k * fwd / 8, rel=1e-12)
    assert c.t_w == pytest.approx(c0.t_w)
    assert c.t_rc == pytest.approx(k * fwd / 8, rel=1e-12) and c0.t_rc == 0.0  # the plan's recompute column


def test_given_counts_win():
    """``train.recompute_layers=[k0, ...]``: the count given for each card, whatever fits."""
    cm, _ = _cost(counts=(3, 0, 8, 1))
    assert [cm.cost(i, 8, 8).recomputed for i in range(4)] == [3, 0, 8, 1]


def _request(cap: float):
    """Llama-3.2-1B with 8 layers, S = 512, micro-batch 2 x 8, on 2 furiosa cards of ``cap`` bytes (as
    tests/unit/test_schedule_choice.py)."""
    from npu_train.planner import PlanRequest

    m = replace(get_preset("llama-3.2-1b"), num_layers=8)
    shape = RunShape(seq_len=512, micro_batch=2, micro_batches=8, schedule="1f1b", dtype="bf16")
    return PlanRequest(m, shape, make_cards("furiosa", 2, int(cap)), [load_rates("furiosa")] * 2,
                       resident_layers=4, host_ram_bytes=None, strict=False)


def test_auto_recomputes_the_fewest_where_only_recompute_fits():
    """train.schedule=auto falling back on recompute (capacity between the full-recompute plan's need and the least
    any schedule needs without it; train.recompute_attention=false, as test_schedule_choice) plans each card's
    fewest recomputed layers: faster than every layer recomputed, fewer than all 8 recomputed, and the others keep
    their attention core as asked."""
    from npu_train.planner import make_plan
    from npu_train.planner.schedule_choice import CANDIDATES, choose_schedule
    from npu_train.planner.spec import PlacementError

    big = _request(1000 * GIB)
    need_rec = max(st.mem["total"] for st in make_plan(replace(big, shape=replace(big.shape, recompute=True))).stages)
    needs = []
    for s in CANDIDATES:
        try:
            needs.append(max(st.mem["total"] for st in make_plan(replace(big, shape=replace(big.shape,
                                                                                             schedule=s))).stages))
        except (PlacementError, ValueError):
            pass
    req = _request(need_rec + 0.9 * (min(needs) - need_rec))  # [3, 4] of [4, 4] layers recomputed
    got = choose_schedule(req, recompute_attention=False)
    assert got.recompute and got.recompute_fewest and got.plan.fits
    assert not got.plan.shape.recompute_attention
    full = make_plan(replace(req, shape=replace(req.shape, schedule=got.schedule, recompute=True)))
    assert got.plan.step_time_s < full.step_time_s
    assert all(0 <= st.recompute_layers <= st.num_layers for st in got.plan.stages)
    assert sum(st.recompute_layers for st in got.plan.stages) < 8


def test_zero_bubble_card_recomputes_only_its_attention_cores():
    """zb with the attention core recomputed (8B, S = 2048, micro-batch 2): no layer recomputed whole (the count is
    None, whatever the split backward's own scaling), and the recompute column is the cores' forward,
    n x 4 x S x tokens x heads x head_dim FLOPs (Korthikanti et al. 2022 §5) at the card's rate."""
    model = get_preset("llama-3.1-8b")
    shape = RunShape(seq_len=2048, micro_batch=2, micro_batches=16, schedule="zb", recompute_attention=True)
    cards = make_cards("furiosa", 8)
    cm = CostModel(model, shape, cards, [load_rates("furiosa") for _ in cards], None, threads=1, host_cores=8)
    c = cm.cost(1, 4, 4)
    assert c.recomputed is None
    core = 4 * 2048 * (2 * 2048) * model.num_heads * model.head_dim
    assert c.t_rc == pytest.approx(4 * core / cm.rates[1].device_flops, rel=1e-12)


def test_two_chunk_timeline_puts_the_recompute_on_chunk_zero():
    """Interleaved, 2 cards x 6 layers (chunks of 3 and 3), card 0 recomputing 3 layers whole: the runtime recomputes
    the card's first layers in execution order, chunk 0's (``test_two_chunks_recompute_chunk_zero_first``), so in the
    schedule's timeline virtual stage 0's backward carries all three layer forwards again and virtual stage 2 (card 0's
    chunk 1) none: ``B_0 = 3 (b + f)``, ``B_2 = 3 b`` with ``b``, ``f`` one kept layer's backward and forward (from
    card 0 with nothing recomputed), each plus its own boundary copies. Spreading the recompute by layers (1.5 ``f``
    each) would misplace it against the memory model and the runtime."""
    model = replace(get_preset("llama-3.1-8b"), num_layers=12)

    def cm(counts):
        shape = RunShape(seq_len=2048, micro_batch=1, micro_batches=4, schedule="interleaved", recompute=True,
                         recompute_fewest=True, recompute_counts=counts)
        cards = make_cards("furiosa", 2)
        return CostModel(model, shape, cards, [load_rates("furiosa") for _ in cards], None, threads=1, host_cores=8)

    c3, c0 = cm((3, 0)), cm((0, 0))
    k0 = c0.cost(0, 6, 6)
    f = (k0.t_f - k0.t_copy[0]) / 6  # one layer's forward
    b = (k0.t_b - k0.t_copy[1]) / 6  # one kept layer's backward
    costs = [c3.cost(i, 6, 6) for i in range(2)]
    assert costs[0].recomputed == 3
    _, t_b, _ = c3.stage_durations(costs)
    assert t_b[0] - c3.boundary_copies(0)[1] == pytest.approx(3 * (b + f), rel=1e-12)
    assert t_b[2] - c3.boundary_copies(2)[1] == pytest.approx(3 * b, rel=1e-12)
    assert t_b[1] - c3.boundary_copies(1)[1] == pytest.approx(3 * b, rel=1e-12)  # card 1: nothing recomputed
    assert sum(t_b[v] - c3.boundary_copies(v)[1] for v in (0, 2)) == pytest.approx(costs[0].t_b - costs[0].t_copy[1])
