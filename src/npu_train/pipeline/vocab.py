"""Vocabulary parallelism's joint action ``V(m)`` (Yeung et al. 2024, "Balancing Pipeline Parallelism with
Vocabulary Parallelism", arXiv 2411.05288, §3): the output layer ``W`` ``[V, H]`` is cut by rows over the ``P``
cards of a pipeline; for one micro-batch every card takes the head stage's final hidden state ``x`` ``[b, S, H]``
(after the final norm), computes its logits slice ``z_p = x W_p^T`` ``[N, V_p]`` in fp32, and the cards combine the
softmax's statistics, so each forms its own slice of the logits' gradient without the others' logits:

- ``M = max_p m_p`` with ``m_p = max_j z_pj``, ``Z = sum_p s_p exp(m_p - M)`` with ``s_p = sum_j exp(z_pj - m_p)``,
  and the target's logit ``t = z_{y}`` from the card holding ``y`` (one all-reduce SUM of a ``[P, N, 3]`` block,
  each card's ``(m_p, s_p, t_p)`` in its own row);
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

__all__ = ["Exchange", "GlooExchange", "VocabResult", "VocabWork", "vocab_core", "vocab_rows", "vocab_step"]


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
    host tensors, in place, every card calling them in the same order. The ``*_async`` ones return a handle whose
    ``wait()`` returns once the tensor holds the result (the broadcasts keep an order of their own: another group)."""

    head: int
    size: int  # cards in the group
    index: int  # this card's place in it (0..size-1)

    def broadcast(self, t: torch.Tensor) -> None: ...  # from ``head``
    def broadcast_async(self, t: torch.Tensor): ...  # from ``head``
    def all_reduce_max(self, t: torch.Tensor) -> None: ...
    def all_reduce_sum(self, t: torch.Tensor) -> None: ...
    def reduce_sum(self, t: torch.Tensor) -> None: ...  # onto ``head``
    def reduce_sum_async(self, t: torch.Tensor): ...  # onto ``head``


class GlooExchange:
    """:class:`Exchange` over a torch.distributed (gloo) ``group``; ``head``: the head stage's global rank;
    ``xgroup``: the same cards' group the hidden states are broadcast over (None: ``group``)."""

    def __init__(self, group, head: int, xgroup=None):
        import torch.distributed as dist

        self.group, self.head = group, int(head)
        self.xgroup = group if xgroup is None else xgroup
        self.size, self.index = dist.get_world_size(group), dist.get_rank(group)

    def broadcast(self, t: torch.Tensor) -> None:
        self.broadcast_async(t).wait()

    def broadcast_async(self, t: torch.Tensor):
        import torch.distributed as dist

        return dist.broadcast(t, src=self.head, group=self.xgroup, async_op=True)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)

    def reduce_sum(self, t: torch.Tensor) -> None:
        self.reduce_sum_async(t).wait()

    def reduce_sum_async(self, t: torch.Tensor):
        import torch.distributed as dist

        return dist.reduce(t, dst=self.head, group=self.group, async_op=True)


class VocabResult:
    """One card's outcome of ``V(m)``: ``loss_sum`` (nats, the micro-batch's summed cross-entropy: the same on
    every card), ``dx`` (the head stage: ``[b, S, H]`` host, in the weight's dtype, the summed input gradient; None
    elsewhere)."""

    def __init__(self, loss_sum: float, dx: Optional[torch.Tensor]):
        self.loss_sum, self.dx = loss_sum, dx


def vocab_step(x: Optional[torch.Tensor], labels: torch.Tensor, weight: torch.Tensor, start: int, divisor: float,
               ex: Exchange, is_head: bool, shape: tuple, train: bool = True) -> VocabResult:
    """One card's share of ``V(m)`` (module docstring), its collectives awaited. ``x``: the head stage's final
    hidden state ``[b, S, H]`` on the head card (None elsewhere: received); ``shape``: ``(b, S, H)``; ``labels``:
    shifted int64 ``[b, S]`` (``IGNORE_INDEX`` not counted), the same on every card; ``weight``: this card's rows
    ``[start, start + V_p)`` of the output layer, ``[V_p, H]`` (a Parameter: with ``requires_grad`` and ``train``,
    ``dz_p^T x`` is added to its ``.grad`` through autograd, cast to the weight's dtype); ``divisor``: the step's
    target tokens (the loss's divisor). ``train=False``: the loss only (evaluation). Arithmetic in fp32 on the
    weight's device; collectives on host copies."""
    host = _wire_x(x, weight, shape)
    ex.broadcast(host)
    res, handle = vocab_core(host, labels, weight, start, divisor, ex, train)
    if handle is not None:
        handle.wait()
    return VocabResult(res.loss_sum, res.dx if is_head else None)


