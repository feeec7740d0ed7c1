"""Selective activation recompute of the attention core (``train.recompute_attention``, issue 38): what a layer
saves, the planner's memory and FLOPs terms, the gradients, and when ``train.schedule=auto`` chooses it. Expected
values are written from the formulas (Korthikanti et al. 2022 §5 adapted to the model's kernel), not from the code
under test."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from npu_train.hardware import make_cards
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import DecoderLayer, rope_cos_sin
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan
from npu_train.planner.cost import CostModel
from npu_train.planner.memory import MemoryModel, activation_bytes_per_layer
from npu_train.planner.schedule_choice import choose_schedule
from npu_train.planner.spec import PlacementError
from saved_bytes import saved_layer_bytes

GIB = 2 ** 30
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
           head_dim=24)


def _saved_bytes(cfg: LlamaConfig, core: bool, dtype, S: int = 64, B: int = 2) -> int:
    """Bytes autograd keeps for one layer's backward (unique storages, parameters and RoPE tables left out, as
    the planner's figures do)."""
    layer = DecoderLayer(cfg, 0, recompute_core=core).to(dtype)
    cos, sin = rope_cos_sin(cfg, S, dtype=dtype)
    return saved_layer_bytes(layer, torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True), cos, sin)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_core_figure_is_what_the_layer_saves(dtype, name):
    """With the core checkpointed the layer keeps the fused-kernel figure less the kernel's fp32 log-sum-exp
    (4 B per head and token): q, k, v stay as the checkpoint's inputs, the output as o_proj's."""
    cfg = LlamaConfig(**CFG)
    S, B = 64, 2
    shape = RunShape(seq_len=S, micro_batch=B, micro_batches=1, schedule="1f1b", dtype=name)
    fused = _saved_bytes(cfg, False, dtype)
    core = _saved_bytes(cfg, True, dtype)
    assert fused - core == 4 * cfg.num_heads * S * B
    assert activation_bytes_per_layer(cfg, shape, "core") == core
    assert activation_bytes_per_layer(cfg, shape, "sdpa") == fused


def test_gradients_equal_with_the_core_recomputed():
    torch.manual_seed(0)
    cfg = LlamaConfig(**CFG)
    a, b = DecoderLayer(cfg, 0), DecoderLayer(cfg, 0, recompute_core=True)
    b.load_state_dict(a.state_dict())
    cos, sin = rope_cos_sin(cfg, 32)
    x = torch.randn(2, 32, cfg.hidden_size)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    a(xa, cos, sin).square().sum().backward()
    b(xb, cos, sin).square().sum().backward()
    assert torch.equal(xa.grad, xb.grad)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n


def _shape(**kw) -> RunShape:
    return RunShape(**{**dict(seq_len=2048, micro_batch=1, micro_batches=16, schedule="zbv", dtype="bf16"), **kw})


