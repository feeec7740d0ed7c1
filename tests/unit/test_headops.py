"""The fused head (npu_train.model.headops): one-pass cross-entropy and the weight gradient accumulated
inside the matmul, against references written from the definitions in fp64.

- ``cross_entropy_sum``: loss = sum over counted tokens of ``logsumexp(z) - z[label]``; gradient
  ``softmax(z) - onehot(label)`` on counted rows, 0 on ignored ones.
- ``HeadLinear`` with ``fused_grad``: after M micro-batches ``W.grad`` = sum of ``g_m^T x_m`` (fp64
  reference), the same tensor object from the second micro-batch on (autograd took it back: if a torch
  release stops doing so, the fused path would copy 113 MB per micro-batch and this test says so), the
  post-accumulate hooks once per micro-batch, and the split backward (B then W) bit for bit equal to
  the fused full backward, with W doing the head's weight product as one ``addmm``.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from npu_train.model.config import LlamaConfig
from npu_train.model.headops import IGNORE_INDEX, HeadLinear, cross_entropy_sum
from npu_train.model.llama import StageModule, causal_lm_loss_sum
from npu_train.pipeline.backward import backward_input

CFG = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2)


def _ref_ce(z: torch.Tensor, y: torch.Tensor):
    """(loss, dloss/dz) in fp64 from the definition."""
    z = z.double()
    lse = torch.log(torch.exp(z - z.max(1, keepdim=True).values).sum(1)) + z.max(1).values
    keep = y != IGNORE_INDEX
    loss = sum(float(lse[i] - z[i, y[i]]) for i in range(z.shape[0]) if keep[i])
    grad = torch.exp(z - lse[:, None])
    for i in range(z.shape[0]):
        if keep[i]:
            grad[i, y[i]] -= 1.0
        else:
            grad[i] = 0.0
    return loss, grad


@pytest.mark.parametrize("ignored", [0, 5])
def test_cross_entropy_sum_matches_the_definition(ignored):
    g = torch.Generator().manual_seed(0)
    z = (3.0 * torch.randn(24, 300, generator=g)).requires_grad_(True)
    y = torch.randint(0, 300, (24,), generator=g)
    y[:ignored] = IGNORE_INDEX
    want_loss, want_grad = _ref_ce(z.detach(), y)
    loss = cross_entropy_sum(z, y)
    (0.25 * loss).backward()
    assert loss.dtype == torch.float32
    assert abs(float(loss.detach()) - want_loss) <= 1e-6 * abs(want_loss)
    torch.testing.assert_close(z.grad.double(), 0.25 * want_grad, rtol=0, atol=1e-7)
    # without grad mode: the plain loss, nothing kept
    with torch.no_grad():
        assert abs(float(cross_entropy_sum(z, y)) - want_loss) <= 1e-6 * abs(want_loss)


def test_cross_entropy_sum_without_gradients_gives_the_training_bits():
    """The DPO reference pass runs the head's loss without gradients, the policy's step 1 with them: the row sums
    must be the same bits, or step 1 shows nonzero margins (and a reward accuracy) against its own reference.
    ``F.cross_entropy`` reduces in another order: with it as the no-gradient path about half these rows differ."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 48, 384, generator=g) * 3
    labels = torch.randint(0, 384, (64, 48), generator=g)
    labels[:, :20] = IGNORE_INDEX  # the prompt
    with_grad = torch.stack([cross_entropy_sum(r.clone().requires_grad_(), l) for r, l in zip(logits, labels)])
    with torch.no_grad():
        without = torch.stack([cross_entropy_sum(r, l) for r, l in zip(logits, labels)])
    assert torch.equal(with_grad.detach(), without)


def test_causal_lm_loss_sum_fused_equals_plain_to_rounding():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 9, CFG.vocab_size, generator=g)
    y = torch.randint(0, CFG.vocab_size, (2, 9), generator=g)
    y[0, :3] = IGNORE_INDEX
    (a, na), (b, nb) = causal_lm_loss_sum(z, y), causal_lm_loss_sum(z.requires_grad_(True), y, fused=True)
    assert na == nb == 15
    assert abs(float(a) - float(b)) <= 1e-6 * abs(float(a))