def _wire_x(x: Optional[torch.Tensor], weight: torch.Tensor, shape: tuple) -> torch.Tensor:
    """The host tensor the hidden state travels in: ``x`` in the compute dtype (the weight's; it is the head's norm
    output in that dtype: no rounding), or an empty one of ``shape`` to receive into."""
    if x is None:
        return torch.empty(shape, dtype=weight.dtype)
    return x.detach().to(weight.dtype).cpu().contiguous()


def vocab_core(host: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, start: int, divisor: float,
               ex: Exchange, train: bool = True) -> tuple:
    """:func:`vocab_step` from the received hidden state ``host`` (``[b, S, H]``, compute dtype): ``(VocabResult
    with the loss and this card's partial input gradient ``dx`` (host, ``[b, S, H]``, compute dtype; summed onto the
    head card once the handle's ``wait()`` returns), the reduce's handle (None with ``train=False``))``. The partial
    input gradients are computed and their sum started before the weight gradient, which runs while they travel."""
    b, S, H = host.shape
    dev = weight.device
    # both travel in the compute dtype: the partial input gradients are rounded to it on each card and summed in it
    # (fp32 runs: exact; bf16: half the bytes of fp32 over gloo and the card<->host copies, and the head's backward
    # takes its output gradient in bf16 anyway)
    wire = weight.dtype
    xf = host.to(dev).float().reshape(-1, H)
    y = labels.reshape(-1).to(dev)
    valid = y != IGNORE_INDEX
    local = y - int(start)
    mine = valid & (local >= 0) & (local < weight.shape[0])
    with torch.no_grad():
        w = weight.detach().float()
        z = xf @ w.t()  # [N, V_p]
        # one collective for the statistics: each card's row maximum m_p, its sum of exp(z - m_p) and the target
        # logit (0 off the card holding it) in its own row p of a [P, N, 3] block, the others 0: summed, every card
        # has all of them exactly (adding zeros rounds nothing); then M = max_p m_p, Z = sum_p s_p exp(m_p - M)
        mp = z.max(dim=1).values
        e = torch.exp(z - mp.unsqueeze(1))
        rows = torch.arange(z.shape[0], device=dev)
        safe = torch.where(mine, local, torch.zeros_like(local))
        st = torch.zeros((ex.size, z.shape[0], 3), dtype=torch.float32)
        st[ex.index] = torch.stack([mp, e.sum(dim=1), torch.where(mine, z[rows, safe], torch.zeros_like(mp))],
                                   dim=1).cpu()
        ex.all_reduce_sum(st)
        st = st.to(dev)
        m = st[:, :, 0].max(dim=0).values
        Z = (st[:, :, 1] * torch.exp(st[:, :, 0] - m.unsqueeze(0))).sum(dim=0)
        t = st[:, :, 2].sum(dim=0)
        tok = torch.log(Z) + m - t
        loss_sum = float(torch.where(valid, tok, torch.zeros_like(tok)).sum())
        if not train:
            return VocabResult(loss_sum, None), None
        dz = e.mul_((torch.exp(mp - m) / Z).unsqueeze(1))  # softmax: exp(z - m_p) exp(m_p - M) / Z
        dz[rows[mine], local[mine]] -= 1.0
        dz.mul_((valid.to(dz.dtype) / float(divisor)).unsqueeze(1))
        dx = (dz @ w).to(wire).cpu().reshape(b, S, H).contiguous()
    handle = ex.reduce_sum_async(dx)  # travels while the weight gradient is computed
    if weight.requires_grad:
        with torch.no_grad():
            dw = dz.t() @ xf
        torch.autograd.backward([weight], [dw.to(weight.dtype)])  # the weight's accumulator: its hooks run
    return VocabResult(loss_sum, dx), handle