def test_planner_terms_of_the_recomputed_core():
    """Memory: every held layer at the ``core`` figure, plus as a transient what one layer's recomputed core keeps
    (fp32 probabilities ``P = 4*a*b*S*S`` and fp32 q, k^T, v: ``P + 12*q*S*b``) and its backward's softmax
    allocates on top (``2*P``), less what the layer's MLP, second norm and ``o_proj`` freed before
    (``(4*e*i + (4 + e)*h + 4 + e*q)*S*b``): ``3*P + 12*q*S*b - freed`` (without the core recomputed
    ``2*P - freed``; ``tests/unit/test_attention_transient.py``); time: the core's forward,
    4 * S * tokens * a * d FLOPs, again in B."""
    m = get_preset("llama-3.1-8b")
    cards = make_cards("furiosa", 8, int(47.5 * GIB))
    rates = [load_rates("furiosa")] * 8
    off, on = _shape(), _shape(recompute_attention=True)
    mm_off, mm_on = MemoryModel(m, off, cards, None), MemoryModel(m, on, cards, None)
    S, a, d = 2048, m.num_heads, m.head_dim
    P = 4 * a * S * S
    freed = (4 * 2 * m.intermediate_size + 6 * m.hidden_size + 4 + 2 * a * d) * S
    assert mm_on.attention_transient == {True: 3 * P + 12 * a * d * S - freed, False: 2 * P - freed}
    per_core = activation_bytes_per_layer(m, on, "core")
    per_eager = activation_bytes_per_layer(m, off, "eager")
    # what the core checkpoint drops of the math kernel's: fp32 probabilities, and q, k^T, v in fp32 + the output
    # in bf16 (14q) in place of q, k, v, o in bf16 (8q); half an eager layer's activations at S = 2048
    assert per_eager - per_core == 4 * a * S * S + S * 6 * a * d
    assert per_eager - per_core > 0.5 * per_eager
    # a middle card (no head, no embedding): the activations scale by the per-layer figure
    i, n = 3, 4
    assert mm_on.activations(i, n) * per_eager == pytest.approx(mm_off.activations(i, n) * per_core, rel=0.02)
    c_off, c_on = CostModel(m, off, cards, rates, None, 1, 16), CostModel(m, on, cards, rates, None, 1, 16)
    core_flops = 4.0 * S * S * a * d
    assert c_on.layer_fbw[0] == c_off.layer_fbw[0] and c_on.layer_fbw[2] == c_off.layer_fbw[2]
    assert c_on.layer_fbw[1] - c_off.layer_fbw[1] == pytest.approx(core_flops)
    # full recompute already runs the whole forward again: nothing more
    full = CostModel(m, _shape(schedule="1f1b", recompute=True, recompute_attention=True), cards, rates, None, 1, 16)
    full0 = CostModel(m, _shape(schedule="1f1b", recompute=True), cards, rates, None, 1, 16)
    assert full.layer_fbw == full0.layer_fbw


def _request(kind: str, gib: float, **shape) -> PlanRequest:
    """Half of Llama-3.1-8B (16 layers) on 4 cards at S = 2048, 8 micro-batches of 1 (a small search)."""
    m = replace(get_preset("llama-3.1-8b"), num_layers=16)
    return PlanRequest(m, _shape(**{"schedule": "1f1b", "micro_batches": 8, **shape}),
                       make_cards(kind, 4, int(gib * GIB)), [load_rates(kind)] * 4, host_ram_bytes=None)


def test_auto_recomputes_the_core_where_the_kernel_keeps_probabilities():
    """RNGD cards of 30 GiB: ZB-V fits only with the core recomputed; auto takes the core-recomputing plan where it
    is faster than the plan without, and says so; ``recompute_attention=False`` keeps it off (a slower step)."""
    req = _request("furiosa", 30.0)
    with pytest.raises(PlacementError):
        make_plan(replace(req, shape=replace(req.shape, schedule="zbv")))
    zbv = make_plan(replace(req, shape=replace(req.shape, schedule="zbv", recompute_attention=True)))
    assert zbv.fits
    ch = choose_schedule(req)
    assert ch.recompute_attention and ch.plan.shape.recompute_attention
    assert f"zbv + attention recompute {zbv.step_time_s:.3g} s" in ch.why
    own = make_plan(replace(req, shape=replace(req.shape, schedule=ch.schedule)))
    assert ch.plan.step_time_s < own.step_time_s  # the same schedule without: slower (or no fit, raising above)
    off = choose_schedule(req, recompute_attention=False)
    assert not off.recompute_attention and off.plan.step_time_s > ch.plan.step_time_s


def test_auto_leaves_fused_kernels_alone():
    """A fused kernel saves no probabilities: no plan with the core recomputed is tried (cuda cards)."""
    ch = choose_schedule(_request("cuda", 80.0, seq_len=512))
    assert not ch.recompute_attention and not ch.plan.shape.recompute_attention
    assert "attention recompute" not in ch.why
