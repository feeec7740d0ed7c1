"""LoRA in the placement model and the adapter module."""
from __future__ import annotations

import math

import pytest
import torch

from npu_train.hardware import FURIOSA_CAPACITY_BYTES, Card
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan


def _plan(model, lora_pl, cards=1, resident="auto"):
    shape = RunShape(seq_len=512, micro_batch=1, micro_batches=4, dtype="bf16", lora_params_per_layer=lora_pl)
    cs = [Card(kind="furiosa", index=i, capacity_bytes=FURIOSA_CAPACITY_BYTES, name=f"furiosa:{i}")
          for i in range(cards)]
    return make_plan(PlanRequest(model, shape, cs, [load_rates("furiosa") for _ in cs], resident_layers=resident,
                                 strict=False))


def test_llama8b_lora_fits_one_rngd_card_and_counts_adapters_only():
    from npu_train.model.lora import LoraSpec

    m = get_preset("llama-3.1-8b")
    la = LoraSpec(r=8).params_per_layer(m.hidden_size, m.intermediate_size, m.num_heads * m.head_dim,
                                        m.num_kv_heads * m.head_dim)
    # r * (in + out) over q, k, v, o, gate, up, down of Llama-3.1-8B (H 4096, I 14336, kv 1024)
    assert la == 8 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096))
    lora = _plan(m, la, resident=m.num_layers)  # every adapter's optimizer state on the card
    st = lora.stages[0]
    assert lora.fits and st.mem["total"] <= FURIOSA_CAPACITY_BYTES and len(st.resident) == m.num_layers
    assert st.mem["grads"] == 4 * m.num_layers * la                 # fp32 accumulators of the adapters only
    assert st.mem["optimizer"] == 12 * len(st.resident) * la         # fp32 master + m + v of adapters
    full = _plan(m, 0, resident=m.num_layers)
    assert not full.fits                                             # full fine-tuning, all resident: far over


def test_lora_linear_math_and_init():
    """y = x W^T + (alpha/r) x A^T B^T; B starts at 0 (the adapted model equals the base at step 0)."""
    from npu_train.model.lora import LoraLinear, LoraSpec, init_adapter

    base = torch.nn.Linear(6, 5, bias=False)
    spec = LoraSpec(r=2, alpha=3.0, targets=("q_proj",))
    lin = LoraLinear(base, spec)
    x = torch.randn(4, 6)
    assert torch.equal(lin(x), x @ base.weight.T)
    a, b = torch.randn(2, 6), torch.randn(5, 2)
    with torch.no_grad():
        lin.lora_A.weight.copy_(a)
        lin.lora_B.weight.copy_(b)
    torch.testing.assert_close(lin(x), x @ base.weight.T + 1.5 * (x @ a.T @ b.T))
    assert not lin.weight.requires_grad and lin.lora_A.weight.requires_grad
    a0, b0 = init_adapter("model.layers.0.self_attn.q_proj.weight", (8, 64), (64, 8), seed=1)
    assert torch.count_nonzero(b0) == 0 and a0.abs().max() <= 1 / math.sqrt(64)
    a1, _ = init_adapter("model.layers.0.self_attn.q_proj.weight", (8, 64), (64, 8), seed=1)
    assert torch.equal(a0, a1)  # independent of the stage split: seeded by (seed, name)
