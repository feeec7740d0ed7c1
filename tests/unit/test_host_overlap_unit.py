"""Host-optimizer overlap of offloaded layers (:mod:`npu_train.optim.offload`), in one process.

A 3-layer stage trains a few steps with every layer offloaded: with the overlap (gradient downloads
queued from the backward hooks, host AdamW + upload per layer on the background thread, the next
forward waiting per layer) the weights, masters, moments and grad norms are bit-identical to the
inline run; the downloads really start in the backward, the layers update in forward order.
"""
from __future__ import annotations

import pytest
import torch

from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule, causal_lm_loss_sum
from npu_train.runtime.overlap import install_waits, layer_groups, layer_key

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  tie_word_embeddings=False)


class _Cpu:
    def __init__(self):
        self.downloads = 0

    def device(self):
        return torch.device("cpu")

    def upload(self, t, non_blocking=False):
        return t.clone()

    def download(self, t):
        self.downloads += 1
        return t.detach().clone()

    def synchronize(self):
        pass


def _train(dtype, overlap, steps=3, M=2, resident=()):
    from npu_train.optim.adamw import StageOptimizer

    torch.manual_seed(0)
    model = StageModule(CFG, 0, CFG.num_layers, True, True).to(dtype)
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in params.items()}
    be = _Cpu()
    opt = StageOptimizer(params, masters, list(resident), be, lr=1e-2, weight_decay=0.1,
                         layers=layer_groups(params), overlap=overlap)
    if overlap:
        install_waits(model, opt, list(opt.host_groups))
    g = torch.Generator().manual_seed(1)
    norms, queued, orders, downloads = [], [], [], []
    for step in range(steps):
        be.downloads = 0
        opt.begin_step(M)
        for _ in range(M):
            x = torch.randint(0, CFG.vocab_size, (2, 8), generator=g)
            ls, _ = causal_lm_loss_sum(model(x), x)
            (ls / 32).backward()
        queued.append(set(opt.host.queued()))  # downloads queued by the backward hooks
        sq = opt.grad_sq_sum()
        norms.append(sq)
        coef = min(1.0, 0.5 / (float(sq) ** 0.5 + 1e-6))
        opt.step(1e-2, coef)
        downloads.append(be.downloads)  # the step's downloads, all done by step() (incl. the resident norms)
        if step:
            orders.append([k for k, *_ in opt.host.take_stats()["timeline"]])
    opt.wait_all()
    state = opt.state_tensors()
    opt.close()
    weights = {n: p.detach().clone() for n, p in params.items()}
    return norms, weights, state, queued, orders, downloads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlap_is_bit_identical(dtype):
    """Overlap on vs off: same grad norms, card weights, masters and moments (torch.equal).

    Mutation check (run, seen failing): scaling the gradient after the download in the background task
    only (``clip_coef * (1 + 1e-7)`` when the pool exists) breaks torch.equal."""
    off = _train(dtype, overlap=False)
    on = _train(dtype, overlap=True)
    for a, b in zip(off[0], on[0]):
        assert torch.equal(a, b)
    for n in off[1]:
        assert torch.equal(off[1][n], on[1][n]), n
    assert off[2].keys() == on[2].keys()
    for k in off[2]:
        assert torch.equal(off[2][k], on[2][k]), k


def test_downloads_start_in_backward_and_layers_update_in_forward_order():
    """With overlap every offloaded gradient's download is queued by the last micro-batch's backward
    (before the grad norm is asked for); without it none is. The host update runs layer by layer in
    forward order (embedding, layers 0..2, head); a resident layer has no host update.

    Mutation checks (run, seen failing): ``_final_after = micro_batches + 1`` in ``begin_step`` (the
    hook never sees the final count) leaves nothing queued; comparing the queued gradient by tensor
    identity in ``HostUpdater.collect`` (``grad()`` returns a new ``detach()`` view each call) downloads
    every gradient a second time after the backward."""
    res = CFG.layer_param_names(1)
    _, _, _, queued, orders, downloads = _train(torch.float32, overlap=True, resident=res)
    offloaded = {n for n, _ in StageModule(CFG, 0, 3, True, True).named_parameters()} - set(res)
    assert all(q == offloaded for q in queued)
    assert orders and all(o == ["embed", "layer0", "layer2", "head"] for o in orders)
    # each offloaded gradient is downloaded once per step (queued in the backward, see above), plus one
    # squared-norm scalar per resident parameter
    assert all(d == len(res) + len(offloaded) for d in downloads), downloads
    _, _, _, queued_off, _, downloads_off = _train(torch.float32, overlap=False, resident=res)
    assert all(not q for q in queued_off)
    assert all(d == len(res) + len(offloaded) for d in downloads_off), downloads_off


