"""What the math attention kernel (``eager``: RNGD's ``_scaled_dot_product_attention_math``) allocates in one layer's
backward on top of the held graph, against the planner's transient term (``planner/memory.py::
attention_transient_bytes``, ``MemoryModel`` stage ``transient``).

Expected values are written from autograd's formulas for the kernel's ops: the softmax's backward allocates the input
gradient ``[b, a, s, s]`` fp32 (``P = 4*a*b*s*s``) while the probabilities' gradient (another ``P``, from
``attn @ v``'s backward) and the fp32 ``grad_v`` (``4*q`` per token) live: ``2*P + 4*q*s*b``; with the core
recomputed the checkpoint first keeps ``P`` and fp32 q, ``k^T``, v again: ``3*P + 16*q*s*b``. Measured here
allocation by allocation with ``torch.profiler(profile_memory=True)`` (every CPU tensor allocation and free, in
order; no ``torch.cuda``), at shapes where the term dominates (hidden 64, 4 heads of 16, s >= 256): the plan must be
an upper bound and not far above it."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile, record_function

from npu_train.hardware import make_cards
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import DecoderLayer, rope_cos_sin
from npu_train.planner import RunShape
from npu_train.planner.memory import MemoryModel, attention_transient_bytes

GIB = 2 ** 30
A, D = 4, 16


def _cfg(kv_heads: int, layers: int = 1) -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=layers, num_heads=A,
                       num_kv_heads=kv_heads, head_dim=D)


def _peak_above(prof, mark: str) -> int:
    """Highest sum of the profiled allocations less frees (in the order they happened) from the start of the range
    ``mark`` on, less that sum at its start, bytes: the profile must see the held tensors allocated, or it cannot
    see them freed."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    start = next(e.start_ns() for e in events if e.name() == mark)
    live = top = at_start = 0
    for e in events:
        if e.name() == "[memory]":
            if e.start_ns() < start:
                at_start += e.nbytes()
            live += e.nbytes()
            top = max(top, live)
            if e.start_ns() < start:
                top = at_start
    return top - at_start


def _backward_peak(cfg: LlamaConfig, dtype, core: bool, S: int, B: int) -> int:
    """Peak bytes one layer's backward allocates above its held graph through the math kernel (parameters frozen:
    no weight gradients; the output's gradient made before)."""
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, 0, recompute_core=core).to(dtype).requires_grad_(False)
    cos, sin = rope_cos_sin(cfg, S, dtype=dtype)
    x = torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = layer(x, cos, sin)
        grad = torch.ones_like(out)
        with record_function("attention-transient-backward"):
            out.backward(grad)
    return _peak_above(prof, "attention-transient-backward")


def _shape(name: str, S: int, B: int, core: bool) -> RunShape:
    return RunShape(seq_len=S, micro_batch=B, micro_batches=1, schedule="1f1b", dtype=name,
                    recompute_attention=core)


@pytest.mark.parametrize("core", [False, True], ids=["held", "core-recomputed"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype,name", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("S,B", [(512, 1), (256, 2)])
def test_planned_transient_bounds_the_math_kernels_backward(dtype, name, kv_heads, core, S, B):
    cfg = _cfg(kv_heads)
    P, q_tokens = 4 * A * B * S * S, A * D * S * B
    planned = attention_transient_bytes(cfg, _shape(name, S, B, core), core)
    assert planned == (3 * P + 16 * q_tokens if core else 2 * P + 4 * q_tokens)  # the formula, written out
    measured = _backward_peak(cfg, dtype, core, S, B)
    assert measured <= planned <= 1.3 * measured, (measured / P, planned / P)


def test_a_furiosa_stage_plans_the_transient():
    """A middle RNGD stage (no embedding, no head, one micro-batch: no accumulation temporary) of one layer: the
    plan's transient term covers the measured backward peak of the layer's attention, fp32, held and recomputed;
    a cuda card (fused kernel, nothing ``[s, s]``) plans it less the term."""
    S, B = 512, 1
    cfg = _cfg(2, layers=3)
    for core in (False, True):
        shape = _shape("fp32", S, B, core)
        furiosa = MemoryModel(cfg, shape, make_cards("furiosa", 3, 40 * GIB), None).stage(1, 1, 1, 0.0)
        measured = _backward_peak(_cfg(2), torch.float32, core, S, B)
        assert furiosa.mem["transient"] >= measured
        cuda = MemoryModel(cfg, shape, make_cards("cuda", 3, 40 * GIB), None).stage(1, 1, 1, 0.0)
        assert furiosa.mem["transient"] - cuda.mem["transient"] == attention_transient_bytes(cfg, shape, core)
