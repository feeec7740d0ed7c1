"""The zero-bubble backward split (npu_train.pipeline.backward) on one stage, against autograd.

B + W must give exactly the gradients of one ``backward()`` (same kernels, same order: bitwise in
fp32 and bf16), B must leave every ``p.grad`` untouched, and W must not redo the input-gradient
chain: counted with the profiler, W runs one matrix product per linear weight and no attention
backward, B one per linear (the input gradients) and the attention backward.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from npu_train.backends.cpu import CPUBackend
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.pipeline.backward import backward_input

CFG = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2)
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _stage(head: bool, dtype):
    torch.manual_seed(0)
    mod = StageModule(CFG, 1, 3, False, head).to(dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref = StageModule(CFG, 1, 3, False, head).to(dtype)
    ref.load_state_dict(mod.state_dict())
    return mod, ref


def _out(mod, x, head, cuts=None):
    out = mod(x) if cuts is None else mod(x, cuts=cuts)
    if head:  # a scalar loss, as on the last stage
        y = torch.arange(out.shape[0] * out.shape[1]) % CFG.vocab_size
        return torch.nn.functional.cross_entropy(out.reshape(-1, CFG.vocab_size), y, reduction="sum"), None
    return out, torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)


def _mm_count(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::bmm", "aten::addmm"))


def _has_attention_backward(prof) -> bool:
    return any("scaled_dot_product" in e.key and "backward" in e.key for e in prof.key_averages())


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_equals_full_backward(head, dtype, cut):
    """Also with the forward's graph cut per layer (``cuts=``, what the runner does past the first stage):
    the chained B and the segments' W give the same gradients, bit for bit, and the same kernels."""
    mod, ref = _stage(head, dtype)
    x0 = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)

    xr = x0.clone().requires_grad_(True)
    out, g = _out(ref, xr, head)
    out.backward(g)

    x = x0.clone().requires_grad_(True)
    cuts = [] if cut else None
    out, g = _out(mod, x, head, cuts)
    if cut:  # after the first of the 2 layers, and before the head
        assert len(cuts) == 1 + head and all(leaf.grad_fn is None and y.grad_fn for y, leaf in cuts)
    with profile(activities=[ProfilerActivity.CPU]) as prof_b:
        dx, work = backward_input(out, g, x, list(mod.parameters()), cuts=cuts)
    assert x.grad is None and all(p.grad is None for p in mod.parameters())
    assert torch.equal(dx, xr.grad)
    with profile(activities=[ProfilerActivity.CPU]) as prof_w:
        work.run()
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    n_lin = 2 * LINEARS_PER_LAYER + (1 if head else 0)
    assert _mm_count(prof_w) == n_lin  # dW = dY^T X once per weight, nothing else
    assert not _has_attention_backward(prof_w)
    assert _mm_count(prof_b) == n_lin  # dX = dY W once per linear
    assert _has_attention_backward(prof_b)


def test_weight_grads_accumulate_over_micro_batches():
    mod, ref = _stage(False, torch.float32)
    works = []
    for seed in (3, 4):
        x0 = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(seed))
        out, g = _out(ref, x0, False)
        out.backward(g)
        x = x0.clone().requires_grad_(True)
        out, g = _out(mod, x, False)
        works.append(backward_input(out, g, x, list(mod.parameters()))[1])
    for w in reversed(works):  # W in any order after its B
        w.run()
    for (n, p), q in zip(mod.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=n)


def test_weight_used_at_two_depths():
    """A weight applied twice on the input chain (two boundary nodes, one group): no double count."""
    torch.manual_seed(5)
    lin, other = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6, bias=False)
    params = [lin.weight, lin.bias, other.weight]
    x0, g = torch.randn(3, 6), torch.randn(3, 6)

    def f(x):
        return lin(torch.tanh(other(lin(x))))

    x = x0.clone().requires_grad_(True)
    f(x).backward(g)
    want = [p.grad.clone() for p in params]
    want_dx = x.grad.clone()
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_(True)
    dx, work = backward_input(f(x), g, x, params)
    assert all(p.grad is None for p in params)
    work.run()
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=0)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-6, atol=1e-7)


