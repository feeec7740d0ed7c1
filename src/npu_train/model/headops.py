"""The last stage's head without its two extra passes over ``[N, V]`` tensors (cpu and cuda cards).

On a cpu card the head dominates the last stage: for SmolLM2-135M (V = 49152, H = 576) at 128 tokens
per micro-batch, one thread, the logits matmul takes ~68 ms, its two backward matmuls ~53 and 69-113 ms,
the cross-entropy 22-24 ms, against ~29 ms for a decoder layer's forward + backward
(experiments/2026-12-02-head.md). Two of those costs are not arithmetic:

1. **Weight-gradient accumulation.** Autograd computes ``dW = g^T x`` into a fresh ``[V, H]`` tensor
   (113 MB) and then adds it into ``.grad``: 84-89 ms against 66-68 ms for ``grad.addmm_(g^T, x)``, which
   accumulates inside the matmul (same record). :class:`HeadLinear` routes the weight side through
   :class:`HeadWeightGrad`, whose backward does the ``addmm_`` into the existing fp32 ``.grad`` and hands
   that same tensor back to autograd with ``.grad`` cleared: the parameter's gradient accumulator
   then takes it as is (torch steals a gradient it holds the only reference to) and runs the
   post-accumulate hooks once per micro-batch, as for any parameter. Only when that accumulator runs
   in this backward and nothing else must see the micro-batch's own gradient
   (:func:`_accumulates_in_place`); otherwise the plain product. The input side is the plain
   ``F.linear(x, W.detach())``. A zero-cost node (:class:`JoinGrad`) joins the two, so the
   split backward (:mod:`npu_train.pipeline.backward`) sees an ordinary boundary node: its B pass
   computes only ``g W`` and its W pass only the weight side.
2. **Cross-entropy.** ``F.cross_entropy`` is ``log_softmax`` + ``nll_loss``; its backward writes a
   dense one-hot gradient, then reads it back with the saved log-probabilities into a third tensor.
   :func:`cross_entropy_sum` runs the same forward, and its backward turns the saved log-probabilities
   into ``(softmax - onehot) * g`` in place (same record).

Both equal the plain path to rounding (not bit for bit: the sum ``grad + g^T x`` is rounded once
instead of twice, and the cross-entropy's gradient is ``(exp(lp) - 1) g`` at the label instead of
``exp(lp) g - g``); the pipeline tests
compare them with the single-process reference, which uses the plain path
(``tests/integration/reference.py``).
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
    """Whether ``weight.grad`` (``grad``) can take ``g^T x`` by ``addmm_``: a dense contiguous fp32
    accumulator of the weight's shape and device, no double backward, no tensor hook on the weight (it
    must see this micro-batch's gradient, not the sum), and this backward runs the weight's gradient
    accumulator (``backward()`` / ``autograd.backward(inputs=)``; not ``autograd.grad``, which returns the
    gradient instead). A bf16 weight's ``.grad`` is folded into an fp32 accumulator and freed by a hook
    after each micro-batch (``optim.adamw``), so it is ``None`` here and the plain product is returned."""
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
    """``HeadWeightGrad.apply(x, weight)``: the weight side of ``y = x W^T``.

    Forward: a zero of ``y``'s shape ``[..., V]`` (a 0-stride view, no memory), to be joined with the
    input side by :class:`JoinGrad`. ``x``: ``[..., H]``, detached (the input side differentiates it).
    Backward: ``g [..., V]`` -> ``(None, dW [V, H])``; with a dense fp32 ``weight.grad`` already there
    it adds ``g^T x`` into that tensor in place, clears ``weight.grad`` and returns the tensor itself,
    which autograd's accumulator takes back without a copy (module docstring)."""

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
    """``JoinGrad.apply(y, z)``: ``y`` (as a view), with the gradient of the result passed to both ``y`` and
    ``z`` unchanged (``z`` must have ``y``'s shape; its value is ignored). Costs nothing forward or
    backward; it is the split backward's boundary node between the head's input and weight sides."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, g


class HeadLinear(nn.Linear):
    """``nn.Linear`` (no bias) for the LM head whose weight gradient accumulates inside the matmul.

    ``forward(x [..., H]) -> [..., V]`` in ``x``'s dtype, the same values as ``nn.Linear``. With
    :attr:`fused_grad` set (the trainer sets it on cpu and cuda cards:
    :data:`npu_train.hardware.FUSED_HEAD_KINDS`), grad mode on and a trained weight, the product's
    two sides are separate autograd nodes (module docstring); otherwise it is ``nn.Linear.forward``.
    The parameter is still ``weight`` and module hooks run as for ``nn.Linear``.

    Limits of the fused path (the trainer meets none of them): no second-order gradient w.r.t. the
    weight (``create_graph``: the input side sees ``W.detach()``); a reference to ``weight.grad`` kept
    across micro-batches makes autograd copy the tensor back instead of taking it (correct, but that
    reference then goes stale and the copy costs a pass); on a stage holding a tied embedding with
    sparse rows, the rows and the head's sum meet in autograd's input buffer, which adds them into a
    new tensor (one dense pass per micro-batch, values unchanged)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **kw) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.fused_grad = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not (self.fused_grad and self.bias is None and w.requires_grad and torch.is_grad_enabled()):
            return super().forward(x)
        return JoinGrad.apply(F.linear(x, w.detach()), HeadWeightGrad.apply(x.detach(), w))


class _CrossEntropySum(torch.autograd.Function):
    """Summed token cross-entropy of ``logits [N, V]`` (fp32) against ``labels [N]`` (int64): forward as
    ``F.cross_entropy`` (``log_softmax`` + the picked log-probabilities), backward in place on the saved
    log-probabilities (:func:`cross_entropy_sum`)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, has_ignored: bool) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        safe = torch.where(valid, labels, torch.zeros_like(labels))
        lp = torch.log_softmax(logits, dim=1)
        tok = lp.gather(1, safe.unsqueeze(1)).squeeze(1).neg_()
        loss = (torch.where(valid, tok, torch.zeros_like(tok)) if has_ignored else tok).sum()
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
    """``F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")`` with a one-pass backward.

    Args:
        logits: ``[N, V]`` fp32 (other float dtypes are upcast first).
        labels: ``[N]`` int64; :data:`IGNORE_INDEX` marks positions that do not count.
    Returns:
        fp32 scalar: the summed loss in nats (differentiable w.r.t. ``logits`` when they require grad;
        without grad mode or ``requires_grad`` it is ``F.cross_entropy``'s, and keeps no softmax).
    Memory: while the graph lives it holds the log-probabilities ``[N, V]`` fp32, as ``F.cross_entropy`` does.
    """
    logits = logits.float()
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    has_ignored = bool((labels == IGNORE_INDEX).any())
    return _CrossEntropySum.apply(logits.contiguous(), labels, has_ignored)
