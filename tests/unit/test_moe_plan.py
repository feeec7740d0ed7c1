"""The planner's mixture-of-experts terms (planner/moe.py), from the formulas: memory counts every expert, compute
the top-k active ones, routed activations are bounded by k x tokens whatever the balance, LoRA puts adapters on
each expert; the presets' totals; a plan on 8 RNGD cards or a clear refusal."""
from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch

from npu_train.hardware import FURIOSA_CAPACITY_BYTES, Card
from npu_train.model.config import LlamaConfig
from npu_train.model.presets import get_preset
from npu_train.planner import (
    PlacementError,
    PlanRequest,
    RunShape,
    activation_bytes_per_layer,
    balanced_split,
    load_rates,
    make_plan,
)
from npu_train.planner.cost import CostModel
from npu_train.planner.memory import MemoryModel, pending_grad_bytes_per_layer
from npu_train.planner.moe import (
    largest_layer_tensor,
    lora_layer_params,
    lora_params_per_layer,
    mlp_pending_bytes_per_token,
    mlp_saved_bytes_per_token,
    routed_saved_bytes_per_token,
    router_saved_bytes_per_token,
    shared_saved_bytes_per_token,
)

# hidden 8, heads 2 x head_dim 4 (q 8), 1 kv head (kv 4), 4 experts of width 6, top-2; Qwen3 (q/k norms)
TINY = dict(vocab_size=100, hidden_size=8, intermediate_size=16, num_layers=4, num_heads=2, num_kv_heads=1,
            head_dim=4, family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
            norm_topk_prob=True, name="tiny-moe")
# one layer by hand: norms 8 + 8, q 8x8, k 4x8, v 4x8, o 8x8, q_norm 4, k_norm 4, router 4x8,
# 4 experts x (gate 6x8 + up 6x8 + down 8x6 = 144)
LAYER = 8 + 8 + 64 + 32 + 32 + 64 + 4 + 4 + 32 + 4 * 144
ACTIVE = LAYER - (4 - 2) * 144  # the 2 experts a token is not sent to
# LoRA r=2 on every target: q 2(8+8), k 2(8+4), v 2(8+4), o 2(8+8); per expert gate 2(8+6), up 2(8+6), down 2(6+8)
ATTN_LORA = 32 + 24 + 24 + 32
EXPERT_LORA = 28 + 28 + 28
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny(**kw) -> LlamaConfig:
    return LlamaConfig(**{**TINY, **kw})


def _cards(n: int) -> list[Card]:
    return [Card(kind="furiosa", index=i, capacity_bytes=FURIOSA_CAPACITY_BYTES, name=f"furiosa:{i}")
            for i in range(n)]


def test_tiny_layer_counts_by_hand():
    m = _tiny()
    assert (LAYER, ACTIVE) == (824, 536)
    assert m.params_per_layer() == LAYER and m.active_params_per_layer() == ACTIVE
    assert largest_layer_tensor(m) == 64  # q/o 8x8 beat one expert's 6x8 and the router's 4x8


def test_weights_grads_optimizer_count_every_expert():
    """A middle stage (no embedding or head) of 2 layers, all resident: e, 4 and 12 B per parameter of *all*
    experts; with LoRA the adapters of every expert."""
    m = _tiny()
    mm = MemoryModel(m, RunShape(seq_len=16, dtype="bf16"), _cards(3), None)
    p = mm.parameters(1, 2, 2)
    assert (mm.weights(p), mm.gradients(p), mm.optimizer_state(1, p)) == (2 * 2 * 824, 4 * 2 * 824, 12 * 2 * 824)
    total, active = lora_params_per_layer(m, 2, ALL_TARGETS)
    assert (total, active) == (ATTN_LORA + 4 * EXPERT_LORA, ATTN_LORA + 2 * EXPERT_LORA) == (448, 280)
    lm = MemoryModel(m, RunShape(seq_len=16, dtype="bf16", lora_params_per_layer=total,
                                 lora_active_params_per_layer=active), _cards(3), None)
    p = lm.parameters(1, 2, 2)
    assert (lm.weights(p), lm.gradients(p), lm.optimizer_state(1, p)) == (
        2 * 2 * (824 + 448), 4 * 2 * 448, 12 * 2 * 448)


