"""Vocabulary parallelism's joint action (pipeline/vocab.py) against the formulas: the output layer cut by rows
over P cards (threads here, with an in-memory exchange), each computing its logits slice; the combined loss equals
the summed next-token cross-entropy of the whole output layer, each card's weight gradient equals its rows of
``dL/dW = dz^T x``, and the head's summed input gradient equals ``dz W``, at fp32 to 1e-6, with ignored targets."""
from __future__ import annotations

import threading

import pytest
import torch

from npu_train.pipeline.vocab import vocab_rows, vocab_step


class ThreadExchange:
    """P threads' collectives in memory (each call: everyone posts, then everyone reads the combination)."""

    def __init__(self, P: int, head: int, broken: bool = False):
        self.P, self.head, self.broken = P, head, broken
        self.size = P
        self.bar = threading.Barrier(P)
        self.slots = [None] * P
        self.rank = threading.local()
        self.events: list = []  # ("reduce" | "dW", card) in the order they happened

    @property
    def index(self):  # this thread's card
        return self.rank.r

    def _combine(self, t: torch.Tensor, how) -> None:
        r = self.rank.r
        self.slots[r] = t.clone()
        self.bar.wait()
        out = how([s for s in self.slots])
        self.bar.wait()
        t.copy_(out)

    def broadcast(self, t):
        self._combine(t, lambda ts: ts[self.head])

    def all_reduce_max(self, t):
        self.events.append(("max", self.rank.r))
        self._combine(t, lambda ts: torch.stack(ts).amax(0))

    def all_reduce_sum(self, t):
        self.events.append(("stats", self.rank.r))
        # broken on purpose: the first card's statistics left out of the sum
        self._combine(t, lambda ts: torch.stack(ts[1:] if self.broken else ts).sum(0))

    def reduce_sum(self, t):
        r = self.rank.r
        self._combine(t, lambda ts: torch.stack(ts).sum(0) if r == self.head else ts[r])

    # the asynchronous forms: combined when posted (every thread posts in the same order), a handle that is done
    def broadcast_async(self, t):
        self.broadcast(t)
        return _Done()

    def reduce_sum_async(self, t):
        self.events.append(("reduce", self.rank.r))
        self.reduce_sum(t)
        return _Done()


class _Done:
    def wait(self):
        return None


def _on_card_threads(P, card):
    """``card(r)`` for each of ``P`` cards, each on its own thread (the exchange's collectives meet across them)."""
    th = [threading.Thread(target=card, args=(r,)) for r in range(P)]
    for t in th:
        t.start()
    for t in th:
        t.join()


def _reference(x, W, labels, divisor):
    """Whole-vocabulary cross-entropy from its definition: ``sum_n (logsumexp(z_n) - z_{n, y_n}) / divisor`` over
    the counted targets, and its gradients ``dz = (softmax(z) - onehot(y)) valid / divisor``."""
    x = x.detach().double().reshape(-1, x.shape[-1])
    z = x @ W.double().t()
    y = labels.reshape(-1)
    valid = y != -100
    lse = torch.logsumexp(z, dim=1)
    ys = torch.where(valid, y, torch.zeros_like(y))
    loss = ((lse - z[torch.arange(len(y)), ys]) * valid).sum()
    p = torch.softmax(z, dim=1)
    p[torch.arange(len(y)), ys] -= 1.0
    dz = p * valid.unsqueeze(1) / divisor
    return loss, dz.t() @ x, dz @ W.double()


def _run(P, head, x, W, labels, divisor, broken=False, frozen=False):
    ex = ThreadExchange(P, head, broken)
    b, S, H = x.shape
    out, grads = [None] * P, [None] * P

    def card(r):
        ex.rank.r = r
        a, e = vocab_rows(W.shape[0], P, r)
        w = torch.nn.Parameter(W[a:e].clone(), requires_grad=not frozen)
        out[r] = vocab_step(x if r == head else None, labels, w, a, divisor, ex, r == head, (b, S, H))
        grads[r] = w.grad

    _on_card_threads(P, card)
    return out, grads


