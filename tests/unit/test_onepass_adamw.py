"""The one-pass host AdamW (:mod:`npu_train.optim.onepass`, C kernel ``host_adamw.c``) against
``torch.optim.AdamW`` stepping fp32 parameters with the gradient ``grad.float() * clip``.

Reference: ``torch.optim.AdamW(fused=True)`` on its own copies of the parameters, over many steps, with
clipping on and off (coefficient 1.0 and below), weight decay on and off, bf16 and fp32 gradients, 1 and
3 kernel threads, tensor sizes that are and are not multiples of torch's vector width (its scalar tail).
On an AVX2/AVX512 build of torch the masters, both moments and the bf16 copy must be bit-identical; on
other builds within 1e-6 relative. Also against the unfused loop (``foreach=False``, the textbook order)
within 1e-5 relative per step. Without a C compiler (``CC=/nonexistent``) the same call warns once and
stays exact.
"""
from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest
import torch

from npu_train.optim import onepass

EXACT = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def _cache(tmp_path_factory):
    return tmp_path_factory.mktemp("npt") / "cache"


@pytest.fixture
def fresh_kernel(_cache, monkeypatch):
    """The kernel compiled into a fresh ``NPT_CACHE`` (once per module; the module's loaded state reset)."""
    monkeypatch.setenv("NPT_CACHE", str(_cache))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(onepass, "_loaded", {})
    return _cache


def _shapes():
    # 3072 (16*192), 91 (16*5 + 11), 1000 (16*62 + 8), 33 (16*2 + 1), 166 (16*10 + 6) elements
    return [(64, 48), (7, 13), (1000,), (33,), (166,)]


def _make(seed: int, wd: float, betas=(0.9, 0.95)):
    """(masters for the kernel, reference copies, the two AdamW instances): decayed matrices, undecayed vectors."""
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in _shapes()]
    mine = [t.clone() for t in init]
    ref = [t.clone() for t in init]

    def groups(ps):
        return [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": wd},
                {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}]

    kw = dict(lr=3e-3, betas=betas, eps=1e-8)
    return mine, ref, torch.optim.AdamW(groups(mine), fused=True, **kw), torch.optim.AdamW(groups(ref), fused=True, **kw)


def _grads(step: int, gdtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 + step)
    # magnitudes over ten decades: the order of operations shows in the last bit
    return [(torch.randn(s, generator=g) * 10.0 ** torch.randn(s, generator=g)).to(gdtype) for s in _shapes()]


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str):
    if EXACT:
        diff = (a != b).sum().item()
        assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ (max {float((a - b).abs().max())})"
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12, msg=what)


def _run(gdtype, wd, clips, threads, use_kernel, betas=(0.9, 0.95), steps=25):
    mine, ref, opt, ropt = _make(7, wd, betas)
    for t in range(steps):
        clip = clips[t % len(clips)]
        gs = _grads(t, gdtype)
        for p, gr in zip(ref, gs):
            p.grad = gr.float().clone().mul_(clip)
        ropt.step()
        outs = onepass.adamw_onepass(opt, mine, [gr.clone() for gr in gs], clip, torch.bfloat16, threads=threads,
                                     use_kernel=use_kernel)
        for i, (p, r, o) in enumerate(zip(mine, ref, outs)):
            _assert_same(p, r, f"step {t} tensor {i} master")
            _assert_same(opt.state[p]["exp_avg"], ropt.state[r]["exp_avg"], f"step {t} tensor {i} exp_avg")
            _assert_same(opt.state[p]["exp_avg_sq"], ropt.state[r]["exp_avg_sq"], f"step {t} tensor {i} exp_avg_sq")
            assert o.dtype == torch.bfloat16 and o.shape == p.shape
            _assert_same(o.float(), r.to(torch.bfloat16).float(), f"step {t} tensor {i} bf16 copy")
            assert float(opt.state[p]["step"]) == t + 1
    return mine, opt


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("clips", [(1.0,), (0.37, 1.0, 0.013)], ids=["noclip", "clip"])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_equals_torch_fused_adamw(fresh_kernel, gdtype, wd, clips, threads):
    assert onepass.kernel_status().ok, onepass.kernel_status().reason
    _run(gdtype, wd, clips, threads, use_kernel=True)


