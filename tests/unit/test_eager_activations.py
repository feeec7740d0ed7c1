"""The planner's ``eager`` activation figure (``planner/memory.py::activation_bytes_per_layer``, the attention kernel
that keeps the probabilities: RNGD's ``_scaled_dot_product_attention_math``) against what autograd saves for one
decoder layer run through PyTorch's math kernel, fp32 and bf16, with and without grouped-query attention.

Expected values are written from the kernel's source (``aten/src/ATen/native/transformers/attention.cpp``,
``_scaled_dot_product_attention_math``): next to what the fused kernel saves, it keeps fp32 copies of q and the
scaled ``k^T`` (matmul's inputs), the fp32 v, the fp32 probabilities ``[b, a, s, s]``, and o_proj keeps its
output in the compute dtype; it has no log-sum-exp. The figure must be an upper bound (the plan's promise) and
not far above it."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

from npu_train.model.config import LlamaConfig
from npu_train.model.llama import DecoderLayer, rope_cos_sin
from npu_train.planner import RunShape
from npu_train.planner.memory import activation_bytes_per_layer
from saved_bytes import saved_layer_bytes

S, B = 64, 2
DTYPES = [(torch.float32, "fp32", 4), (torch.bfloat16, "bf16", 2)]


def _cfg(kv_heads: int, family: str = "llama") -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                       num_kv_heads=kv_heads, head_dim=24, family=family)


def _saved_bytes(cfg: LlamaConfig, dtype, math: bool) -> int:
    """Bytes autograd keeps for one layer's backward: unique storages, parameters and the RoPE tables left out
    (as the planner's figures do); ``math``: attention through ``sdpa_kernel(SDPBackend.MATH)``."""
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0).to(dtype)
    cos, sin = rope_cos_sin(cfg, S, dtype=dtype)
    x = torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True)
    return saved_layer_bytes(layer, x, cos, sin, kernel=SDPBackend.MATH if math else SDPBackend.FLASH_ATTENTION)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype,name,e", DTYPES, ids=["fp32", "bf16"])
def test_math_kernel_saves_what_its_source_says(dtype, name, e, kv_heads):
    """Math kernel less fused kernel, per token: q, k^T, v in fp32 (3 x 4q) and the output in the compute dtype
    (e*q) in place of q, k, v, o in the compute dtype (4eq) and the log-sum-exp (4a); plus 4*a*s probabilities."""
    cfg = _cfg(kv_heads)
    q, a, tokens = cfg.num_heads * cfg.head_dim, cfg.num_heads, S * B
    extra = tokens * ((3 * 4 + e) * q - 4 * e * q - 4 * a) + 4 * a * B * S * S
    assert _saved_bytes(cfg, dtype, math=True) - _saved_bytes(cfg, dtype, math=False) == extra


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype,name,e", DTYPES, ids=["fp32", "bf16"])
def test_eager_figure_bounds_the_math_kernel(dtype, name, e, kv_heads, family):
    """The plan's ``eager`` figure is at least what the layer keeps through the math kernel, and within 2 % of it
    (qwen3: with its per-head q/k norms)."""
    cfg = _cfg(kv_heads, family)
    held = _saved_bytes(cfg, dtype, math=True)
    shape = RunShape(seq_len=S, micro_batch=B, micro_batches=1, schedule="1f1b", dtype=name)
    figure = activation_bytes_per_layer(cfg, shape, "eager")
    assert held <= figure <= 1.02 * held, (figure, held)


def test_eager_figure_by_hand():
    """Llama-3.1-8B shapes (h 4096, q 4096, i 14336, 32 heads), bf16, S = 512, b = 1, per token: norms
    2(4 + 2e)h + 8, attention (12 + e)q, MLP 4ei; plus 4*a*s*s fp32 probabilities."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128)
    shape = RunShape(seq_len=512, micro_batch=1, micro_batches=1, schedule="1f1b", dtype="bf16")
    per_token = 2 * 8 * 4096 + 8 + 14 * 4096 + 8 * 14336
    assert activation_bytes_per_layer(cfg, shape, "eager") == 512 * per_token + 4 * 32 * 512 * 512 == 155_193_344


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype,name,e", DTYPES, ids=["fp32", "bf16"])
def test_cpu_cards_run_the_fused_kernel(dtype, name, e, kv_heads, packed):
    """Why cpu cards plan with the ``sdpa`` figure: PyTorch's default choice on CPU for the model's attention, causal
    or with packed rows' additive mask (two samples a row, ``model/masks.py``), keeps only the fused kernel's
    tensors (the mask, ``b*s*s*e``, is the micro-batch's, counted once per micro-batch by the planner), not the
    math kernel's probabilities."""
    from npu_train.model.masks import additive_mask, packed_causal_mask

    cfg = _cfg(kv_heads)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0).to(dtype)
    cos, sin = rope_cos_sin(cfg, S, dtype=dtype)
    mask = None
    if packed:
        positions = torch.cat([torch.arange(S // 2), torch.arange(S - S // 2)]).repeat(B, 1)
        mask = additive_mask(packed_causal_mask(positions), dtype)
    x = torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True)
    held = saved_layer_bytes(layer, x, cos, sin, mask)
    shape = RunShape(seq_len=S, micro_batch=B, micro_batches=1, schedule="1f1b", dtype=name)
    assert held == activation_bytes_per_layer(cfg, shape, "sdpa") + (B * S * S * e if packed else 0)
