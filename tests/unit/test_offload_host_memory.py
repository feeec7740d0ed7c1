"""Memory of the offloaded layers' host update on a ``cpu`` card (card memory = host RAM).

Review finding: with layers offloaded, card 0's peak RSS exceeded the plan by ~10 % (SmolLM2-135M,
``cpu,cpu``, ``train.resident_layers=10``: 3.35 GiB measured, 3.02 GiB planned). The host update
kept an fp32 *copy* of every offloaded gradient (the CPU backend's download clones), made in the
last micro-batch's backward and held until the layer's update, i.e. at the card's peak, while the
memory model counted it in the optimizer phase only. Now the update takes the fp32 gradient
itself on a cpu card (bit-identical: ``test_host_overlap_unit.py``, ``tests/integration/
test_offload_overlap.py``), and the model counts a copy only where one is still made.

Checked by counting the bytes the host-update thread downloads (copies) in a step: deterministic.
"""
from __future__ import annotations

import threading

import pytest
import torch

from npu_train.backends.cpu import CPUBackend
from npu_train.hardware import make_cards
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule, causal_lm_loss_sum
from npu_train.planner import RunShape
from npu_train.planner.memory import MemoryModel
from npu_train.runtime.overlap import install_waits, layer_groups

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                  tie_word_embeddings=False)


class _CountingCpu(CPUBackend):
    """The CPU backend, counting the bytes that threads other than the main one (the host-update
    thread) download: a gradient copy is a ``download`` of the gradient (the CPU backend clones)."""

    def __init__(self):
        super().__init__()
        self.host_thread_downloads = 0

    def download(self, t):
        if threading.current_thread() is not threading.main_thread():
            self.host_thread_downloads += t.numel() * t.element_size()
        return super().download(t)


def _host_thread_downloads(delayed: bool, M: int = 2) -> tuple[int, dict]:
    """Bytes the host-update thread downloads during step 2 (all layers offloaded, fp32, overlap);
    and the stage's parameters. Deterministic: counts bytes, not a timing-dependent peak."""
    from npu_train.optim.adamw import StageOptimizer

    torch.manual_seed(0)
    model = StageModule(CFG, 0, CFG.num_layers, True, True)
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in params.items()}
    be = _CountingCpu()
    opt = StageOptimizer(params, masters, [], be, lr=1e-2, layers=layer_groups(params), overlap=True,
                         delayed=delayed)
    install_waits(model, opt, list(opt.host_groups))
    g = torch.Generator().manual_seed(1)
    got = None
    for step in range(3):
        if step == 2:
            opt.wait_all()
            be.host_thread_downloads = 0
        opt.begin_step(M)
        for _ in range(M):
            x = torch.randint(0, CFG.vocab_size, (2, 8), generator=g)
            ls, _ = causal_lm_loss_sum(model(x), x)
            (ls / 32).backward()
        opt.grad_sq_sum()
        opt.step(1e-2, 0.5)
        if step == 2:
            opt.wait_all()
            got = be.host_thread_downloads
    opt.close()
    return got, params


def test_cpu_host_update_holds_no_gradient_copy():
    """On a cpu card the host update takes each offloaded fp32 gradient itself: the host-update
    thread downloads (copies) no gradient during a step (it did 4 B x every offloaded parameter).

    Mutation check (run, seen failing): ``in_place = False`` in ``HostUpdater.__init__`` (the copy
    again). An earlier form of this test bounded the thread's allocation peak, which depends on
    when the main thread drops the upload temporaries (seen 12-62 KB between runs), so it failed
    on timing alone."""
    got, params = _host_thread_downloads(delayed=False)
    assert got == 0, (got, 4 * sum(p.numel() for p in params.values()))


def test_delayed_update_keeps_its_copy():
    """The delayed update runs during the next step's backward, which writes the gradients:
    there the host copy stays (4 B x every offloaded parameter is downloaded)."""
    got, params = _host_thread_downloads(delayed=True)
    assert got >= 4 * sum(p.numel() for p in params.values())


# ---------------------------------------------------------------- the memory model's term
M135 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, tie_word_embeddings=True)


def _stage(kind: str, offload: str, dtype: str = "fp32", grad_accum: str = "fp32", n: int = 10, r: int = 4):
    shape = RunShape(seq_len=128, micro_batch=2, micro_batches=4, dtype=dtype, grad_accum=grad_accum,
                     offload=offload)
    mm = MemoryModel(M135, shape, make_cards(kind, 3, 64 << 30), nonlayer_resident=None)
    return mm.stage(1, n, r, 0)   # a middle stage: decoder layers only, r of n resident


@pytest.mark.parametrize("dtype,grad_accum", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "compute")])
def test_model_counts_the_host_copy_where_it_is_made(dtype, grad_accum):
    """cpu card, 6 offloaded layers: the host copies (4 B x offloaded params) are *held* (through
    the fwd/bwd peak) where the runtime makes them: the delayed update always, the overlapped one
    only for a non-fp32 gradient (bf16 ``.grad``, ``grad_accum=compute``); the delayed update of a
    bf16 model also holds its staged bf16 weights (2 B/param). On cuda (host RAM is not card
    memory) the offload mode changes nothing.

    Mutation check (run, seen failing): the model before the fix (``host_copy`` = 4 B/param on
    every cpu card, in the optimizer phase only) gives overlap == delayed."""
    pl = M135.params_per_layer()
    off = 6 * pl
    e = 2 if dtype == "bf16" else 4
    g = 4 if grad_accum == "fp32" else e
    over = _stage("cpu", "overlap", dtype, grad_accum)
    dl = _stage("cpu", "delayed", dtype, grad_accum)
    assert over.offloaded_params == off
    copy_over = 4 * off if g != 4 else 0
    staged = e * off if e != 4 else 0
    assert dl.mem["transient"] - over.mem["transient"] == 4 * off + staged - copy_over
    serial = _stage("cpu", "serial", dtype, grad_accum)
    # serially the copy (if any) appears after the backward only, not at the fwd/bwd peak
    if copy_over:
        assert serial.mem["transient"] < over.mem["transient"]
    else:
        assert serial.mem["transient"] == over.mem["transient"]
    cuda = {m: _stage("cuda", m, dtype, grad_accum).mem["transient"] for m in ("serial", "overlap", "delayed")}
    assert len(set(cuda.values())) == 1
