"""AdamW moments are created when the stage optimizer is built, not in its first step
(``StageOptimizer(eager_state=True)``, :meth:`npu_train.optim.adamw._Group.init_state`).

The reference is torch's own lazy creation (``eager_state=False``, i.e. ``torch.optim.AdamW``'s
``_init_group`` in its first ``step()``): the updates must agree bit for bit, and the state torch
would create (step dtype and device, moment shapes) must be what is created up front.
"""
from __future__ import annotations

import pytest
import torch

from npu_train.backends.cpu import CPUBackend
from npu_train.optim.adamw import StageOptimizer



INIT = {"a.weight": torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),
        "b.weight": torch.randn(4, generator=torch.Generator().manual_seed(1))}


def _make(resident, eager, dtype=torch.float32):
    params = {n: torch.nn.Parameter(t.to(dtype).clone()) for n, t in INIT.items()}
    opt = StageOptimizer(params, INIT, resident, CPUBackend(), lr=0.1, weight_decay=0.1,
                         layers=[("a", ["a.weight"]), ("b", ["b.weight"])], eager_state=eager)
    return params, opt


def _states(opt):
    """{name: AdamW state dict} of every master, resident and offloaded."""
    return {n: opt._opt_of(n).opt.state.get(m, {}) for n, m in opt._all()}


@pytest.mark.parametrize("resident", [set(), {"a.weight"}, set(INIT)])
def test_moments_exist_before_the_first_step_and_the_step_reuses_them(resident):
    params, opt = _make(resident, eager=True)
    before = _states(opt)
    for n, st in before.items():
        m = dict(opt._all())[n]
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}, n
        assert float(st["step"]) == 0.0
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].shape == m.shape and st[k].dtype == torch.float32 and not st[k].any()
    objs = {n: (st["exp_avg"], st["exp_avg_sq"]) for n, st in before.items()}
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step(0.05, 1.0)
    for n, st in _states(opt).items():  # updated in place: the first step allocated no moments
        assert st["exp_avg"] is objs[n][0] and st["exp_avg_sq"] is objs[n][1], n
        assert float(st["step"]) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident", [set(), set(INIT)])
def test_up_front_state_is_torchs_lazy_state_bit_for_bit(resident, dtype):
    runs = []
    for eager in (True, False):
        params, opt = _make(resident, eager, dtype)
        g = torch.Generator().manual_seed(2)
        first = None
        for i in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            opt.step(0.05, 0.5)
            if i == 0:
                first = {n: (st["step"].dtype, st["step"].device, st["step"].dim()) for n, st in _states(opt).items()}
        runs.append((first, opt.state_tensors(), {n: p.detach().clone() for n, p in params.items()}))
    (f_e, s_e, p_e), (f_l, s_l, p_l) = runs
    assert f_e == f_l  # step counter: same dtype, device and rank as torch creates it
    for k in s_l:
        assert torch.equal(s_e[k], s_l[k]), k
    for n in p_l:
        assert torch.equal(p_e[n], p_l[n]), n


def test_resume_fills_the_up_front_moments_in_place():
    params, opt = _make(set(INIT), eager=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step(0.05, 1.0)
    saved = opt.state_tensors()
    params2, opt2 = _make(set(INIT), eager=True)
    objs = {n: st["exp_avg_sq"] for n, st in _states(opt2).items()}
    opt2.load_state_tensors(saved, 2)
    for n, st in _states(opt2).items():
        assert st["exp_avg_sq"] is objs[n]  # no second copy of the moments while loading
        assert float(st["step"]) == 2.0
    for k, v in opt2.state_tensors().items():
        assert torch.equal(v, saved[k]), k


def test_unfused_group_state_matches_torchs_lazy_state():
    """The ``foreach=False`` AdamW of a card without fused AdamW (furiosa): its ``step`` lives on
    the CPU as a 0-d fp32 tensor; up front and lazily alike, with the same updates."""
    from npu_train.optim.adamw import _Group

    runs = []
    for eager in (True, False):
        masters = {n: t.clone() for n, t in INIT.items()}
        grp = _Group(masters, torch.device("meta"), 0.1, (0.9, 0.95), 1e-8, 0.1)  # meta: not fused
        assert grp.opt.defaults["fused"] in (None, False)
        if eager:
            grp.init_state()
        g = torch.Generator().manual_seed(4)
        for _ in range(2):
            for m in masters.values():
                m.grad = torch.randn(m.shape, generator=g)
            grp.step()
        st = [grp.opt.state[m] for m in masters.values()]
        runs.append(([(s["step"].dtype, s["step"].device, float(s["step"])) for s in st],
                     [s["exp_avg_sq"].clone() for s in st], [m.detach().clone() for m in masters.values()]))
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1] + runs[0][2], runs[1][1] + runs[1][2]):
        assert torch.equal(a, b)