@pytest.mark.parametrize("P,head", [(2, 1), (3, 2), (3, 0)])
def test_vocab_step_equals_the_whole_output_layer(P, head):
    torch.manual_seed(0)
    b, S, H, V = 2, 5, 8, 23  # V % P != 0: uneven slices
    x = torch.randn(b, S, H)
    W = torch.randn(V, H) * 0.5
    labels = torch.randint(0, V, (b, S))
    labels[0, :2] = -100
    divisor = 17.0
    loss, dW, dx = _reference(x, W, labels, divisor)
    out, grads = _run(P, head, x, W, labels, divisor)
    for r in range(P):
        assert out[r].loss_sum == pytest.approx(float(loss), rel=1e-6)
        a, e = vocab_rows(V, P, r)
        torch.testing.assert_close(grads[r].double(), dW[a:e], rtol=1e-6, atol=1e-7)
        assert (out[r].dx is None) == (r != head)
    torch.testing.assert_close(out[head].dx.double().reshape(-1, H), dx, rtol=1e-6, atol=1e-7)


def test_a_broken_reduction_fails():
    """Broken on purpose: one card's sum of exponentials and target logit left out of the all-reduce."""
    torch.manual_seed(1)
    x, W = torch.randn(1, 4, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (1, 4))
    loss, _, _ = _reference(x, W, labels, 4.0)
    out, _ = _run(2, 1, x, W, labels, 4.0, broken=True)
    assert abs(out[1].loss_sum - float(loss)) > 1e-3


def test_frozen_output_layer_gets_no_weight_gradient():
    """LoRA: the output layer is frozen; the cards still give the head its input gradient."""
    torch.manual_seed(2)
    x, W = torch.randn(1, 3, 4), torch.randn(9, 4)
    labels = torch.randint(0, 9, (1, 3))
    _, _, dx = _reference(x, W, labels, 3.0)
    out, grads = _run(3, 2, x, W, labels, 3.0, frozen=True)
    assert all(g is None for g in grads)
    torch.testing.assert_close(out[2].dx.double().reshape(-1, 4), dx, rtol=1e-6, atol=1e-7)