def test_kernel_with_large_beta1_lerp_branch(fresh_kernel):
    """beta1 <= 0.5: torch's lerp takes its other form, ``g + (w - 1)(g - m)``."""
    _run(torch.float32, 0.1, (0.5, 1.0), 2, use_kernel=True, betas=(0.3, 0.9), steps=10)


def test_kernel_is_adamw_by_the_formula(fresh_kernel):
    """Against the textbook loop (``foreach=False``: separate roundings), within 1e-5 relative after 10 steps."""
    mine, _, opt, _ = _make(3, 0.1)
    ref = [p.clone() for p in mine]
    ropt = torch.optim.AdamW([{"params": [p for p in ref if p.ndim >= 2], "weight_decay": 0.1},
                              {"params": [p for p in ref if p.ndim < 2], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for t in range(10):
        gs = _grads(t, torch.bfloat16)
        for p, gr in zip(ref, gs):
            p.grad = gr.float() * 0.5
        ropt.step()
        onepass.adamw_onepass(opt, mine, gs, 0.5, torch.float32, threads=2, use_kernel=True)
    for p, r in zip(mine, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-7)


def test_fp32_copy_is_the_master_and_none_gradient_is_zeros(fresh_kernel):
    mine, ref, opt, ropt = _make(5, 0.1)
    for p in ref:
        p.grad = torch.zeros_like(p)
    ropt.step()
    outs = onepass.adamw_onepass(opt, mine, [None] * len(mine), 0.5, torch.float32, use_kernel=True)
    for p, r, o in zip(mine, ref, outs):
        assert o is p
        _assert_same(p, r, "master after a zero gradient")


def test_compiled_into_the_cache(fresh_kernel):
    st = onepass.kernel_status()
    assert st.ok and st.path.parent == fresh_kernel / "kernels" and st.path.is_file()


def test_no_compiler_falls_back_exactly_and_says_slower(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="half the speed.*install a C compiler"):
        st = onepass.kernel_status()
    assert not st.ok and "/nonexistent/cc" in st.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not every step
        _run(torch.bfloat16, 0.1, (0.37, 1.0), 2, use_kernel=None, steps=6)
    with pytest.raises(RuntimeError, match="not available"):
        onepass.adamw_onepass(torch.optim.AdamW([torch.zeros(3)]), [], [], 1.0, torch.float32, use_kernel=True)


def test_the_source_ships_as_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["npu_train"]
    src = ROOT / "src" / "npu_train" / "optim" / onepass.SOURCE
    assert src.is_file()
    assert any(src.relative_to(ROOT / "src" / "npu_train").match(pat) for pat in data), data


@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_stream_probe_moves_the_updates_streams(fresh_kernel, gdtype, threads):
    """The benchmark's bandwidth limit (issue 39): the one-pass update's own loads and stores with one add each,
    so its seconds are that update's memory traffic. Every element of every stream is read and written as the
    update does: master, both moments += gradient in place, the copy out = the master's upper 16 bits."""
    n = 16 * 1000 + 7  # a tail past the vector width, split across threads
    g = (torch.arange(n, dtype=torch.float32) * 1e-3).to(gdtype)
    p, m, v = torch.randn(n), torch.randn(n), torch.rand(n)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    out = torch.empty(n, dtype=torch.bfloat16)
    onepass.stream_probe(p, m, v, g, out, threads=threads)
    gf = g.float()
    assert torch.equal(p, p0 + gf) and torch.equal(m, m0 + gf) and torch.equal(v, v0 + gf)
    assert torch.equal(out.view(torch.int16), (p.view(torch.int32) >> 16).to(torch.int16))
    with pytest.raises(ValueError, match="contiguous fp32"):
        onepass.stream_probe(p.double(), m, v, g, out)
