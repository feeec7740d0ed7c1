"""The experts' grouped SwiGLU (``model/moe.py::GroupedSwiGlu``, issue 37's speed item) against the formula.

Reference written from the SwiGLU formula, row by row: row ``r`` of expert ``e`` gives
``W_down[e] (silu(W_gate[e] x_r) * (W_up[e] x_r))``, every expert's weights gathered per row (``einsum``), autograd
for the gradients; fp64 so the two agree to rounding (1e-12). Also: bf16 on a CPU without bf16 hardware runs the
matmuls in fp32 and stays within bf16 rounding of the fp64 values; frozen weights get no gradient; a sparse block
whose experts carry LoRA adapters runs them as modules, with the same output.
"""
from __future__ import annotations

import os

import pytest
import torch

from npu_train.model.config import LlamaConfig
from npu_train.model.lora import LoraLinear, LoraSpec
from npu_train.model.moe import GroupedSwiGlu, SparseMoe, matmul_dtype

H, INTER = 24, 20
COUNTS = (5, 1, 0, 9, 3)  # an expert with one row; an empty block is allowed


def _weights(n: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        for shape in ((INTER, H), (INTER, H), (H, INTER)):
            out.append((torch.randn(shape, generator=g, dtype=torch.float64) * 0.3).to(dtype).requires_grad_())
    return out


def _formula(xs: torch.Tensor, counts, weights) -> torch.Tensor:
    """Per row: the row's expert's ``down(silu(gate x) * (up x))``, the weights gathered per row."""
    expert = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    wg = torch.stack(weights[0::3])[expert]  # [S, I, H]
    wu = torch.stack(weights[1::3])[expert]
    wd = torch.stack(weights[2::3])[expert]  # [S, H, I]
    gate = torch.einsum("sih,sh->si", wg, xs)
    up = torch.einsum("sih,sh->si", wu, xs)
    return torch.einsum("shi,si->sh", wd, gate * torch.sigmoid(gate) * up)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_output_and_gradients_equal_the_formula_fp64():
    S = sum(COUNTS)
    xs = torch.randn(S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    dy = torch.randn(S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ws = _weights(len(COUNTS), torch.float64)
    y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
    got = torch.autograd.grad(y, [xs, *ws], dy)
    want_y = _formula(xs, COUNTS, ws)
    want = torch.autograd.grad(want_y, [xs, *ws], dy)
    assert _rel(y, want_y) < 1e-12
    for i, (a, b) in enumerate(zip(got, want)):
        if i > 0 and COUNTS[(i - 1) // 3] == 0:
            assert a is None or float(a.abs().max()) == 0.0  # no rows: no gradient
        else:
            assert _rel(a, b) < 1e-12, i


def test_frozen_weights_get_no_gradient():
    xs = torch.randn(sum(COUNTS), H, dtype=torch.float64, requires_grad=True)
    ws = [w.detach() for w in _weights(len(COUNTS), torch.float64)]
    y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
    (gx,) = torch.autograd.grad(y.sum(), [xs])
    (want,) = torch.autograd.grad(_formula(xs, COUNTS, ws).sum(), [xs])
    assert _rel(gx, want) < 1e-12 and all(w.grad is None for w in ws)


def test_half_precision_matmuls_widen_only_without_hardware(monkeypatch):
    cpu = torch.device("cpu")
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    assert matmul_dtype(torch.bfloat16, cpu) == torch.float32
    assert matmul_dtype(torch.float16, cpu) == torch.float32
    assert matmul_dtype(torch.float32, cpu) == torch.float32 and matmul_dtype(torch.float64, cpu) == torch.float64
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert matmul_dtype(torch.bfloat16, cpu) == torch.bfloat16
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")  # a torch without the private probe: widen
    assert matmul_dtype(torch.bfloat16, cpu) == torch.float32


@pytest.mark.parametrize("hardware", [False, True])
def test_bf16_within_bf16_rounding_of_the_formula(monkeypatch, hardware):
    """Both matmul dtypes (fp32 on bf16 values; bf16 kernels) give bf16-rounded results of the fp64 formula."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: hardware)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    S = sum(COUNTS)
    x64 = torch.randn(S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ws = _weights(len(COUNTS), torch.bfloat16)
    xs = x64.to(torch.bfloat16).requires_grad_()
    y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
    assert y.dtype == torch.bfloat16
    got = torch.autograd.grad(y.float().square().sum(), [xs, ws[0], ws[5]])
    w64 = [w.detach().double().requires_grad_() for w in ws]
    xr = xs.detach().double().requires_grad_()
    want_y = _formula(xr, COUNTS, w64)
    want = torch.autograd.grad(want_y.square().sum(), [xr, w64[0], w64[5]])
    assert _rel(y, want_y) < 2e-2  # bf16: 8 significant bits, rounded between the matmuls
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16 and _rel(a, b) < 3e-2


def test_lora_output_and_gradients_equal_the_formula_fp64():
    """LoRA projections ``x W^T + s (x A^T) B^T = x (W + s B A)^T``: output, and gradients of x, A, B (W frozen)."""
    S, r, s = sum(COUNTS), 3, 0.75
    gen = torch.Generator().manual_seed(4)
    xs = torch.randn(S, H, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(S, H, dtype=torch.float64, generator=gen)
    base = [w.detach() for w in _weights(len(COUNTS), torch.float64)]
    ab = [(torch.randn(r, w.shape[1], dtype=torch.float64, generator=gen).requires_grad_(),
           torch.randn(w.shape[0], r, dtype=torch.float64, generator=gen).requires_grad_()) for w in base]
    tensors = [t for w, (a, b) in zip(base, ab) for t in (w, a, b)]
    y = GroupedSwiGlu.apply(xs, COUNTS, s, *tensors)
    trained = [xs] + [t for pair in ab for t in pair]
    got = torch.autograd.grad(y, trained, dy)
    want_y = _formula(xs, COUNTS, [w + s * b @ a for w, (a, b) in zip(base, ab)])
    want = torch.autograd.grad(want_y, trained, dy)
    assert _rel(y, want_y) < 1e-12
    for i, (a, b) in enumerate(zip(got, want)):
        if i > 0 and COUNTS[(i - 1) // 6] == 0:
            continue  # no rows: zero gradient either way
        assert _rel(a, b) < 1e-12, i


def _nodes(y: torch.Tensor) -> set:
    nodes, todo = set(), [y.grad_fn]
    while todo:
        n = todo.pop()
        if n is not None and n not in nodes:
            nodes.add(n)
            todo.extend(f for f, _ in n.next_functions)
    return {type(n).__name__ for n in nodes}


def test_sparse_block_runs_one_node_with_and_without_lora(monkeypatch):
    """Plain and LoRA experts run in the grouped node with the modules' values (fp64); adapter dropout falls
    back to the modules."""
    from npu_train.model.moe import Expert

    cfg = LlamaConfig(vocab_size=16, hidden_size=H, intermediate_size=INTER, num_layers=1, num_heads=4, num_kv_heads=4,
                      family="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=INTER,
                      norm_topk_prob=True)
    torch.manual_seed(0)
    block = SparseMoe(cfg, 0).double()
    x = torch.randn(2, 7, H, dtype=torch.float64, requires_grad=True)

    def both():
        y = block(x)
        with monkeypatch.context() as m:
            m.setattr(Expert, "grouped_operands", lambda self: None)
            ref = block(x)
        return y, ref

    y, ref = both()
    assert "GroupedSwiGluBackward" in _nodes(y) and "GroupedSwiGluBackward" not in _nodes(ref)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    for ex in block.experts:
        for n in ex.names:
            setattr(ex, n, LoraLinear(getattr(ex, n), LoraSpec(r=2, alpha=3.0)))
            with torch.no_grad():
                getattr(ex, n).lora_B.weight.normal_(0, 0.3)
    y, ref = both()
    assert "GroupedSwiGluBackward" in _nodes(y)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-12)
    params = [p for p in block.parameters() if p.requires_grad]
    g1 = torch.autograd.grad(y.square().sum(), params + [x])
    g2 = torch.autograd.grad(ref.square().sum(), params + [x])
    for a, b in zip(g1, g2):
        assert _rel(a, b) < 1e-12
    block.experts[0].up_proj.dropout = torch.nn.Dropout(0.1)
    assert "GroupedSwiGluBackward" not in _nodes(block(x))


def test_wide_weight_copies_run_on_one_thread(monkeypatch):
    """bf16 without bf16 hardware: each expert's weight widening runs with one intra-op thread (a parallel copy
    waits for every thread: slow on a busy host), the thread count is restored after, and the result is the same
    as with one thread throughout."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    before = torch.get_num_threads()
    seen = []
    real = torch.Tensor.copy_

    def spy(self, src, *a, **k):
        if src.dtype == torch.bfloat16 and self.dtype == torch.float32 and src.dim() == 2 and \
                sorted(src.shape) == sorted((INTER, H)):
            seen.append(torch.get_num_threads())
        return real(self, src, *a, **k)

    def run():
        xs = torch.randn(sum(COUNTS), H, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        xs.requires_grad_()
        ws = _weights(len(COUNTS), torch.bfloat16)
        y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
        return [y, *torch.autograd.grad(y.float().square().sum(), [xs, *ws])]

    try:
        torch.set_num_threads(1)
        want = run()
        torch.set_num_threads(2)
        monkeypatch.setattr(torch.Tensor, "copy_", spy)
        got = run()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    hit = sum(1 for c in COUNTS if c)
    assert len(seen) == 6 * hit and set(seen) == {1}  # gate, up, down widened forward and backward
    for a, b in zip(got, want):  # 1 or 2 matmul threads may sum in another order; empty blocks: zeros
        assert float((a.detach().double() - b.double()).norm()) <= 2e-2 * float(b.double().norm())


def test_wide_lora_weights_are_widened_on_one_thread(monkeypatch):
    """LoRA experts in bf16 without bf16 hardware: every base weight widened to fp32 is widened with one
    intra-op thread, and the thread count is restored after."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    gen = torch.Generator().manual_seed(6)
    base = [w.detach() for w in _weights(len(COUNTS), torch.bfloat16)]
    tensors = [t for w in base for t in (w, torch.randn(2, w.shape[1], generator=gen).to(torch.bfloat16),
                                         torch.randn(w.shape[0], 2, generator=gen).to(torch.bfloat16))]
    xs = torch.randn(sum(COUNTS), H, generator=gen).to(torch.bfloat16).requires_grad_()
    before, seen, real = torch.get_num_threads(), [], torch.Tensor.copy_

    def spy(self, src, *a, **k):
        if src.dtype == torch.bfloat16 and self.dtype == torch.float32 and sorted(src.shape) == sorted((INTER, H)):
            seen.append(torch.get_num_threads())
        return real(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    try:
        torch.set_num_threads(2)
        y = GroupedSwiGlu.apply(xs, COUNTS, 0.5, *tensors)
        torch.autograd.grad(y.float().square().sum(), [xs])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def _stacked(n: int, dtype, seed: int = 0) -> list[torch.Tensor]:
    """:func:`_weights`' values laid out as ``SparseMoe.stack_experts`` does: gate and up of expert ``e`` as rows
    of one ``[n, 2I, H]`` tensor, down of one ``[n, H, I]``; leaves that are views of them."""
    ws = [w.detach() for w in _weights(n, dtype, seed)]
    gu = torch.stack([torch.cat([ws[3 * e], ws[3 * e + 1]]) for e in range(n)])
    down = torch.stack(ws[2::3])
    out = []
    for e in range(n):
        out += [gu[e, :INTER], gu[e, INTER:], down[e]]
    return [torch.nn.Parameter(t) for t in out]


class _MatmulCount:
    """Counts ``torch.mm`` calls and ``Tensor.addmm_`` calls while installed (monkeypatch)."""

    def __init__(self, monkeypatch):
        self.n = 0
        mm, addmm_ = torch.mm, torch.Tensor.addmm_

        def count_mm(*a, **k):
            self.n += 1
            return mm(*a, **k)

        def count_addmm(t, *a, **k):
            self.n += 1
            return addmm_(t, *a, **k)

        monkeypatch.setattr(torch, "mm", count_mm)
        monkeypatch.setattr(torch.Tensor, "addmm_", count_addmm)


@pytest.mark.parametrize("layout", ["stacked", "separate"])
def test_stacked_gate_and_up_run_as_one_matmul(monkeypatch, layout):
    """Gate and up adjacent in memory (``SparseMoe.stack_experts``, transformers' ``gate_up_proj[e]``): 6 matmuls
    per expert and forward + backward (``grouped_mm``'s count), else 8; both equal the formula (fp64)."""
    S, hit = sum(COUNTS), sum(1 for c in COUNTS if c)
    gen = torch.Generator().manual_seed(7)
    xs = torch.randn(S, H, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(S, H, dtype=torch.float64, generator=gen)
    ws = _stacked(len(COUNTS), torch.float64) if layout == "stacked" else _weights(len(COUNTS), torch.float64)
    count = _MatmulCount(monkeypatch)
    y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
    got = torch.autograd.grad(y, [xs, *ws], dy, allow_unused=True)
    assert count.n == (6 if layout == "stacked" else 8) * hit
    monkeypatch.undo()
    want_y = _formula(xs, COUNTS, ws)
    want = torch.autograd.grad(want_y, [xs, *ws], dy)
    assert _rel(y, want_y) < 1e-12
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 0 or COUNTS[(i - 1) // 3]:
            assert _rel(a, b) < 1e-12, i


def test_sparse_block_stacks_its_experts():
    """A new block holds its experts as transformers does (gate rows then up rows of one ``[E, 2I, H]``, down
    ``[E, H, I]``), the same values as before stacking; ``.double()`` separates them, ``stack_experts`` joins them
    again with the values kept and the same parameter objects."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=H, intermediate_size=INTER, num_layers=1, num_heads=4,
                      num_kv_heads=4, family="mixtral", num_experts=3, num_experts_per_tok=2,
                      moe_intermediate_size=INTER)
    torch.manual_seed(0)
    block = SparseMoe(cfg, 0)

    def layout_ok(b):
        base = b.experts[0].w1.weight
        st = base.untyped_storage()
        for e, ex in enumerate(b.experts):
            for w, off in ((ex.w1.weight, 2 * e * INTER * H), (ex.w3.weight, (2 * e + 1) * INTER * H)):
                if w.untyped_storage().data_ptr() != st.data_ptr() or w.storage_offset() != off:
                    return False
        downs = [ex.w2.weight for ex in b.experts]
        return all(d.untyped_storage().data_ptr() == downs[0].untyped_storage().data_ptr() and
                   d.storage_offset() == e * H * INTER for e, d in enumerate(downs))

    assert layout_ok(block)
    block = block.double()
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    params = dict(block.named_parameters())
    assert not layout_ok(block)
    block.stack_experts()
    assert layout_ok(block)
    for n, p in block.named_parameters():
        assert p is params[n] and torch.equal(p, before[n])


@pytest.mark.parametrize("dtype,limit,want", [(torch.bfloat16, None, {1}), (torch.bfloat16, 0, {2}),
                                              (torch.float32, None, {2})])
def test_small_widened_blocks_run_on_one_thread(monkeypatch, dtype, limit, want):
    """bf16 widened to fp32: a block whose gate/up matmul is under ``SERIAL_FLOP`` runs its matmuls on one thread
    (all blocks here), over it on all; fp32 matmuls always on all threads; the count is restored after."""
    import npu_train.model.moe as moe

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    if limit is not None:
        monkeypatch.setattr(moe, "SERIAL_FLOP", limit)
    seen, mm, before = [], torch.mm, torch.get_num_threads()

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return mm(*a, **k)

    xs = torch.randn(sum(COUNTS), H).to(dtype).requires_grad_()
    ws = _stacked(len(COUNTS), dtype)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(torch, "mm", spy)
        y = GroupedSwiGlu.apply(xs, COUNTS, None, *ws)
        torch.autograd.grad(y.float().square().sum(), [xs, *ws], allow_unused=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert len(seen) == 6 * sum(1 for c in COUNTS if c) and set(seen) == want


def test_lora_adapter_products_run_on_one_thread(monkeypatch):
    """fp32 LoRA experts with 2 threads: every product with a rank-``r`` operand (``x A^T``, ``t B^T``, ``dy B``,
    ``q A`` and the adapter gradients) runs on one thread, the base weights' matmuls on both."""
    r, seen, mm, addmm_, before = 7, [], torch.mm, torch.Tensor.addmm_, torch.get_num_threads()

    def note(ts):
        seen.append((any(r in t.shape for t in ts if isinstance(t, torch.Tensor)), torch.get_num_threads()))

    def spy_mm(*a, **k):
        note(a)
        return mm(*a, **k)

    def spy_addmm(t, *a, **k):
        note(a)
        return addmm_(t, *a, **k)

    gen = torch.Generator().manual_seed(8)
    base = [w.detach() for w in _stacked(len(COUNTS), torch.float32)]
    tensors = [t for w in base for t in (w, torch.randn(r, w.shape[1], generator=gen).requires_grad_(),
                                         torch.randn(w.shape[0], r, generator=gen).requires_grad_())]
    xs = torch.randn(sum(COUNTS), H, generator=gen).requires_grad_()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(torch, "mm", spy_mm)
        monkeypatch.setattr(torch.Tensor, "addmm_", spy_addmm)
        y = GroupedSwiGlu.apply(xs, COUNTS, 0.5, *tensors)
        torch.autograd.grad(y.square().sum(), [xs] + [t for t in tensors if t.requires_grad], allow_unused=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    hit = sum(1 for c in COUNTS if c)
    assert sorted(t for a, t in seen if a) == [1] * 18 * hit  # 2 forward + 4 backward per projection
    assert set(t for a, t in seen if not a) == {2} and len([a for a, _ in seen if not a]) == 4 * hit  # W frozen


MANY = (4, 0, 7, 1, 3, 6, 2, 5, 1, 8, 3)  # 10 blocks: over BLOCKS_PER_THREAD x 2 threads


@pytest.mark.parametrize("lora", [False, True])
def test_many_blocks_run_concurrently_one_thread_each(monkeypatch, lora):
    """Same dtype (fp64 here, as fp32), 2 threads, 10 blocks: the blocks are spread over two OS threads, every
    matmul single-threaded (LoRA: one block after another on the caller's thread, whose ``dy B`` the plan counts
    once), and output and gradients equal the formula (1e-12; LoRA: ``W + s B A``); the caller's thread count is
    restored after forward and backward."""
    import threading

    S, r, s = sum(MANY), 3, 0.5
    gen = torch.Generator().manual_seed(9)
    xs = torch.randn(S, H, dtype=torch.float64, generator=gen, requires_grad=True)
    dy = torch.randn(S, H, dtype=torch.float64, generator=gen)
    ws = _stacked(len(MANY), torch.float64)
    if lora:
        base = [w.detach() for w in ws]
        ab = [(torch.randn(r, w.shape[1], dtype=torch.float64, generator=gen).requires_grad_(),
               torch.randn(w.shape[0], r, dtype=torch.float64, generator=gen).requires_grad_()) for w in base]
        tensors, trained = [t for w, p in zip(base, ab) for t in (w, *p)], [xs] + [t for p in ab for t in p]
        eff = [w + s * b @ a for w, (a, b) in zip(base, ab)]
    else:
        tensors, trained, eff = ws, [xs, *ws], ws
    seen, mm, before, main = [], torch.mm, torch.get_num_threads(), threading.get_ident()
    worker_ran, waited = threading.Event(), []

    def spy(*a, **k):
        seen.append((threading.get_ident(), torch.get_num_threads()))
        if threading.get_ident() != main:
            worker_ran.set()
        elif not waited and not lora:  # give a worker the chance to take a block however slowly it is scheduled
            waited.append(worker_ran.wait(timeout=10))
        return mm(*a, **k)

    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(torch, "mm", spy)
        y = GroupedSwiGlu.apply(xs, MANY, s if lora else None, *tensors)
        assert torch.get_num_threads() == 2
        got = torch.autograd.grad(y, trained, dy, allow_unused=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    if lora:
        assert {i for i, _ in seen} == {threading.get_ident()}
    else:
        assert {t for _, t in seen} == {1} and len({i for i, _ in seen}) == 2
    want_y = _formula(xs, MANY, eff)
    want = torch.autograd.grad(want_y, trained, dy, allow_unused=True)
    assert _rel(y, want_y) < 1e-12
    per = 6 if lora else 3
    for i, (a, b) in enumerate(zip(got, want)):
        if i == 0 or MANY[(i - 1) // per]:
            assert _rel(a, b) < 1e-12, i


def test_many_widened_blocks_run_concurrently_with_their_own_buffers(monkeypatch):
    """bf16 widened to fp32 (no bf16 hardware), 2 threads, 10 blocks: the blocks run on two OS threads, every
    matmul single-threaded, each thread widening into its own buffers (no buffer shared by two threads); output
    and gradients bitwise those of the serial run (each small block's matmuls on one thread there too:
    ``SERIAL_FLOP``), so the thread a block ran on changes nothing."""
    import threading

    import npu_train.model.moe as moe

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    gen = torch.Generator().manual_seed(10)
    S = sum(MANY)
    xs = torch.randn(S, H, generator=gen).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(S, H, generator=gen).to(torch.bfloat16)
    ws = _stacked(len(MANY), torch.bfloat16)
    mm, buffer, before, main = torch.mm, moe._Operands.buffer, torch.get_num_threads(), threading.get_ident()
    seen, bufs, ran = [], {}, {True: threading.Event(), False: threading.Event()}
    names = set()  # OS names of the worker threads (seen from outside: /proc/<pid>/task/<tid>/comm)

    def spy_mm(*a, **k):  # each thread's first matmul waits for the other's, however slowly either is scheduled
        me = threading.get_ident() == main
        seen.append((threading.get_ident(), torch.get_num_threads()))
        if not me and os.path.exists("/proc/thread-self/comm"):
            with open("/proc/thread-self/comm") as f:
                names.add(f.read().strip())
        ran[me].set()
        ran[not me].wait(timeout=10)
        return mm(*a, **k)

    def spy_buffer(self, key, rows, cols):
        b = buffer(self, key, rows, cols)  # per kernel call (its _Operands, kept alive here) and key:
        bufs.setdefault((self, key), {}).setdefault(threading.get_ident(), set()).add(b.data_ptr())
        return b

    def run(parallel: bool):
        monkeypatch.setattr(moe, "PARALLEL_BLOCKS", parallel)
        y = GroupedSwiGlu.apply(xs, MANY, None, *ws)
        return (y, *torch.autograd.grad(y, [xs, *ws], dy, allow_unused=True))

    try:
        torch.set_num_threads(2)
        want = run(False)
        monkeypatch.setattr(torch, "mm", spy_mm)
        monkeypatch.setattr(moe._Operands, "buffer", spy_buffer)
        got = run(True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    monkeypatch.undo()
    assert {t for _, t in seen} == {1} and len({i for i, _ in seen}) == 2
    assert names <= {moe.POOL_THREAD_NAME} and (names or not os.path.exists("/proc/thread-self/comm"))
    assert bufs and any(len(per) == 2 for per in bufs.values())  # each thread made its own, used only there
    for per in bufs.values():
        ptrs = [p for ps in per.values() for p in ps]
        assert len(ptrs) == len(set(ptrs)) == len(per)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None and b is None) or torch.equal(a, b), i


def test_an_error_in_a_concurrent_block_is_raised(monkeypatch):
    """A block that fails on a worker thread fails the call (not a silently missing block); the thread count is
    restored."""
    import npu_train.model.moe as moe

    calls, before = [], torch.get_num_threads()

    def fn(j, a, b):
        calls.append(j)
        if j == 3:
            raise RuntimeError("block 3")

    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="block 3"):
            moe._parallel_blocks([(j, 10 * j, 10 * j + j + 1) for j in range(8)], fn)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert sorted(calls) == list(range(8))


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_split_backward_equals_the_whole(monkeypatch, lora, dtype):
    """The zero-bubble split (``pipeline/backward.py``: B the input gradient, W the weights' later) gives the
    plain backward's gradients, each pass making only its half (B: no weight gradient; W: no input gradient),
    with and without adapters, and with bf16 weights widened to fp32 matmuls (the kept ``[dg | du]`` in bf16)."""
    from npu_train.model import moe
    from npu_train.pipeline.backward import backward_input

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    S, gen = sum(COUNTS), torch.Generator().manual_seed(9)
    if lora:
        base = [w.detach() for w in _weights(len(COUNTS), dtype)]
        tensors = [t for w in base for t in (w, (0.3 * torch.randn(3, w.shape[1], generator=gen, dtype=torch.float64))
                                             .to(dtype).requires_grad_(),
                                             (0.3 * torch.randn(w.shape[0], 3, generator=gen, dtype=torch.float64))
                                             .to(dtype).requires_grad_())]
    else:
        tensors = _weights(len(COUNTS), dtype)
    params = [t for t in tensors if t.requires_grad]
    x0 = torch.randn(S, H, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(S, H, generator=gen, dtype=torch.float64).to(dtype)
    s = 0.75 if lora else None

    def run(split: bool):
        inp = x0.clone().requires_grad_()
        y = GroupedSwiGlu.apply(inp * 2, COUNTS, s, *tensors)
        for p in params:
            p.grad = None
        if not split:
            y.backward(dy)
            return inp.grad, [p.grad for p in params]
        dx, work = backward_input(y, dy, inp, params)
        assert all(p.grad is None for p in params) and inp.grad is None
        parts.update(dx=0, dh=0)
        work.run()
        assert not parts["dx"] and not parts["dh"], parts  # W: weights only
        return dx, [p.grad for p in params]

    parts: dict = {"dx": 0, "dh": 0}
    gate_up, down = moe._gate_up_backward, moe._down_backward

    def gate_up_backward(dgu, x, ops, j, s_, dx, *a):
        parts["dx"] += dx is not None
        return gate_up(dgu, x, ops, j, s_, dx, *a)

    def down_backward(dy_, h, ops, j, s_, dh, *a):
        parts["dh"] += dh is not None
        return down(dy_, h, ops, j, s_, dh, *a)

    monkeypatch.setattr(moe, "_gate_up_backward", gate_up_backward)
    monkeypatch.setattr(moe, "_down_backward", down_backward)
    want_dx, want = run(split=False)
    got_dx, got = run(split=True)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert _rel(got_dx, want_dx) < tol
    for i, (a, b) in enumerate(zip(got, want)):
        if b is None or float(b.double().norm()) == 0.0:
            assert a is None or float(a.double().abs().max()) == 0.0, i
        else:
            assert a is not None and _rel(a, b) < tol, i


def test_concurrent_blocks_leave_other_threads_their_count():
    """The blocks' one-thread setting is their threads' own: a thread that starts its torch work while they run
    (the host optimizer's, ``train.offload_update=delayed``; an exchange thread) gets the process's count, and one
    already running keeps its own. ``torch.set_num_threads(1)`` in the blocks once made the process's count 1
    meanwhile, which a new thread's first parallel op copies for good (the running one kept its own: OpenMP's
    count is per thread)."""
    import threading

    import npu_train.model.moe as moe

    if moe._setters() is None:
        pytest.skip("no per-thread thread count in this torch build")
    seen, before = {}, torch.get_num_threads()
    running_ready, running_go = threading.Event(), threading.Event()

    def running():
        torch.get_num_threads()  # this thread's count is set (its first parallel op would do the same)
        running_ready.set()
        running_go.wait(timeout=30)
        seen["running"] = torch.get_num_threads()

    def fresh():
        seen["fresh"] = torch.get_num_threads()  # its first: copies the process's count

    def fn(j, a, b):
        seen.setdefault("block", set()).add(torch.get_num_threads())
        if j == 0:
            t = threading.Thread(target=fresh)
            t.start()
            t.join(timeout=30)
            running_go.set()
            other.join(timeout=30)

    try:
        torch.set_num_threads(3)
        other = threading.Thread(target=running)
        other.start()
        running_ready.wait(timeout=30)
        moe._parallel_blocks([(j, 10 * j, 10 * j + j + 1) for j in range(8)], fn)
        assert torch.get_num_threads() == 3
    finally:
        running_go.set()
        torch.set_num_threads(before)
    assert seen == {"block": {1}, "fresh": 3, "running": 3}, seen