class VocabWork:
    """A card's share of every ``V(m)`` of a run: ``weight`` (its rows ``[start, start + V_p)`` of the output
    layer), the pipeline's :class:`Exchange`, whether this card is the head stage, and ``before`` (None or a
    callable run first: the wait for a pending host update of the weight).

    The exchange runs in the background where nothing waits for it (Yeung et al. 2024 §4 overlap the output
    layer's communication with computation): the head card starts broadcasting its final hidden state as its
    ``F(m)`` ends (:meth:`post_x`), another card posts its receive ahead (for ``m + 1`` as ``V(m)`` ends), so the
    hidden state travels while the cards finish what they are doing; the cards meet at the softmax statistics;
    each starts the sum of its partial input gradient onto the head and goes on (the weight gradient meanwhile);
    only the head's ``B(m)`` waits for it (:meth:`take_dx`). :meth:`finish` waits for whatever is in flight."""

    def __init__(self, weight: torch.Tensor, start: int, ex: Exchange, is_head: bool, before=None):
        self.weight, self.start, self.ex, self.is_head, self.before = weight, int(start), ex, bool(is_head), before
        self.x: dict = {}  # micro-batch -> (host hidden state, broadcast handle)
        self.dx: dict = {}  # head: micro-batch -> (summed input gradient, reduce handle)
        self.inflight: list = []  # handles nobody waits for until finish()
        self.last_wait = 0.0  # seconds the last run() waited for the hidden state and the statistics

    def post_x(self, m: int, x: Optional[torch.Tensor], shape: tuple) -> None:
        """Start micro-batch ``m``'s hidden-state broadcast: the head card sends ``x`` (``[b, S, H]``), another card
        posts its receive (``x`` None; ``shape`` ``(b, S)``)."""
        host = _wire_x(x, self.weight, tuple(shape)[:2] + (self.weight.shape[1],))
        handle = self.ex.broadcast_async(host)
        self.x[m] = (host, handle)
        if self.is_head:  # the head has its own copy: only the send is in flight
            self.inflight.append((host, handle))

    def run(self, m: int, labels: torch.Tensor, divisor: float, train: bool = True) -> float:
        """``V(m)`` (``labels`` ``[b, S]``; :meth:`post_x` of ``m`` first, else posted here): returns the
        micro-batch's summed loss (nats); the head keeps the summed input gradient for :meth:`take_dx`."""
        if self.before is not None:
            self.before()
        if m not in self.x:
            self.post_x(m, None, tuple(labels.shape))
        host, handle = self.x.pop(m)
        timed = _TimedExchange(self.ex)
        if not self.is_head:
            view = getattr(handle, "view", None)  # the shared-memory exchange: the head's slot itself, no copy
            if view is not None:
                host = timed._timed(view)
            else:
                timed.wait(handle)
        res, red = vocab_core(host, labels, self.weight, self.start, divisor, timed, train)
        self.last_wait = timed.waited
        if red is not None:
            if self.is_head:
                self.dx[m] = (res.dx, red)
            else:
                self.inflight.append((res.dx, red))
        return res.loss_sum

    def take_dx(self, m: int) -> torch.Tensor:
        """The head card: ``V(m)``'s summed input gradient (``[b, S, H]`` host, compute dtype), once it arrived."""
        dx, handle = self.dx.pop(m)
        handle.wait()
        return dx

    def finish(self) -> None:
        """Wait for every collective still in flight (the step's end); raises AssertionError if a micro-batch's
        hidden state or summed gradient was left unused."""
        for _t, h in self.inflight:
            h.wait()
        self.inflight = []
        assert not self.x and not self.dx, f"vocabulary actions left: {sorted(self.x)} {sorted(self.dx)}"


class _TimedExchange:
    """An :class:`Exchange` that adds the seconds its blocking calls (and :meth:`wait`) take to ``waited``."""

    def __init__(self, ex: Exchange):
        self.ex, self.head, self.waited = ex, ex.head, 0.0
        self.size, self.index = ex.size, ex.index

    def _timed(self, fn, *a):
        import time

        t0 = time.perf_counter()
        out = fn(*a)
        self.waited += time.perf_counter() - t0
        return out

    def wait(self, handle) -> None:
        self._timed(handle.wait)

    def all_reduce_max(self, t: torch.Tensor) -> None:
        self._timed(self.ex.all_reduce_max, t)

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        self._timed(self.ex.all_reduce_sum, t)

    def reduce_sum_async(self, t: torch.Tensor):
        return self.ex.reduce_sum_async(t)