def _head_micro_batches(fused: bool, n: int = 4):
    torch.manual_seed(3)
    head = HeadLinear(16, 50)
    head.fused_grad = fused
    calls = []
    head.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.data_ptr()))
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 6, 16, generator=gen) for _ in range(n)]
    gs = [torch.randn(2, 6, 50, generator=gen) for _ in range(n)]
    for x, g in zip(xs, gs):
        head(x).backward(g)
    want = sum(gm.reshape(-1, 50).double().t() @ xm.reshape(-1, 16).double() for xm, gm in zip(xs, gs))
    return head, calls, want


def test_fused_head_accumulates_in_place_with_hooks_once_per_micro_batch():
    head, calls, want = _head_micro_batches(True)
    torch.testing.assert_close(head.weight.grad.double(), want, rtol=0, atol=1e-5)
    assert len(calls) == 4  # the post-accumulate hooks (fp32 fold, offload counter) still run per micro-batch
    assert len(set(calls)) == 1 and head.weight.grad.data_ptr() == calls[0]  # one buffer, no copies
    plain, pcalls, _ = _head_micro_batches(False)
    assert len(pcalls) == 4
    torch.testing.assert_close(head.weight.grad, plain.weight.grad, rtol=1e-6, atol=1e-6)


def test_fused_head_leaves_bf16_and_frozen_weights_to_the_plain_path():
    head = HeadLinear(16, 50).to(torch.bfloat16)
    head.fused_grad = True
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    for _ in range(2):
        head(x).sum().backward()
    want = 2 * (torch.ones(3, 50, dtype=torch.bfloat16).t() @ x)
    torch.testing.assert_close(head.weight.grad.float(), want.float(), rtol=2e-2, atol=0)
    head.weight.requires_grad_(False)
    assert head(x).grad_fn is None or "Join" not in type(head(x).grad_fn).__name__


def _last_stage(fused: bool):
    torch.manual_seed(0)
    mod = StageModule(CFG, 1, 3, False, True)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.05 * torch.randn_like(p))
    mod.fused_head = fused
    return mod


def _loss(mod, x, cuts=None):
    out = mod(x) if cuts is None else mod(x, cuts=cuts)
    y = torch.arange(out.shape[0] * out.shape[1]).reshape(out.shape[:2]) % CFG.vocab_size
    return causal_lm_loss_sum(out, y, fused=mod.fused_head)[0]


def _mm_count(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_"))


@pytest.mark.parametrize("cut", [False, True])
def test_split_backward_of_the_fused_head_equals_its_full_backward(cut):
    """B computes only ``g W`` for the head, W only its weight side (``addmm`` into ``.grad`` from the
    second micro-batch on); together bit for bit the fused full backward, and close to the plain head."""
    full, split, plain = _last_stage(True), _last_stage(True), _last_stage(False)
    assert full.fused_head and not plain.fused_head
    for seed in (5, 6):
        x0 = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))
        for mod in (full, plain):
            xr = x0.clone().requires_grad_(True)
            _loss(mod, xr).backward()
        x = x0.clone().requires_grad_(True)
        cuts = [] if cut else None
        loss = _loss(split, x, cuts)
        with profile(activities=[ProfilerActivity.CPU]) as prof_b:
            dx, work = backward_input(loss, None, x, list(split.parameters()), cuts=cuts)
        with profile(activities=[ProfilerActivity.CPU]) as prof_w:
            work.run()
        n_lin = 2 * 7 + 1
        assert _mm_count(prof_b) == n_lin and _mm_count(prof_w) == n_lin
        in_place = sum(e.count for e in prof_w.key_averages() if e.key == "aten::addmm_")
        assert in_place == (seed == 6)  # the head's dW goes into .grad once there is one
    for (n, p), q, r in zip(split.named_parameters(), full.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), n
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_tied_single_stage_fused_head_with_sparse_embedding_rows():
    """One stage holding the tied embedding and head (P = 1): the head's in-place accumulation and the
    embedding's sparse rows meet in one accumulator; the sum equals the plain model's."""
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True)
    mods = []
    for fused in (False, True):
        torch.manual_seed(0)
        m = StageModule(cfg, 0, 2, True, True)
        m.fused_head, m.sparse_embed_grad = fused, True
        m.model.embed_tokens.weight.grad = torch.zeros_like(m.model.embed_tokens.weight)
        gen = torch.Generator().manual_seed(7)
        for _ in range(3):
            ids = torch.randint(0, 80, (2, 8), generator=gen)
            causal_lm_loss_sum(m(ids), ids, fused=fused)[0].backward()
        mods.append(m)
    for (n, p), q in zip(mods[0].named_parameters(), mods[1].parameters()):
        assert not q.grad.is_sparse, n  # rounding only: 1e-6 of the gradient's scale (fp32 sums of ~50 terms)
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * float(p.grad.abs().max()), msg=n)