def test_compute_counts_active_parameters():
    """FLOPs per micro-batch of one layer: forward 2 x active params x tokens + 4 x attention, input gradient
    2 x active x tokens + 8 x attention, weight gradient 2 x active x tokens (LoRA: the active adapters')."""
    m = _tiny()
    tok = 16
    attn = 16 * tok * 2 * 4  # s * tokens * heads * head_dim

    def fbw(shape):
        cm = CostModel(m, shape, _cards(2), [load_rates("furiosa")] * 2, None, threads=1, host_cores=2)
        return cm.layer_fbw

    assert fbw(RunShape(seq_len=16)) == (2 * 536 * tok + 4 * attn, 2 * 536 * tok + 8 * attn, 2 * 536 * tok)
    lora = RunShape(seq_len=16, lora_params_per_layer=448, lora_active_params_per_layer=280)
    assert fbw(lora) == (2 * (536 + 280) * tok + 4 * attn, 2 * (536 + 280) * tok + 8 * attn, 2 * 280 * tok)
    # without an active count the adapters count in full (a dense model's)
    assert fbw(RunShape(seq_len=16, lora_params_per_layer=448))[2] == 2 * 448 * tok


def test_activation_bytes_of_a_sparse_layer_by_hand():
    """sdpa, bf16, S=16, b=1, per token: norms 2(4+2e)h + 8, attention 4eq + 4a, routed experts
    k(e(2h + 4I_e) + 4 + 24), router E(e + 4) + 12k + 4; plus Qwen3's q/k norms (4 + e)(q + kv) + 4(a + a_kv)."""
    m, shape = _tiny(), RunShape(seq_len=16, dtype="bf16")
    routed = 2 * (2 * (16 + 24) + 4 + 24)
    router = 4 * (2 + 4) + 12 * 2 + 4
    assert (routed, router) == (216, 52)
    assert (routed_saved_bytes_per_token(m, 2), router_saved_bytes_per_token(m, 2)) == (routed, router)
    qk = 16 * ((4 + 2) * (8 + 4) + 4 * (2 + 1))
    assert activation_bytes_per_layer(m, shape, "sdpa") == 16 * (2 * 8 * 8 + 8 + 4 * 2 * 8 + 4 * 2 + 216 + 52) + qk
    # eager (math kernel): norms as sdpa, attention (12 + e)q, no log-sum-exp, fp32 probabilities 4*a*b*s*s
    assert activation_bytes_per_layer(m, shape, "eager") == 16 * (2 * 8 * 8 + 8 + 14 * 8 + 216 + 52) + 4 * 2 * 16 * 16 + qk
    # B->W output gradients: q + 2kv + o's h, + router logits E + k copies of (down h + gate/up 2 I_e)
    assert pending_grad_bytes_per_layer(m, shape) == 16 * 2 * (8 + 8 + 8 + 4 + 2 * (8 + 12))
    # top-k 4 of 4: twice the routed rows, the router's top-k arrays too
    assert routed_saved_bytes_per_token(_tiny(num_experts_per_tok=4), 2) == 2 * 216


def test_dense_models_keep_their_figures():
    """For a dense model the MLP terms are the SwiGLU ones, 4ei and e(h + 2i), and the largest tensor gate/up."""
    m = get_preset("llama-3.1-8b")
    for e in (2, 4):
        assert mlp_saved_bytes_per_token(m, e) == 4 * e * 14336
        assert mlp_pending_bytes_per_token(m, e) == e * (4096 + 2 * 14336)
    assert largest_layer_tensor(m) == 4096 * 14336
    assert lora_params_per_layer(m, 8, ALL_TARGETS) == (8 * (2 * 8192 + 2 * 5120 + 3 * 18432),) * 2


def test_mixed_layers_plan_the_larger_kind():
    """mlp_only_layers / decoder_sparse_step: dense layers keep a width-16 MLP; every layer is planned as the
    larger kind (here the sparse one by parameters, the dense one where its MLP saves more)."""
    m = _tiny(mlp_only_layers=(0,), decoder_sparse_step=2)
    assert m.moe_layers() == [1, 3]
    dense_mlp = 4 * 2 * 16  # 4ei
    sparse_mlp = 216 + 52
    assert mlp_saved_bytes_per_token(m, 2) == max(dense_mlp, sparse_mlp)
    wide = _tiny(mlp_only_layers=(0,), intermediate_size=64)
    assert mlp_saved_bytes_per_token(wide, 2) == 4 * 2 * 64 > sparse_mlp
    dense_lora = ATTN_LORA + 2 * (2 * (8 + 16)) + 2 * (16 + 8)
    assert lora_layer_params(m, 0, 2, ALL_TARGETS) == (dense_lora, dense_lora)
    assert lora_params_per_layer(m, 2, ALL_TARGETS) == (448, max(280, dense_lora))