def _walk(roots) -> int:
    """Autograd nodes reachable from ``roots`` (what one ``torch.autograd.grad`` of W walks)."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        stack.extend(c for c, _ in n.next_functions)
    return len(seen)


def test_cut_graph_keeps_each_weight_pass_one_layer_long():
    """The reason for the cut: a W group's autograd call walks the graph below its boundary node. Uncut,
    the largest walk grows with the stage's depth (the lowest layers' graph under the top layer's
    weights); cut per layer it is the same for 2 and 6 layers."""
    cfg = LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=6, num_heads=4,
                      num_kv_heads=2)
    worst = {}
    for n_layers in (2, 6):
        for cut in (False, True):
            mod = StageModule(cfg, 0, n_layers, False, False)
            x = torch.randn(2, 8, 32, requires_grad=True)
            cuts = [] if cut else None
            out = mod(x) if cuts is None else mod(x, cuts=cuts)
            _, work = backward_input(out, torch.randn_like(out), x, list(mod.parameters()), cuts=cuts)
            worst[n_layers, cut] = max(_walk(nodes) for nodes, _, _ in work._groups)
            work.run()
    assert worst[6, False] > 2 * worst[2, False]
    assert worst[6, True] == worst[2, True] < worst[2, False]




@pytest.mark.parametrize("cut", [False, True])
def test_weight_pass_fires_accumulation_hooks_as_backward_does(cut):
    """W accumulates through autograd's own gradient accumulators: every post-accumulate hook runs
    once per parameter and micro-batch, as in ``backward()`` (the stage optimizer's fp32 fold and the
    offload's "gradient final" counter hang on them)."""
    mod, _ = _stage(False, torch.float32)
    calls = {n: 0 for n, _ in mod.named_parameters()}
    for n, p in mod.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=n: calls.__setitem__(n, calls[n] + 1))
    for seed in (3, 4, 5):
        x = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
        cuts = [] if cut else None
        out, g = _out(mod, x, False, cuts)
        _, work = backward_input(out, g, x, list(mod.parameters()), cuts=cuts)
        work.run()
    assert calls == {n: 3 for n in calls}


@pytest.mark.parametrize("cut", [False, True])
def test_bf16_weight_grads_sum_in_fp32_in_the_stage_optimizer(cut):
    """bf16 compute under a split backward: each micro-batch's W gradient (bf16, one rounding) is
    folded into the optimizer's fp32 accumulator, as the full backward's are. Reference written from
    the definition: the fp32 sum, in micro-batch order, of the per-micro-batch bf16 gradients, each
    from its own ``torch.autograd.grad`` of the reference module. Summing the 8 in bf16 (the bug
    this test was written for) is off by up to several bf16 ulps."""
    from npu_train.optim.adamw import StageOptimizer

    mod, ref = _stage(False, torch.bfloat16)
    params = dict(mod.named_parameters())
    opt = StageOptimizer(params, {n: p.detach().float() for n, p in params.items()}, set(params),
                         CPUBackend(), lr=0.1)
    want = {n: torch.zeros(p.shape, dtype=torch.float32) for n, p in params.items()}
    for seed in range(8):
        x0 = torch.randn(2, 8, CFG.hidden_size, generator=torch.Generator().manual_seed(10 + seed)).to(torch.bfloat16)
        xr = x0.clone().requires_grad_(True)
        out, g = _out(ref, xr, False)
        for (n, _), dw in zip(ref.named_parameters(), torch.autograd.grad(out, list(ref.parameters()), g)):
            want[n] += dw.float()
        x = x0.clone().requires_grad_(True)
        cuts = [] if cut else None
        out, g = _out(mod, x, False, cuts)
        _, work = backward_input(out, g, x, list(mod.parameters()), cuts=cuts)
        work.run()
        assert all(p.grad is None for p in mod.parameters())  # folded and freed after every W
    for n in params:
        torch.testing.assert_close(opt.grad(n), want[n], rtol=0, atol=0, msg=n)