def test_fused_head_falls_back_where_the_sum_must_not_show():
    """``autograd.grad`` returns the micro-batch's gradient and leaves ``.grad`` alone; a tensor hook on the
    weight sees each micro-batch's gradient, not the running sum (both as for ``nn.Linear``)."""
    torch.manual_seed(8)
    head = HeadLinear(16, 50)
    head.fused_grad = True
    x1, x2 = torch.randn(4, 16), torch.randn(4, 16)
    head(x1).sum().backward()
    before = head.weight.grad.clone()
    (dw,) = torch.autograd.grad(head(x2).sum(), [head.weight])
    torch.testing.assert_close(dw, torch.ones(4, 50).t() @ x2, rtol=1e-6, atol=1e-6)
    assert torch.equal(head.weight.grad, before)
    seen = []
    head.weight.register_hook(lambda g: seen.append(g.clone()) or 0.5 * g)
    head(x2).sum().backward()
    torch.testing.assert_close(seen[0], torch.ones(4, 50).t() @ x2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, before + 0.5 * seen[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_fused_head_accumulates_inside_the_matmul(fused):
    """From the second micro-batch on the fused head's weight gradient is one ``addmm_`` into ``.grad``;
    the plain head makes ``mm`` then adds."""
    torch.manual_seed(9)
    head = HeadLinear(16, 50)
    head.fused_grad = fused
    x = torch.randn(4, 16, requires_grad=True)
    head(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        head(x).sum().backward()
    keys = {e.key: e.count for e in prof.key_averages()}
    assert (keys.get("aten::addmm_", 0) == 1) == fused


@pytest.mark.parametrize("cut", [False, True])
def test_weight_pass_holds_the_heads_custom_nodes(cut):
    """Before torch 2.13 a custom Function's node lives only while its outputs or consumer nodes do
    (pytorch/pytorch#166577): W must hold built-in ancestors from which the head's JoinGrad node is reachable,
    or it fails once the stage drops the loss (seen on torch 2.11: ``element 0 of tensors does not require
    grad``). Checked on the graph itself, so it holds on every torch."""
    split = _last_stage(True)
    x = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    cuts = [] if cut else None
    loss = _loss(split, x, cuts)
    _, work = backward_input(loss, None, x, list(split.parameters()), cuts=cuts)
    custom = torch.autograd.function.BackwardCFunction
    boundary = [n for nodes, _, _ in work._groups for n in nodes if isinstance(n, custom)]
    assert boundary and type(boundary[0]).__name__ == "JoinGradBackward"
    assert work._owners and not any(isinstance(o, custom) for o in work._owners)
    reach, stack = set(), [o.grad_fn if isinstance(o, torch.Tensor) else o for o in work._owners]
    while stack:  # what the held handles own: every node below them
        n = stack.pop()
        if n is not None and n not in reach:
            reach.add(n)
            stack.extend(c for c, _ in n.next_functions)
    assert all(n in reach for n in boundary)
    del loss
    work.run()
    assert split.lm_head.weight.grad is not None and work._owners == []
