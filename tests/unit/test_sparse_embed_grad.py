"""The first stage's embedding gradient as rows (``StageModule.sparse_embed_grad``, on cpu cards).

Reference from the formula: d loss / d E[v] = sum of the output gradients at the positions whose token id
is v (the lookup ``h[b, s] = E[x[b, s]]`` is a row copy), accumulated over the micro-batches; the other
parameters' gradients must be those of torch's dense embedding backward.
"""
from __future__ import annotations

import pytest
import torch

from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  tie_word_embeddings=True)
EMB = "model.embed_tokens.weight"


def _ids(gen, M=3, b=2, S=7):
    x = torch.randint(0, CFG.vocab_size, (M, b, S), generator=gen)
    x[:, :, 1] = x[:, :, 0]  # repeated ids inside a micro-batch: their rows must add up
    return x


def _grads(module: StageModule, xs, gs, sparse: bool) -> dict:
    module.sparse_embed_grad = sparse
    for p in module.parameters():
        p.grad = None
    if sparse:  # the trainer's contract: a dense .grad before the step's first backward
        module.model.embed_tokens.weight.grad = torch.zeros_like(module.model.embed_tokens.weight)
    for x, g in zip(xs, gs):
        out = module(x)
        out.backward(g) if g is not None else out.float().logsumexp(-1).sum().backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def test_embedding_rows_equal_the_formula_and_the_dense_backward():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    m = StageModule(CFG, 0, 0, has_embed=True, has_head=False)  # no layers: output = the looked-up rows
    xs = _ids(gen)
    gs = [torch.randn(x.shape[0], x.shape[1], CFG.hidden_size, generator=gen) for x in xs]
    seen = []
    h = m.model.embed_tokens.weight.register_hook(lambda g: seen.append(g.layout))
    got = _grads(m, xs, gs, sparse=True)[EMB]
    h.remove()
    assert seen == [torch.sparse_coo] * len(xs)  # rows reached the accumulator, not a dense [V, H] tensor
    assert got.layout == torch.strided
    ref = torch.zeros(CFG.vocab_size, CFG.hidden_size)
    for x, g in zip(xs, gs):
        for v, row in zip(x.reshape(-1).tolist(), g.reshape(-1, CFG.hidden_size)):
            ref[v] += row
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)

    m2 = StageModule(CFG, 0, 2, has_embed=True, has_head=False)
    dense, rows = _grads(m2, xs, gs, sparse=False), _grads(m2, xs, gs, sparse=True)
    assert rows[EMB].layout == torch.strided
    for n in dense:
        torch.testing.assert_close(rows[n], dense[n], rtol=1e-5, atol=1e-7, msg=n)


def test_tied_head_on_the_same_stage():
    """One stage with embedding and tied lm_head (P = 1): the head's dense gradient and the rows add up."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    m = StageModule(CFG, 0, 2, has_embed=True, has_head=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    xs = _ids(gen)
    dense, rows = _grads(m, xs, [None] * len(xs), sparse=False), _grads(m, xs, [None] * len(xs), sparse=True)
    assert rows[EMB].layout == torch.strided
    for n in dense:
        torch.testing.assert_close(rows[n], dense[n], rtol=1e-5, atol=1e-7, msg=n)


def test_no_grad_and_frozen_embedding_use_the_plain_lookup():
    m = StageModule(CFG, 0, 1, has_embed=True, has_head=False)
    m.sparse_embed_grad = True
    x = torch.randint(0, CFG.vocab_size, (2, 5))
    with torch.no_grad():
        a = m(x)
    m.model.embed_tokens.weight.requires_grad_(False)  # LoRA: frozen base
    b = m(x)
    b.sum().backward()
    assert m.model.embed_tokens.weight.grad is None
    torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("kind,dtype,want", [("cpu", torch.float32, True), ("cpu", torch.bfloat16, False),
                                             ("cuda", torch.float32, False), ("furiosa", torch.bfloat16, False)])
def test_kinds_that_take_rows(kind, dtype, want):
    from npu_train.runtime.stagebuild import sparse_embed_grad_for

    params = {EMB: torch.nn.Parameter(torch.zeros(3, 2, dtype=dtype)), "x": torch.nn.Parameter(torch.zeros(2))}
    assert sparse_embed_grad_for(kind, params) is want
    assert sparse_embed_grad_for(kind, {"x": params["x"]}) is False