def test_lora_counts_per_expert_shared_expert_and_router():
    m = _tiny()
    assert lora_layer_params(m, 0, 2, ("q_proj", "v_proj")) == (56, 56)  # attention only: no expert adapters
    assert lora_layer_params(m, 0, 2, ("down_proj",)) == (4 * 28, 2 * 28)
    assert lora_layer_params(m, 0, 2, ("down_proj",), train_router=True) == (4 * 28 + 32, 2 * 28 + 32)
    mix = _tiny(family="mixtral")  # gate_proj/up_proj/down_proj name its experts' w1/w3/w2
    assert lora_layer_params(mix, 0, 2, ALL_TARGETS[4:]) == (4 * 84, 2 * 84)
    q2 = _tiny(family="qwen2_moe", shared_expert_intermediate_size=10)
    shared = 3 * 2 * (8 + 10)  # the shared expert's gate, up, down adapters, active for every token
    assert lora_layer_params(q2, 0, 2, ALL_TARGETS[4:]) == (4 * 84 + shared, 2 * 84 + shared)
    assert lora_layer_params(q2, 0, 2, (), train_router=True) == (32 + 8, 32 + 8)  # router + shared gate [1, h]
    with pytest.raises(ValueError, match="unknown LoRA target 'w1'"):
        lora_layer_params(mix, 0, 2, ("w1",))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("targets", [ALL_TARGETS, ("q_proj", "down_proj"), ("up_proj",)])
