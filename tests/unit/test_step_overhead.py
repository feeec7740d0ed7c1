"""Per-step runtime overhead removed on ``cpu`` / ``cuda`` cards (experiments/2026-11-30-bench.md,
"Runtime overhead vs torch 1F1B"): fp32 resident parameters are their own AdamW masters, the tied
gradient is all-reduced in place, and the memory model counts neither the master copy nor the
tied-gradient copies there."""
from __future__ import annotations

import pytest
import torch

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import RunShape
from npu_train.planner.memory import MemoryModel


class CountingCpuBackend:
    """Host "card" that counts its copies (``upload`` / ``download`` always copy, as every backend)."""

    kind = "cpu"

    def __init__(self):
        self.copies = 0

    def device(self):
        return torch.device("cpu")

    def upload(self, t):
        self.copies += 1
        return t.clone()

    def download(self, t):
        self.copies += 1
        return t.detach().clone()

    def synchronize(self):
        pass


def _adamw_reference(w, grads, lr, clips, betas=(0.9, 0.95), eps=1e-8):
    """AdamW (weight decay 0) from its formulas (Loshchilov & Hutter 2019), fp64, on ``clips[t] * g_t``."""
    w = w.double().clone()
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, (g, clip) in enumerate(zip(grads, clips), 1):
        g = g.double() * clip
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        w = w - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return w


# Adam is invariant to one constant gradient scale: the clip coefficient shows only when it changes
@pytest.mark.parametrize("clips", [(1.0, 1.0, 1.0), (1.0, 0.2, 0.7)])
def test_fp32_resident_parameters_are_their_own_masters(clips):
    from npu_train.optim.adamw import StageOptimizer

    torch.manual_seed(0)
    init = {"a.weight": torch.randn(16, 8), "b.weight": torch.randn(8)}
    params = {n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in init.items()}  # set from init
    opt = StageOptimizer(params, init, set(init), CountingCpuBackend(), lr=1e-2, weight_decay=0.0)
    assert opt.shared == set(init)
    for n, p in params.items():  # the master is the parameter: no second fp32 copy
        assert opt.dev_group.masters[n] is p
        assert torch.equal(p.detach(), init[n])
    gen = torch.Generator().manual_seed(1)
    grads = {n: [torch.randn(t.shape, generator=gen) for _ in range(3)] for n, t in init.items()}
    for k, clip in enumerate(clips):
        for n, p in params.items():
            p.grad = grads[n][k].clone()
        opt.step(1e-2, clip)
        assert all(p.grad is None for p in params.values())
    for n, p in params.items():
        torch.testing.assert_close(p.detach().double(), _adamw_reference(init[n], grads[n], 1e-2, clips),
                                   rtol=1e-5, atol=1e-7)
        st = opt.state_tensors()
        assert torch.equal(st[f"master.{n}"], p.detach())


def test_bf16_and_offloaded_parameters_keep_a_separate_master():
    from npu_train.optim.adamw import StageOptimizer

    init = {"a.weight": torch.randn(4, 4), "b.weight": torch.randn(4, 4)}
    params = {"a.weight": torch.nn.Parameter(init["a.weight"].bfloat16()),
              "b.weight": torch.nn.Parameter(init["b.weight"].clone())}
    opt = StageOptimizer(params, init, {"a.weight"}, CountingCpuBackend(), lr=1e-2)  # b offloaded
    assert opt.shared == set()
    assert opt.dev_group.masters["a.weight"].dtype == torch.float32
    assert opt.host_groups["all"].masters["b.weight"] is not params["b.weight"]


def _stage(kind: str, dtype: str, grad_accum: str = "fp32"):
    m = get_preset("smollm2-135m")  # tied embedding
    shape = RunShape(seq_len=128, micro_batch=1, micro_batches=8, schedule="1f1b", dtype=dtype,
                     grad_accum=grad_accum)
    cards = make_cards(kind, 2)
    mm = MemoryModel(m, shape, cards, None)
    return m, [mm.stage(i, 15, 15, 0) for i in range(2)]


def test_memory_model_fp32_masters_are_the_weights_on_cpu_and_cuda():
    for kind in ("cpu", "cuda"):
        m, st = _stage(kind, "fp32")
        for s in st:  # m + v only: the fp32 weights are the masters
            assert s.mem["optimizer"] == 8 * s.params
        _, st16 = _stage(kind, "bf16")
        for s in st16:  # separate fp32 master + m + v
            assert s.mem["optimizer"] == 12 * s.params


def test_memory_model_tied_exchange_held_bytes():
    """The tied exchange (npu_train.runtime.tied) holds, per end stage: on a cpu card (host RAM is card
    memory) a [V, H] fp32 host buffer (the first stage's receive buffer, the last stage's dense copy;
    an fp32 gradient on the last stage is sent as is, without a copy), plus the host copies of a
    non-fp32 gradient buffer (its fp32 copy and the one uploaded back); on cuda the device temporary
    of the gradient's size. All layers resident: only this term differs."""
    m, cpu = _stage("cpu", "fp32")
    _, cuda = _stage("cuda", "fp32")
    E = m.embedding_params()
    # first stage: cpu 4 B/element (receive buffer) = cuda 4 B/element (fp32 gradient); last: cpu 0
    assert cpu[0].mem["transient"] == cuda[0].mem["transient"]
    assert cpu[-1].mem["transient"] == cuda[-1].mem["transient"] - 4 * E
    _, cpu16 = _stage("cpu", "bf16", grad_accum="compute")
    _, cuda16 = _stage("cuda", "bf16", grad_accum="compute")
    for c, g in zip(cpu16, cuda16):  # cpu 4 + (2 + 4) B/element, cuda 2 B/element
        assert c.mem["transient"] - g.mem["transient"] == 8 * E
