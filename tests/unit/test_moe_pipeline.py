"""Mixture-of-experts stages in one process (issue 37): P StageRunners in P threads vs one module.

The reference is the whole model (one module; its parity with transformers is tests/unit/test_moe_model.py) on
each micro-batch, with the step's objective written from its formula, not from npu_train.pipeline.moeaux:
``sum_m CE_sum_m / target tokens + w / M * sum_m aux_m``, ``aux_m = E * sum_e (T_e / R) * (P_e / R)`` over every
sparse layer's router logits (captured by forward hooks on the routers): ``T_e`` one-hot top-k counts, ``P_e``
softmax probabilities summed over tokens and layers, ``R`` rows times layers (transformers'
``load_balancing_loss_func``). The stages' gradients (fp32) must equal its autograd within 1e-5 per tensor; a
per-stage aux loss (each stage's layers alone) is shown to be outside that tolerance, so the test sees it.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.pipeline.moeaux import StageRouting, aux_loss_weight
from npu_train.pipeline.stage import StageRunner
from stage_threads import run_stage_threads, wake_links

VOCAB, SEQ, MB = 96, 8, 2
SPLITS = {1: [4], 2: [2, 2], 3: [1, 2, 1]}
TIMEOUT_S = 30.0
W = 0.3  # the aux weight: large, so that a wrong aux gradient is far outside the tolerance

CFGS = {
    "qwen3_moe": dict(family="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                      norm_topk_prob=True, mlp_only_layers=(1,)),
    "qwen2_moe": dict(family="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40),
    "mixtral": dict(family="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the card threads share one process


def _cfg(name: str) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
                       num_kv_heads=2, max_position_embeddings=64, **CFGS[name])


class MetaQueueComm:
    """BoundaryComm over in-process mailboxes with the ``meta`` side field (the header's ``moe``)."""

    def __init__(self, links: dict, stage: int, abort: threading.Event):
        self.links, self.s, self.abort = links, stage, abort

    def _send(self, key, step, micro, t, meta):
        cv, box = self.links[key]
        with cv:
            box[(step, micro)] = (t.detach().clone(), meta)
            cv.notify_all()

    def _recv(self, key, step, micro, with_meta):
        cv, box = self.links[key]
        with cv:
            if not cv.wait_for(lambda: (step, micro) in box or self.abort.is_set(), TIMEOUT_S):
                raise TimeoutError(f"stage {self.s}: micro-batch {micro} never arrived on {key}")
            if self.abort.is_set():
                raise RuntimeError("another stage failed")
            t, meta = box.pop((step, micro))
        return (t, meta) if with_meta else t

    def send_act(self, step, micro, t, meta=None):
        self._send(("act", self.s), step, micro, t, meta)

    def recv_act(self, step, micro, with_meta=False):
        return self._recv(("act", self.s - 1), step, micro, with_meta)

    def send_grad(self, step, micro, t, meta=None):
        self._send(("grad", self.s), step, micro, t, meta)

    def recv_grad(self, step, micro, with_meta=False):
        return self._recv(("grad", self.s + 1), step, micro, with_meta)


class _Cpu:
    def upload(self, t):
        return t.clone()

    def synchronize(self):
        pass


def _weights(cfg, seed):
    torch.manual_seed(seed)
    full = StageModule(cfg, 0, cfg.num_layers, True, True)
    with torch.no_grad():
        for n, p in full.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith(".gate.weight"):
                p.normal_(0.0, 0.5)  # routers far from uniform
            else:
                p.normal_(0.0, 0.08)
    return {n: p.detach().clone() for n, p in full.named_parameters()}


def _data(M, seed):
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, VOCAB, (MB, SEQ), generator=g) for _ in range(M)]
    labels = []
    for m in range(M):
        y = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
        y[:, : m % 3] = -100
        labels.append(y)
    return inputs, labels


def aux_formula(logits_per_layer: list, E: int, k: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func over the given layers' router logits [N, E], from its formula."""
    T = sum(F.one_hot(torch.topk(torch.softmax(lg, -1), k, dim=-1).indices, E).sum(dim=(0, 1)).float()
            for lg in logits_per_layer)
    P = sum(torch.softmax(lg, -1).float().sum(0) for lg in logits_per_layer)
    R = sum(lg.shape[0] for lg in logits_per_layer)
    return E * torch.sum((T / R) * (P / R))


def reference(cfg, weights, inputs, labels, w, groups=None):
    """The step's loss and gradients on one module. ``groups``: lists of layer indices whose aux losses are
    taken separately and summed (a per-stage aux: the mistake the pipeline must not make); None: all layers."""
    model = StageModule(cfg, 0, cfg.num_layers, True, True)
    model.load_named_tensors(weights)
    captured: dict[int, torch.Tensor] = {}
    for i, layer in model.model.layers.items():
        if cfg.is_moe_layer(int(i)):
            layer.ffn.gate.register_forward_hook(lambda mod, a, out, i=int(i): captured.__setitem__(i, out))
    n_tok = sum(int((y != -100).sum()) for y in labels)
    total, ce_total = 0.0, 0.0
    for x, y in zip(inputs, labels):
        captured.clear()
        logits = model(x)
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100, reduction="sum")
        ce_total += float(ce.detach())
        layers = sorted(captured)
        parts = [layers] if groups is None else [[i for i in g if i in captured] for g in groups]
        aux = sum(aux_formula([captured[i] for i in g], cfg.num_experts, cfg.num_experts_per_tok)
                  for g in parts if g)
        loss = ce / n_tok + w * aux / len(inputs)
        loss.backward()
        total += float(loss.detach())
    return ce_total, {n: (torch.zeros_like(p) if p.grad is None else p.grad.clone())
                      for n, p in model.named_parameters()}


