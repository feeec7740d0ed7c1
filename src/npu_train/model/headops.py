"""The last stage's head without two extra passes over ``[N, V]`` tensors (cpu and cuda cards): the weight
gradient accumulates inside the matmul (:class:`HeadLinear`) and the cross-entropy backward runs in place
(:func:`cross_entropy_sum`); equal to plain torch up to rounding (experiments/2026-12-02-head.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import get_gradient_edge

__all__ = ["HeadLinear", "HeadWeightGrad", "JoinGrad", "cross_entropy_sum", "IGNORE_INDEX"]

#: label value that does not count (the HF / torch convention)
IGNORE_INDEX = -100


def _accumulates_in_place(grad, weight: torch.Tensor) -> bool:
    """Whether ``weight.grad`` can take ``g^T x`` by ``addmm_``: a dense contiguous fp32 accumulator, no double
    backward, no tensor hook, and this backward runs the weight's accumulator."""
    if not (grad is not None and grad.dtype == torch.float32 and weight.dtype == torch.float32
            and grad.layout == torch.strided and not grad.is_sparse and grad.is_contiguous()
            and grad.shape == weight.shape and grad.device == weight.device and not torch.is_grad_enabled()):
        return False
    if getattr(weight, "_backward_hooks", None):
        return False
    will_run = getattr(torch._C, "_will_engine_execute_node", None)  # what torch.autograd.graph's hooks use
    if will_run is None:
        return False
    try:
        return bool(will_run(get_gradient_edge(weight).node))
    except RuntimeError:  # not inside an engine run
        return False


class HeadWeightGrad(torch.autograd.Function):
    """``HeadWeightGrad.apply(x [..., H], weight [V, H])``: the weight side of ``y = x W^T``; forward a 0-stride
    zero ``[..., V]``, backward adds ``dW`` in place into the fp32 ``weight.grad`` and hands that tensor back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight  # only its .grad is used: its values may change before the backward runs
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (x,) = ctx.saved_tensors
        w = ctx.weight
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        acc = w.grad
        if _accumulates_in_place(acc, w):
            w.grad = None
            acc.addmm_(g2.t(), x2.to(acc.dtype))
            return None, acc
        return None, g2.t().mm(x2)


class JoinGrad(torch.autograd.Function):
    """``JoinGrad.apply(y, z)``: ``y`` (a view); the result's gradient goes to both ``y`` and ``z``
    (same shape). The split backward's boundary between the head's input and weight sides."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, g


class HeadLinear(nn.Linear):
    """``nn.Linear`` (no bias) LM head, ``[..., H] -> [..., V]``; with :attr:`fused_grad` the weight gradient
    accumulates inside the matmul (no second-order gradient w.r.t. the weight then)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kw) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.fused_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (self.fused_grad and self.bias is None and w.requires_grad and torch.is_grad_enabled()):
            return super().forward(x)
        return JoinGrad.apply(F.linear(x, w.detach()), HeadWeightGrad.apply(x.detach(), w))


class _CrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of ``logits [N, V]`` fp32 against ``labels [N]`` int64; backward in place
    on the saved log-probabilities."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, has_ignored: bool) -> torch.Tensor:
        loss, lp, safe, valid = _ce_sum(logits, labels, has_ignored)
        ctx.save_for_backward(lp, safe, valid)
        ctx.has_ignored = has_ignored
        return loss

    @staticmethod
    def backward(ctx, go: torch.Tensor):
        lp, safe, valid = ctx.saved_tensors  # overwritten below: a second backward through it fails loudly
        p = lp.exp_()  # the softmax
        rows = torch.arange(p.shape[0], device=p.device)
        p.index_put_((rows, safe), torch.tensor(-1.0, dtype=p.dtype, device=p.device), accumulate=True)
        if ctx.has_ignored:
            p.mul_(valid.unsqueeze(1).to(p.dtype))
        p.mul_(go)
        return p, None, None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")`` with a one-pass backward:
    ``logits`` ``[N, V]`` fp32 (others upcast), ``labels`` ``[N]`` int64; returns the fp32 sum in nats."""
    logits = logits.float()
    has_ignored = bool((labels == IGNORE_INDEX).any())
    if not (torch.is_grad_enabled() and logits.requires_grad):  # the same arithmetic, so the same bits
        return _ce_sum(logits, labels, has_ignored)[0]
    return _CrossEntropySum.apply(logits.contiguous(), labels, has_ignored)


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor, has_ignored: bool) -> tuple:
    """``(loss, log_probs, safe_labels, valid)`` of :func:`cross_entropy_sum`'s forward. One function for the
    training forward and a forward without gradients (a DPO reference pass, an eval), so both give the same
    bits: ``F.cross_entropy`` reduces in another order and differs in the last bits (row sums of DPO
    log-probabilities by about an ulp), so a DPO reference value would differ from the policy's own at step 1."""
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    lp = torch.log_softmax(logits, dim=1)
    tok = lp.gather(1, safe.unsqueeze(1)).squeeze(1).neg_()
    loss = (torch.where(valid, tok, torch.zeros_like(tok)) if has_ignored else tok).sum()
    return loss, lp, safe, valid
