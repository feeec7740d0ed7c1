"""Vocabulary parallelism's joint action ``V(m)`` (Yeung et al. 2024, "Balancing Pipeline Parallelism with
Vocabulary Parallelism", arXiv 2411.05288, §3): the output layer ``W`` ``[V, H]`` is cut by rows over the ``P``
cards of a pipeline; for one micro-batch every card takes the head stage's final hidden state ``x`` ``[b, S, H]``
(after the final norm), computes its logits slice ``z_p = x W_p^T`` ``[N, V_p]`` in fp32, and the cards combine the
softmax's statistics, so each forms its own slice of the logits' gradient without the others' logits:

- ``M = max_p max_j z_pj`` (all-reduce MAX), ``Z = sum_p sum_j exp(z_pj - M)`` and the target's logit
  ``t = z_{y}`` from the card holding ``y`` (one all-reduce SUM of ``[N, 2]``);
- loss per token ``log Z + M - t`` (next-token cross-entropy in nats; ``IGNORE_INDEX`` targets count nothing);
- ``dz_p = (exp(z_p - M) / Z - onehot_p(y)) * valid / divisor``; the slice's weight gradient ``dz_p^T x`` is
  added to ``W_p``'s ``.grad``; the partial input gradients ``dz_p W_p`` ``[N, H]`` (in the compute dtype: fp32 on
  fp32 runs, bf16 on bf16 ones) are summed on the head stage (reduce SUM), whose backward goes on from there.

:func:`vocab_rows` is the row cut, :func:`vocab_step` one card's share of ``V(m)`` over an :class:`Exchange`
(:class:`GlooExchange` in card processes). No autograd graph is kept: ``V(m)`` is forward and backward at once.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch

from npu_train.model.headops import IGNORE_INDEX

__all__ = ["Exchange", "GlooExchange", "VocabResult", "VocabWork", "vocab_rows", "vocab_step"]


def vocab_rows(vocab_size: int, num_cards: int, card: int) -> tuple[int, int]:
    """``[start, end)`` rows of the output layer card ``card`` of ``num_cards`` holds: ``V // P`` each, one more on
    the first ``V % P`` cards (``torch.tensor_split``'s cut). Raises ValueError for a card outside ``0..P-1`` or
    fewer rows than cards."""
    V, P = int(vocab_size), int(num_cards)
    if not 0 <= card < P or V < P:
        raise ValueError(f"vocab_rows: card {card} of {P} over a vocabulary of {V}")
    q, r = divmod(V, P)
    start = card * q + min(card, r)
    return start, start + q + (1 if card < r else 0)


class Exchange(Protocol):
    """The collectives of one pipeline's cards (``rank`` 0..P-1 in the group; the head stage is ``head``), on
    host fp32 tensors, in place, every card calling them in the same order."""

    head: int

    def broadcast(self, t: torch.Tensor) -> None: ...  # from ``head``
    def all_reduce_max(self, t: torch.Tensor) -> None: ...
    def all_reduce_sum(self, t: torch.Tensor) -> None: ...
    def reduce_sum(self, t: torch.Tensor) -> None: ...  # onto ``head``


class GlooExchange:
    """:class:`Exchange` over a torch.distributed (gloo) ``group``; ``head``: the head stage's global rank."""

    def __init__(self, group, head: int):
        self.group, self.head = group, int(head)

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(t, src=self.head, group=self.group)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)

    def reduce_sum(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.reduce(t, dst=self.head, group=self.group)


class VocabResult:
    """One card's outcome of ``V(m)``: ``loss_sum`` (nats, the micro-batch's summed cross-entropy: the same on
    every card), ``dx`` (the head stage: ``[b, S, H]`` host, in the weight's dtype, the summed input gradient; None
    elsewhere)."""

    def __init__(self, loss_sum: float, dx: Optional[torch.Tensor]):
        self.loss_sum, self.dx = loss_sum, dx


def vocab_step(x: Optional[torch.Tensor], labels: torch.Tensor, weight: torch.Tensor, start: int, divisor: float,
               ex: Exchange, is_head: bool, shape: tuple, train: bool = True) -> VocabResult:
    """One card's share of ``V(m)`` (module docstring). ``x``: the head stage's final hidden state ``[b, S, H]`` on
    the head card (None elsewhere: received); ``shape``: ``(b, S, H)``; ``labels``: shifted int64 ``[b, S]``
    (``IGNORE_INDEX`` not counted), the same on every card; ``weight``: this card's rows ``[start, start + V_p)``
    of the output layer, ``[V_p, H]`` (a Parameter: with ``requires_grad`` and ``train``, ``dz_p^T x`` is added to
    its ``.grad`` through autograd, cast to the weight's dtype); ``divisor``: the step's target tokens (the loss's divisor). ``train=False``:
    the loss only (evaluation). Arithmetic in fp32 on the weight's device; collectives on host copies."""
    b, S, H = shape
    dev = weight.device
    # both travel in the compute dtype (the weight's): the hidden state is the head's norm output in that dtype (no
    # rounding); the partial input gradients are rounded to it on each card and summed in it (fp32 runs: exact as
    # before; bf16: half the bytes of fp32 over gloo and the card<->host copies, and the head's backward takes its
    # output gradient in bf16 anyway)
    wire = weight.dtype
    host = torch.empty((b, S, H), dtype=wire) if x is None else x.detach().to(wire).cpu().contiguous()
    ex.broadcast(host)
    xf = host.to(dev).float().reshape(-1, H)
    y = labels.reshape(-1).to(dev)
    valid = y != IGNORE_INDEX
    local = y - int(start)
    mine = valid & (local >= 0) & (local < weight.shape[0])
    with torch.no_grad():
        w = weight.detach().float()
        z = xf @ w.t()  # [N, V_p]
        mx = z.max(dim=1).values.cpu()
        ex.all_reduce_max(mx)
        m = mx.to(dev)
        e = torch.exp(z - m.unsqueeze(1))
        rows = torch.arange(z.shape[0], device=dev)
        safe = torch.where(mine, local, torch.zeros_like(local))
        st = torch.stack([e.sum(dim=1), torch.where(mine, z[rows, safe], torch.zeros_like(m))], dim=1).cpu()
        ex.all_reduce_sum(st)
        Z, t = st[:, 0].to(dev), st[:, 1].to(dev)
        tok = torch.log(Z) + m - t
        loss_sum = float(torch.where(valid, tok, torch.zeros_like(tok)).sum())
        if not train:
            return VocabResult(loss_sum, None)
        dz = e.div_(Z.unsqueeze(1))
        dz[rows[mine], local[mine]] -= 1.0
        dz.mul_((valid.to(dz.dtype) / float(divisor)).unsqueeze(1))
        dw = dz.t() @ xf if weight.requires_grad else None
        dx = (dz @ w).to(wire).cpu().reshape(b, S, H).contiguous()
    if dw is not None:  # through the weight's own accumulator: its hooks run as under backward()
        torch.autograd.backward([weight], [dw.to(weight.dtype)])
    ex.reduce_sum(dx)
    return VocabResult(loss_sum, dx if is_head else None)


class VocabWork:
    """A card's share of every ``V(m)`` of a run: ``weight`` (its rows ``[start, start + V_p)`` of the output
    layer), the pipeline's :class:`Exchange`, whether this card is the head stage, and ``before`` (None or a
    callable run first: the wait for a pending host update of the weight)."""

    def __init__(self, weight: torch.Tensor, start: int, ex: Exchange, is_head: bool, before=None):
        self.weight, self.start, self.ex, self.is_head, self.before = weight, int(start), ex, bool(is_head), before

    def run(self, x: Optional[torch.Tensor], labels: torch.Tensor, divisor: float, train: bool = True) -> VocabResult:
        """:func:`vocab_step` of one micro-batch (``labels`` ``[b, S]``; ``x`` on the head card)."""
        if self.before is not None:
            self.before()
        b, S = labels.shape
        return vocab_step(x, labels, self.weight, self.start, divisor, self.ex, self.is_head,
                          (b, S, self.weight.shape[1]), train)