def run_pipeline(cfg, weights, inputs, labels, P, w, schedule="1f1b", recompute=False):
    bounds, first = [], 0
    for n in SPLITS[P]:
        bounds.append((first, first + n))
        first += n
    links = {(k, s): (threading.Condition(), {}) for k in ("act", "grad") for s in range(P)}
    results, abort = [None] * P, threading.Event()

    def work(s):
        mod = StageModule(cfg, *bounds[s], s == 0, s == P - 1, recompute=recompute)
        mod.load_named_tensors({n: weights[n] for n in mod.param_names()})
        moe = StageRouting(mod.router_recorder, cfg.num_experts, w, len(inputs), s == P - 1)
        runner = StageRunner(mod, _Cpu(), P, s, schedule, MetaQueueComm(links, s, abort), moe=moe)
        if s in (0, P - 1):
            res = runner.run_step(0, inputs if s == 0 else None, labels if s == P - 1 else None)
        else:
            res = runner.run_middle(0, len(inputs))
        results[s] = (res, {n: p.grad for n, p in mod.named_parameters()})

    run_stage_threads(P, work, wake_links(abort, links), 2 * TIMEOUT_S)
    return results


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _grads(results) -> dict:
    out = {}
    for _, grads in results:
        for n, g in grads.items():
            out[n] = g
    return out


@pytest.mark.parametrize("name", sorted(CFGS))
@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("w", [0.0, W])
def test_stage_gradients_match_the_formula(name, P, w):
    cfg = _cfg(name)
    weights = _weights(cfg, seed=P)
    inputs, labels = _data(3, seed=P + 1)
    ref_ce, ref_grads = reference(cfg, weights, inputs, labels, w)
    results = run_pipeline(cfg, weights, inputs, labels, P, w)
    assert abs(results[-1][0]["loss_sum"] - ref_ce) / ref_ce < 1e-5
    got = _grads(results)
    assert got.keys() == ref_grads.keys()
    for n, g in ref_grads.items():
        mine = torch.zeros_like(g) if got[n] is None else got[n]
        assert _rel(mine, g) < 1e-5, f"{n}: rel diff {_rel(mine, g):.2e}"
    # the last stage's mean aux of the step is transformers' value of each micro-batch's forward
    if w:
        assert results[-1][0]["moe_aux_sum"] > 0
    loads = [res["expert_load"] for res, _ in results]
    assert all(x is None or x >= 1.0 for x in loads) and any(x is not None for x in loads)


@pytest.mark.parametrize("P", [2, 3])
def test_a_per_stage_aux_loss_is_detected(P):
    """The global-aux reference and a per-stage-aux one differ by far more than the tolerance on the routers, so
    the test above would fail for an implementation that combined nothing across stages."""
    cfg = _cfg("qwen3_moe")
    weights = _weights(cfg, seed=P)
    inputs, labels = _data(3, seed=P + 1)
    _, glob = reference(cfg, weights, inputs, labels, W)
    bounds, first = [], 0
    for n in SPLITS[P]:
        bounds.append(list(range(first, first + n)))
        first += n
    _, per_stage = reference(cfg, weights, inputs, labels, W, groups=bounds)
    worst = max(_rel(per_stage[n], glob[n]) for n in glob if n.endswith(".gate.weight"))
    assert worst > 1e-3


def test_recompute_records_once():
    """train.recompute=true: the recomputed forward during backward records no second statistic."""
    cfg = _cfg("qwen3_moe")
    weights = _weights(cfg, seed=5)
    inputs, labels = _data(2, seed=6)
    _, ref_grads = reference(cfg, weights, inputs, labels, W)
    results = run_pipeline(cfg, weights, inputs, labels, 2, W, recompute=True)
    got = _grads(results)
    for n, g in ref_grads.items():
        mine = torch.zeros_like(g) if got[n] is None else got[n]
        assert _rel(mine, g) < 1e-5, f"{n}: rel diff {_rel(mine, g):.2e}"