def test_layer_keys():
    assert layer_key("model.embed_tokens.weight") == "embed"
    assert layer_key("model.layers.12.mlp.up_proj.weight") == "layer12"
    assert layer_key("model.norm.weight") == "head" and layer_key("lm_head.weight") == "head"
    names = ["lm_head.weight", "model.layers.10.a", "model.layers.2.b", "model.embed_tokens.weight"]
    assert [k for k, _ in layer_groups(names)] == ["embed", "layer2", "layer10", "head"]


@pytest.mark.parametrize("resident", [(), ("0", "1", "2")], ids=["offloaded", "resident"])
def test_grad_sq_sum_in_parts_is_the_whole_sum(resident):
    """The trainer takes the sum of squares of every gradient but the tied one before the tied
    exchange and the tied one after it (``grad_sq_terms(only=...)``, ``sum_terms``): bit for bit the
    one-call ``grad_sq_sum`` of the final gradients, offloaded gradients included (a changed one
    downloaded again)."""
    from npu_train.optim.adamw import StageOptimizer

    torch.manual_seed(0)
    model = StageModule(CFG, 0, CFG.num_layers, True, True)
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in params.items()}
    layers = layer_groups(params)
    opt = StageOptimizer(params, masters, [k for k, _ in layers if k in resident], _Cpu(), lr=1e-2,
                         weight_decay=0.1, layers=layers, overlap=True)
    opt.begin_step(1)
    x = torch.randint(0, CFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ls, _ = causal_lm_loss_sum(model(x), x)
    ls.backward()
    tied = "model.embed_tokens.weight"
    terms = opt.grad_sq_terms(only=[n for n in params if n != tied])
    assert tied not in terms and len(terms) == len(params) - 1
    opt.grad(tied).add_(torch.randn_like(opt.grad(tied)))  # the exchange adds the other stage's part in place
    terms.update(opt.grad_sq_terms(only=[tied]))
    whole = opt.grad_sq_sum()
    assert torch.equal(opt.sum_terms(terms), whole)
    assert float(whole) == pytest.approx(sum(float(opt.grad(n).double().pow(2).sum()) for n in params), rel=1e-5)
    assert torch.equal(opt.sum_terms({n: t for n, t in terms.items() if n != "lm_head.weight"}),
                       opt.grad_sq_sum(exclude=["lm_head.weight"]))
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offloaded_one_pass_equals_resident(dtype):
    """Every parameter offloaded (the one-pass host update, :mod:`npu_train.optim.onepass`) against every
    parameter resident (torch's fused AdamW on the card, a cpu here): the same grad norms, card weights,
    masters and moments, bit for bit, over 3 steps with the clip active (coefficient < 1).

    Mutation check (run, seen failing): dropping the clip in the kernel (``g = do_clip ? g : g``)."""
    from npu_train.optim.onepass import kernel_status

    assert kernel_status().ok, kernel_status().reason
    every = [n for n, _ in StageModule(CFG, 0, 3, True, True).named_parameters()]
    res = _train(dtype, overlap=True, resident=every)
    off = _train(dtype, overlap=True)
    assert all(float(a) ** 0.5 > 0.5 for a in off[0])  # the clip coefficient is below 1 every step
    for a, b in zip(res[0], off[0]):
        assert torch.equal(a, b)
    for n in res[1]:
        assert torch.equal(res[1][n], off[1][n]), n
    for k in res[2]:
        assert torch.equal(res[2][k], off[2][k]), k
