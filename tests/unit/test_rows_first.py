"""The first stage's embedding update, looked-up rows first (:mod:`npu_train.optim.rowsfirst`).

Reference: ``torch.optim.AdamW`` (fused, as the stage optimizer) stepping the whole fp32 matrix at
once on the clipped gradient ``clip * g``. The split update (the rows now, the rest after the next
step's first forward) must give the same masters, moments, step counts and compute weights, bit
for bit, for fp32 compute (the parameter is its own master) and bf16 compute (fp32 master, fp32
gradient accumulator), and the rows the next step reads must already be final after the first part.
End to end, tests/integration/test_pipeline_equivalence.py::test_resident_vs_offloaded_same_weights
compares a run whose first stage updates its resident embedding this way with runs that update it
on the host in one piece (torch.equal on every checkpoint tensor): it failed with the restored rows
perturbed by 1e-7 relative (seen), which the 1e-5 reference tests let pass.
"""
from __future__ import annotations

import pytest
import torch

from npu_train.backends.cpu import CPUBackend
from npu_train.optim.adamw import StageOptimizer
from npu_train.optim.rowsfirst import RowsFirstUpdate

V, H = 300, 24
EMB = "model.embed_tokens.weight"
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.37



def _init():
    g = torch.Generator().manual_seed(0)
    return {EMB: torch.randn(V, H, generator=g), "model.layers.0.mlp.up_proj.weight": torch.randn(16, H, generator=g),
            "model.layers.0.input_layernorm.weight": torch.ones(H)}


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(t.shape, generator=g).to(dtype) for n, t in _init().items()}


def _rows(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.unique(torch.randint(0, V, (90,), generator=g))


def _reference(steps, dtype):
    """(masters, moments, step counts) after ``steps`` plain AdamW steps on ``CLIP * g``."""
    ms = {n: t.clone() for n, t in _init().items()}
    dec = [t for t in ms.values() if t.ndim >= 2]
    nodec = [t for t in ms.values() if t.ndim < 2]
    opt = torch.optim.AdamW([{"params": dec, "weight_decay": WD}, {"params": nodec, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, fused=True)
    for s in range(steps):
        for n, gr in _grads(s, dtype).items():
            ms[n].grad = gr.float().mul_(CLIP)
        opt.step()
    return ms, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stage_optimizer_rows_first_equals_one_full_step(dtype):
    init = _init()
    params = {n: torch.nn.Parameter(t.to(dtype).clone()) for n, t in init.items()}
    opt = StageOptimizer(params, init, set(params), CPUBackend(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         rows_first=EMB)
    assert opt.row_name == EMB and (EMB in opt.shared) == (dtype == torch.float32)
    steps = 3
    for s in range(steps):
        for n, gr in _grads(s, dtype).items():
            params[n].grad = gr.clone()
            if n in opt.accumulators:  # bf16: the fp32 accumulator, as after the backward's folds
                opt._fold(n, params[n])
        rows = _rows(s)
        before = params[EMB].detach().clone()
        opt.step(LR, CLIP, rows=rows)
        ref, _ = _reference(s + 1, dtype)
        # the next step's rows are final now, the others not yet updated
        assert torch.equal(params[EMB].detach()[rows], ref[EMB][rows].to(dtype))
        others = torch.ones(V, dtype=torch.bool)
        others[rows] = False
        assert torch.equal(params[EMB].detach()[others], before[others])
        params[EMB].grad = torch.zeros_like(params[EMB])  # the next step's buffer (the trainer's sparse_embed)
        assert opt.finish_rows() > 0.0
        assert opt.finish_rows() == 0.0  # once
        assert params[EMB].grad is not None and not params[EMB].grad.any()  # left as it was
        params[EMB].grad = None
    ref, ropt = _reference(steps, dtype)
    state = opt.state_tensors()
    for n, m in ref.items():
        st = ropt.state[m]
        assert torch.equal(state[f"master.{n}"], m), n
        assert torch.equal(state[f"exp_avg.{n}"], st["exp_avg"]), n
        assert torch.equal(state[f"exp_avg_sq.{n}"], st["exp_avg_sq"]), n
        assert torch.equal(params[n].detach(), m.to(dtype)), n
    assert float(opt.row_group.opt.state[opt.row_group.masters[EMB]]["step"]) == steps


def test_wait_all_finishes_a_pending_update():
    """A checkpoint or an evaluation right after the step sees the whole update."""
    init = _init()
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = StageOptimizer(params, init, set(params), CPUBackend(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         rows_first=EMB)
    for n, gr in _grads(0, torch.float32).items():
        params[n].grad = gr.clone()
    opt.step(LR, CLIP, rows=_rows(0))
    state = opt.state_tensors()  # waits
    ref, _ = _reference(1, torch.float32)
    assert torch.equal(state[f"master.{EMB}"], ref[EMB])


def test_not_on_an_offloaded_embedding():
    init = _init()
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = StageOptimizer(params, init, set(params) - {EMB}, CPUBackend(), lr=LR, rows_first=EMB)
    assert opt.row_name is None and opt.row_group is None


def test_update_alone_matches_torch_and_restores_the_rows():
    """RowsFirstUpdate by itself, on a matrix whose row length is no multiple of a vector width."""
    torch.manual_seed(0)
    a = torch.randn(V, H + 3)
    b = a.clone()
    opts = [torch.optim.AdamW([{"params": [t], "weight_decay": WD}], lr=LR, betas=BETAS, eps=EPS, fused=True)
            for t in (a, b)]
    for o, t in zip(opts, (a, b)):
        o.state[t] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(t), "exp_avg_sq": torch.zeros_like(t)}
    for s in range(3):
        g = torch.randn(V, H + 3)
        a.grad = g.clone()
        opts[0].step()
        u = RowsFirstUpdate(opts[1], b, g.clone(), b, _rows(s))
        u.start()
        u.finish()
        assert torch.equal(a, b), s
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opts[0].state[a][k], opts[1].state[b][k]), (s, k)
    with pytest.raises(RuntimeError, match="before start"):
        RowsFirstUpdate(opts[1], b, g, b, _rows(0)).finish()