@pytest.mark.parametrize("train_router", [False, True])
def test_lora_counts_equal_what_the_model_trains(family, targets, train_router):
    """The planner's adapter count per layer is what model/lora.py makes train (its names and shapes), on a
    sparse and on a dense (mlp_only_layers) layer."""
    import math

    from npu_train.model.lora import LoraSpec, adapter_shapes

    m = _tiny(family=family, mlp_only_layers=(1,), shared_expert_intermediate_size=10 if family == "qwen2_moe" else 0)
    spec = LoraSpec(r=2, targets=targets, train_router=train_router)
    for layer in (0, 1):
        trained = sum(math.prod(s) for s in adapter_shapes(m, layer, spec).values())
        assert lora_layer_params(m, layer, 2, targets, train_router).total == trained


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd still holds for the backward of ``block(x)`` (a node whose outputs
    are all dropped frees what it saved), parameters and the input excluded."""
    skip = {p.untyped_storage().data_ptr() for p in block.parameters()} | {x.untyped_storage().data_ptr()}
    saved: list = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(x)
    alive = {}
    for ref in saved:
        t = ref()
        if t is not None and t.untyped_storage().data_ptr() not in skip:
            alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    del out
    return sum(alive.values())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("balance", ["random", "two experts take every token"])
@pytest.mark.parametrize("aux", [False, True])
def test_routed_activation_bound_holds_whatever_the_balance(family, dtype, balance, aux):
    """What the project's sparse block (model/moe.py) saves for T tokens is at most the bound, for a random router
    and for one sending every token to the same top-k experts (the k x T routed rows fix the total, not how
    they spread), aux loss on or off; and tight: less only the aux loss's compute-dtype softmax (when it is off
    or the logits are fp32) and, where the routing weights are in the compute dtype (Qwen), 4 - e B per row."""
    from npu_train.model.moe import RouterRecorder, SparseMoe

    m = _tiny(family=family, hidden_size=16, num_experts=8, moe_intermediate_size=12,
              shared_expert_intermediate_size=20 if family == "qwen2_moe" else 0)
    torch.manual_seed(0)
    rec = RouterRecorder()
    block = SparseMoe(m, 0, rec).to(dtype)
    if balance != "random":
        with torch.no_grad():
            block.gate.weight.zero_()
            block.gate.weight[0] += 1.0
            block.gate.weight[1] += 0.5
    if aux:
        rec.start(with_probs=True)
    T, e, E, k = 64, torch.finfo(dtype).bits // 8, m.num_experts, m.num_experts_per_tok
    x = torch.randn(1, T, 16, dtype=dtype, requires_grad=True)
    bound = T * (routed_saved_bytes_per_token(m, e) + router_saved_bytes_per_token(m, e)
                 + shared_saved_bytes_per_token(m, e))
    assert bound == T * mlp_saved_bytes_per_token(m, e)
    saved = _saved_bytes(block, x)
    assert saved <= bound
    aux_terms = 0 if (aux and e != 4) else E * e
    weights = 0 if family == "mixtral" else k * (4 - e)
    assert saved == bound - T * (aux_terms + weights)


# ---------------------------------------------------------------- presets and plans
@pytest.mark.parametrize("name,total,active", [
    # model.safetensors.index.json metadata.total_size / 2 (bf16) of Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
    # mistralai/Mixtral-8x7B-v0.1; active: attention + router + top-k experts per layer, embedding, final norm
    # and lm_head (3.3 B, 22 B and 12.9 B as published)
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
    ("qwen3-235b-a22b", 235_093_634_560, 22_190_763_520),
    ("mixtral-8x7b", 46_702_792_704, 12_879_925_248),
])
def test_moe_presets_match_published_totals(name, total, active):
    m = get_preset(name)
    assert m.total_params() == total
    assert m.num_layers * m.active_params_per_layer() + 2 * m.embedding_params() + m.hidden_size == active


def _plan8(name: str, lora: bool):
    """The plan on 8 RNGD cards at S=512, 8 micro-batches of 1, on the balanced split (the split search is
    test_split_search_cost.py's; the CLI records in experiments/2026-12-06-moe-plan.md run it)."""
    m = get_preset(name)
    counts = lora_params_per_layer(m, 8, ALL_TARGETS) if lora else (0, 0)
    s = RunShape(seq_len=512, micro_batch=1, micro_batches=8, dtype="bf16",
                 lora_params_per_layer=counts[0], lora_active_params_per_layer=counts[1])
    cards = _cards(8)
    return make_plan(PlanRequest(m, s, cards, [load_rates("furiosa") for _ in cards], threads=1, host_cores=2,
                                 split=balanced_split(m.num_layers, 8)))


def test_qwen3_30b_a3b_plans_on_8_rngd_cards_full_and_lora():
    full, lora = _plan8("qwen3-30b-a3b", False), _plan8("qwen3-30b-a3b", True)
    assert full.fits and lora.fits and sum(full.split) == sum(lora.split) == 48
    assert any(st.offloaded for st in full.stages)  # 30.5 B params x 12 B of optimizer state: offloaded
    assert all(not st.offloaded for st in lora.stages)
    w = sum(st.mem["weights"] for st in full.stages)
    assert w == 2 * (30_532_122_624)  # every expert's weights on the cards (untied: no copy)


def test_qwen3_235b_refuses_on_8_rngd_cards_naming_the_weights():
    with pytest.raises(PlacementError, match=r"(?s)weights and gradients alone need .* GiB, more than the .* GiB usable "
                       r"on the 8 cards together.*fix: more cards \(at least \d+ "):
        _plan8("qwen3-235b-a22b", True)


@pytest.mark.parametrize("aux", [False, True])
def test_bound_line_advises_no_schedule_the_aux_loss_refuses(aux):
    """A bubble-bound plan (8 cards, 1 micro-batch) names zb-h2 as a lever only where it runs: with the
    load-balancing loss on (1f1b / gpipe only) it names train.moe_aux_loss=0 with it, and that pair is accepted."""
    from npu_train.pipeline.moeaux import check_aux_schedule
    from npu_train.planner.table import bound_line

    m = get_preset("qwen3-30b-a3b")
    counts = lora_params_per_layer(m, 8, ALL_TARGETS)
    s = RunShape(seq_len=512, micro_batch=1, micro_batches=1, dtype="bf16", moe_aux_loss=aux,
                 lora_params_per_layer=counts[0], lora_active_params_per_layer=counts[1])
    cards = _cards(8)
    plan = make_plan(PlanRequest(m, s, cards, [load_rates("furiosa") for _ in cards], threads=1, host_cores=2,
                                 split=balanced_split(m.num_layers, 8)))
    line = bound_line(plan)
    assert line.startswith("bound: the pipeline bubble")
    assert "train.schedule=zb-h2" in line
    assert ("train.schedule=zb-h2) only with train.moe_aux_loss=0" in line) is aux
    check_aux_schedule(0.0, "zb-h2")  # what it advises is not refused


def test_run_shape_says_whether_the_aux_loss_is_on():
    from omegaconf import OmegaConf

    from npu_train.config import Config
    from npu_train.runtime.job import run_shape

    m = get_preset("qwen3-30b-a3b")  # router_aux_loss_coef 0.001, output_router_logits false: off by default
    for override, on in ((None, False), (0.01, True), (0.0, False)):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(
            ["model.path=qwen3-30b-a3b", "plan=true", "train.schedule=1f1b"] + ([] if override is None else [f"train.moe_aux_loss={override}"])))
        assert run_shape(cfg, m, "bf16").moe_aux_loss is on
    assert run_shape(cfg, get_preset("llama-3.2-1b"), "bf16").moe_aux_loss is False