def test_split_backward_refuses_the_aux_loss():
    from npu_train.errors import ConfigError

    cfg = _cfg("qwen3_moe")
    mod = StageModule(cfg, 0, 2, True, False)
    for kind in ("zb", "zbv", "interleaved"):
        with pytest.raises(ConfigError, match=rf"train.schedule={kind} does not combine .*schedule=1f1b.*moe_aux_loss=0"):
            StageRunner(mod, _Cpu(), 2, 0, kind, None, moe=StageRouting(mod.router_recorder, 8, W, 2, False))
    StageRunner(mod, _Cpu(), 2, 0, "zb", None, moe=StageRouting(mod.router_recorder, 8, 0.0, 2, False))


def test_aux_loss_weight_resolution():
    cfg = _cfg("qwen3_moe")
    import dataclasses

    assert aux_loss_weight(None, cfg) == 0.0
    on = dataclasses.replace(cfg, output_router_logits=True, router_aux_loss_coef=0.001)
    assert aux_loss_weight(None, on) == 0.001 and aux_loss_weight(0.0, on) == 0.0 and aux_loss_weight(0.5, cfg) == 0.5
    dense = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1)
    assert aux_loss_weight(0.5, dense) == 0.0


def test_step_record_and_line_show_aux_and_load():
    from npu_train.metrics.report import moe_fields, moe_text

    reps = [{"moe": {"aux_loss": 2.5, "expert_load": None}}, {"moe": {"aux_loss": 2.5, "expert_load": 1.75}}]
    rec = moe_fields(reps)
    assert rec == {"aux_loss": 2.5, "expert_load_cards": [None, 1.75]}
    assert moe_text(rec) == ["aux 2.5000", "expert load -/1.75"]
    assert moe_text(moe_fields([{"moe": {"aux_loss": None, "expert_load": 1.5}}])) == ["expert load 1.50"]
    assert moe_fields([{}, {}]) == {} and moe_text({}) == []


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("P", [2, 3])
def test_zero_bubble_stage_gradients_match_the_formula(name, P):
    """train.schedule=zb (the backward split into B and W, pipeline/backward.py; aux loss off: refused with it)."""
    cfg = _cfg(name)
    weights = _weights(cfg, seed=P + 10)
    inputs, labels = _data(3, seed=P + 11)
    ref_ce, ref_grads = reference(cfg, weights, inputs, labels, 0.0)
    results = run_pipeline(cfg, weights, inputs, labels, P, 0.0, schedule="zb")
    assert abs(results[-1][0]["loss_sum"] - ref_ce) / ref_ce < 1e-5
    got = _grads(results)
    for n, g in ref_grads.items():
        mine = torch.zeros_like(g) if got[n] is None else got[n]
        assert _rel(mine, g) < 1e-5, f"{n}: rel diff {_rel(mine, g):.2e}"


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_expert_backward_work_runs_once_per_micro_batch(monkeypatch, schedule):
    """Each part of the experts' kernel's backward per expert block (``dh = dy W_down``, ``dW_down``, ``dx =
    [dg | du] [W_gate; W_up]``, ``[dW_gate; dW_up]``) runs once per forward of the block, also where the
    zero-bubble split runs the kernel's node in both B and W (it once ran it whole in each: twice the work)."""
    from collections import Counter

    from npu_train.model import moe

    seen, lock = Counter(), threading.Lock()
    fwd, down, gate_up = moe._gate_up_forward, moe._down_backward, moe._gate_up_backward

    def count(**parts):
        with lock:
            seen.update({k: int(bool(v)) for k, v in parts.items()})

    def gate_up_forward(x, ops, j, *a):
        count(forward=True)
        return fwd(x, ops, j, *a)

    def down_backward(dy, h, ops, j, s, dh, t, need, grads):
        count(dh=dh is not None, dw_down=need[ops.index(j, 2)])
        return down(dy, h, ops, j, s, dh, t, need, grads)

    def gate_up_backward(dgu, x, ops, j, s, dx, ts, need, grads):
        count(dx=dx is not None, dw_gate_up=need[ops.index(j, 0)] or need[ops.index(j, 1)])
        return gate_up(dgu, x, ops, j, s, dx, ts, need, grads)

    monkeypatch.setattr(moe, "_gate_up_forward", gate_up_forward)
    monkeypatch.setattr(moe, "_down_backward", down_backward)
    monkeypatch.setattr(moe, "_gate_up_backward", gate_up_backward)
    cfg = _cfg("qwen3_moe")
    weights = _weights(cfg, seed=7)
    inputs, labels = _data(3, seed=8)
    run_pipeline(cfg, weights, inputs, labels, 2, 0.0, schedule=schedule)
    assert seen["forward"] > 0
    assert seen == Counter({k: seen["forward"] for k in ("forward", "dh", "dw_down", "dx", "dw_gate_up")}), seen