def test_vocab_rows_cut():
    """V // P rows each, one more on the first V % P cards, covering 0..V-1 in order."""
    for V in (7, 8, 23, 128256):
        for P in range(1, 8):
            cuts = [vocab_rows(V, P, r) for r in range(P)]
            assert cuts[0][0] == 0 and cuts[-1][1] == V
            assert all(cuts[r][1] == cuts[r + 1][0] for r in range(P - 1))
            assert [e - a for a, e in cuts] == [V // P + (r < V % P) for r in range(P)]
    with pytest.raises(ValueError):
        vocab_rows(3, 4, 0)


def test_reported_model_flops_share_the_head_by_rows():
    """The reporter's per-card model FLOPs: vocabulary-parallel, the head's 6 V H FLOPs per token are spread over
    the cards by their rows (V // P, +1 on the first V % P); the job's total is unchanged."""
    from dataclasses import replace
    from types import SimpleNamespace

    from npu_train.model.presets import get_preset
    from npu_train.planner import RunShape
    from npu_train.runtime.flops import model_flops_per_rank

    cfg = replace(get_preset("llama-3.2-1b"), num_layers=4, tie_word_embeddings=False, vocab_size=1003)
    stages = [SimpleNamespace(num_layers=2, has_head=False), SimpleNamespace(num_layers=2, has_head=True)]
    prep = SimpleNamespace(model_cfg=cfg, plan=SimpleNamespace(stages=stages), dp=2,
                           shape=RunShape(seq_len=64, micro_batch=2, micro_batches=4))
    plain = model_flops_per_rank(prep)
    prep.shape = replace(prep.shape, vocab_parallel=True)
    vp = model_flops_per_rank(prep)
    tokens = 64 * 2 * 4
    head = 6.0 * 1003 * cfg.hidden_size * tokens
    assert sum(vp) == pytest.approx(sum(plain))
    assert vp[0] - plain[0] == pytest.approx(head * 502 / 1003)
    assert plain[1] - vp[1] == pytest.approx(head * (1 - 501 / 1003))
    assert vp[2:] == vp[:2]  # the second replica


def test_partial_input_gradients_travel_in_the_compute_dtype():
    """The partial input gradients ``dz_p W_p`` are sent (reduce SUM onto the head) in the weight's dtype: bf16 on a
    bf16 run (half the bytes of fp32 over gloo and the card<->host copies), fp32 on an fp32 run (exact, as the
    equivalence tests hold). bf16: the head's summed gradient within bf16 rounding of each of the P partials and of
    the sums (relative 2^-8 each) of ``dz W`` from the formulas in fp64."""
    torch.manual_seed(3)
    b, S, H, V, P = 1, 6, 16, 29, 3
    x = torch.randn(b, S, H)
    W = torch.randn(V, H) * 0.5
    labels = torch.randint(0, V, (b, S))
    for dtype in (torch.float32, torch.bfloat16):
        ex_dtypes = []
        real = ThreadExchange.reduce_sum_async

        def spy(self, t, real=real):
            ex_dtypes.append(t.dtype)
            return real(self, t)

        ThreadExchange.reduce_sum_async = spy
        try:
            Wd = W.to(dtype)
            _, _, dx = _reference(x.to(dtype).float(), Wd.float(), labels, 6.0)
            out, _ = _run(P, 2, x.to(dtype), Wd, labels, 6.0)
        finally:
            ThreadExchange.reduce_sum_async = real
        assert ex_dtypes == [dtype] * P
        assert out[2].dx.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else P * 2.0 ** -8
        scale = dx.abs().max()
        assert (out[2].dx.double().reshape(-1, H) - dx).abs().max() <= tol * scale, dtype


def test_the_input_gradients_travel_while_the_weight_gradient_is_computed():
    """The overlap pipeline/vocab.py promises (Yeung et al. 2024 §4): the cards meet once for the softmax statistics
    (one all-reduce), and every card starts the sum of its partial input gradient onto the head before it computes
    its slice's weight gradient (which then runs while the sum travels);
    the head's gradient and every card's weight gradient still equal the formulas'. Through :class:`VocabWork`:
    the head posts its hidden state (post_x) and the others receive it; the head's summed gradient from take_dx."""
    from npu_train.pipeline.vocab import VocabWork

    torch.manual_seed(4)
    b, S, H, V, P, head = 1, 4, 8, 13, 2, 1
    x = torch.randn(b, S, H)
    W = torch.randn(V, H) * 0.5
    labels = torch.randint(0, V, (b, S))
    loss, dW, dx = _reference(x, W, labels, 4.0)
    ex = ThreadExchange(P, head)
    outs, grads = [None] * P, [None] * P

    def card(r):
        ex.rank.r = r
        a, e = vocab_rows(V, P, r)
        w = torch.nn.Parameter(W[a:e].clone())
        w.register_hook(lambda g, r=r: ex.events.append(("dW", r)) or g)
        work = VocabWork(w, a, ex, r == head)
        work.post_x(0, x if r == head else None, (b, S))
        ls = work.run(0, labels, 4.0)
        outs[r] = (ls, work.take_dx(0) if r == head else None)
        work.finish()
        grads[r] = w.grad

    _on_card_threads(P, card)
    # the cards meet once per micro-batch for the statistics (one all-reduce of every card's (m_p, s_p, t_p))
    assert sorted(e for e in ex.events if e[0] in ("max", "stats")) == [("stats", r) for r in range(P)], ex.events
    for r in range(P):
        assert ex.events.index(("reduce", r)) < ex.events.index(("dW", r)), ex.events
        assert outs[r][0] == pytest.approx(float(loss), rel=1e-6)
        a, e = vocab_rows(V, P, r)
        torch.testing.assert_close(grads[r].double(), dW[a:e], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outs[head][1].double().reshape(-1, H), dx, rtol=1e-6, atol=1e-7)