def test_too_few_cards_names_the_fewest_that_fit():
    """Qwen3-30B-A3B full fine-tuning on 2 RNGD cards: its weights and gradients alone (170.6 GiB) need 4 cards
    of 45.1 GiB, but 4 do not fit (activations, workspace): the fix names the count that does, checked here by
    planning on it and on one card fewer."""
    import re

    m = get_preset("qwen3-30b-a3b")
    s = RunShape(seq_len=512, micro_batch=1, micro_batches=8, dtype="bf16")

    def req(n):
        cards = _cards(n)
        return PlanRequest(m, s, cards, [load_rates("furiosa") for _ in cards], threads=1, host_cores=2)

    with pytest.raises(PlacementError) as e:
        make_plan(req(2))
    got = re.search(r"fix: more cards \((\d+) such cards, the fewest that fit\)", str(e.value))
    assert got, str(e.value)
    n = int(got.group(1))
    assert n > 4 and make_plan(replace(req(n), strict=False)).fits
    assert not make_plan(replace(req(n - 1), strict=False)).fits


def test_weights_over_the_cards_refuse_without_planning_each_schedule(monkeypatch):
    """Qwen3-235B-A22B full fine-tuning on 8 RNGD cards: bf16 weights + fp32 gradient accumulators, 6 B/param x
    235.1 B params = 1313.7 GiB, exceed the 8 cards' 8 x 47.5 x 0.95 = 361 GiB together, on every split and under
    every schedule and recompute (they move activations only). ``train.schedule=auto`` then plans once, 1F1B's
    refusal naming the weights and a card count, and searches no split on the 8 cards (it planned every candidate,
    54 plans and 89 CPU s, before); Qwen3-30B-A3B (183.2 GiB) is not ruled out by the bound."""
    import npu_train.planner.schedule_choice as sc
    import npu_train.planner.search as search

    def req(name: str) -> PlanRequest:
        s = RunShape(seq_len=2048, micro_batch=1, micro_batches=8, dtype="bf16")
        cards = _cards(8)
        return PlanRequest(get_preset(name), s, cards, [load_rates("furiosa") for _ in cards], threads=1,
                           host_cores=8)

    room = 8 * FURIOSA_CAPACITY_BYTES * (1 - 0.05)
    assert 6 * get_preset("qwen3-235b-a22b").total_params() > room > 6 * get_preset("qwen3-30b-a3b").total_params()
    assert search.state_floor_over_cards(req("qwen3-235b-a22b"))
    assert not search.state_floor_over_cards(req("qwen3-30b-a3b"))
    searched, planned = [], []
    real_search, real_plan = search.fastest_split, sc.make_plan

    def count_search(pm, *a, **k):
        searched.append(pm.P)
        return real_search(pm, *a, **k)

    def count_plan(r):
        planned.append(r.shape.schedule)
        assert len(planned) == 1, planned  # a second candidate: fail now, not after 54 plans
        return real_plan(r)

    monkeypatch.setattr(search, "fastest_split", count_search)
    monkeypatch.setattr(sc, "make_plan", count_plan)
    with pytest.raises(PlacementError, match=r"(?s)on any split: the weights and gradients alone need 1313\.69 GiB, "
                       r"more than the 361\.00 GiB usable on the 8 cards together.*fix: more cards \(at least \d+ "):
        sc.choose_schedule(req("qwen3-235b-a22b"), "auto", True)
    assert planned == ["1f1b"]
    assert 8 not in searched  # (the fix's card counts, 30 and more, are planned)
