"""The tied embedding's gradient sum between the first and the last stage, off the critical path.

With tied input/output embeddings (``tie_word_embeddings``) and more than one stage, the first
stage holds ``model.embed_tokens.weight`` and the last stage a copy as ``lm_head.weight``, both
``[V, H]``. Before the optimizer step each needs the same gradient, the sum of the two stages'
gradients (Megatron-LM's "embedding group" all-reduce; Shoeybi et al. 2019). A plain all-reduce of
the ``[V, H]`` fp32 gradient after the pipeline drains puts ``V*H*4`` bytes (113 MB for
SmolLM2-135M) on every step's critical path: 0.4-1.0 s of a 13 s step on the 2-core CPU machine
(``tied_s`` in experiments/2026-11-30-bench.md, run 2). Two facts take it off:

- the last stage's ``lm_head`` gradient is final when the last stage's backward ends, which under
  1F1B / zero-bubble schedules is ``P - 1`` backward passes before the first stage's ends (the
  drain), so its dense ``[V, H]`` transfer to the first stage runs while the first stage is still
  computing; the first stage posts the receive when the step starts. In the split-backward
  schedules (``zb*``) the last stage ends its step with deferred weight-gradient (W) passes; it runs
  the ``lm_head`` part of them first and sends the gradient then, before its layers' W passes
  (``StageRunner.run_step(early=...)``), so neither the transfer nor the first stage's wait for it
  sits after the last stage's final W pass;
- the first stage's embedding gradient is zero outside the rows of the token ids it looked up in
  this step (the embedding's backward is an index-add over those rows), and the last stage knows
  those ids too (every stage draws the same micro-batches). Only those ``k <= M*b*S`` rows
  (``k*H*4`` bytes: 2.4 MB for 1024 tokens of SmolLM2) go back, after the first stage's backward.

Result, bit for bit the all-reduce's: the first stage computes ``g_first + g_last`` over all rows;
the last stage ``g_last[rows] + g_first[rows]`` on the looked-up rows and keeps ``g_last`` elsewhere,
where ``g_first`` is exactly zero (IEEE addition is commutative, ``x + 0 == x``). An fp32 gradient on
a ``cpu`` / ``cuda`` card is summed in place (:data:`INPLACE_DEVICES`); any other (bf16 ``.grad``, an
RNGD card) in fp32 on the host and cast back to the gradient buffer's dtype, as the all-reduce did.

Memory: the first stage keeps one ``[V, H]`` fp32 host receive buffer (``V*H*4`` bytes, allocated
once); the last stage one ``[V, H]`` fp32 host copy from the end of its backward until the
exchange ends, except on a ``cpu`` card with an fp32 gradient (already host memory in the wire
dtype: sent as is, without a copy; it is not written until the send has completed). Both are host RAM (card memory only on a ``cpu`` card; the placement model's
``held`` term, :mod:`npu_train.planner.memory`).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["TiedGradExchange", "looked_up_rows"]

#: gloo point-to-point tags of the two messages (distinct from any other p2p in the tied group)
DENSE_TAG, ROWS_TAG = 71, 72
#: devices whose fp32 gradient is summed in place (eager ``index_select`` / ``index_add_``); others
#: (furiosa: compiled graphs) sum on the host
INPLACE_DEVICES = ("cpu", "cuda")


def looked_up_rows(input_ids: list) -> torch.Tensor:
    """Sorted unique token ids of a step's micro-batches: ``input_ids`` is a list of ``[b, S]``
    int64 tensors; returns a 1-D int64 tensor of ``k`` row indices of the embedding matrix (the
    rows its backward can touch). Both stages of the pair compute it from the same micro-batches."""
    return torch.unique(torch.cat([x.reshape(-1) for x in input_ids]), sorted=True)


class TiedGradExchange:
    """Sums the tied embedding gradient of one replica's first and last stage (module docstring).

    Args:
        first: True on the first stage (``embed_tokens``), False on the last (``lm_head``).
        peer: the other stage's global rank (gloo).
        group: the gloo process group of the pair (:meth:`ParallelLayout.tied_group`).
        shape: ``(V, H)`` of the embedding matrix.
        backend: the card's backend (``download`` / ``upload``).

    Use per step: :meth:`begin` before the step's first forward (first stage: posts the dense
    receive), :meth:`send_dense` on the last stage as soon as its ``lm_head`` gradient is final
    (the trainer passes it as ``early`` to ``StageRunner.run_step``), then
    :meth:`finish` on both after their backward, which leaves the sum in the gradient buffer.

    Raises:
        RuntimeError: from torch.distributed, when the peer died or the collective timeout passed.
    """

    def __init__(self, first: bool, peer: int, group, shape: tuple[int, int], backend):
        self.first, self.peer, self.group, self.backend = bool(first), int(peer), group, backend
        self.shape = tuple(int(s) for s in shape)
        self._buf: Optional[torch.Tensor] = None   # first stage: [V, H] fp32 receive buffer
        self._work = None                          # the pending dense isend / irecv
        self._sent: Optional[torch.Tensor] = None  # last stage: the dense host copy being sent
        self._rows: Optional[torch.Tensor] = None  # first stage: the [k, H] rows being sent
        self._rows_work = None                     # ... and their pending isend (see settle)

    def begin(self) -> None:
        """Before the step's first forward: the first stage posts the receive of the last stage's
        dense gradient (so the transfer can run during the first stage's drain); no-op on the last."""
        import torch.distributed as dist

        if not self.first:
            return
        self.settle()
        if self._buf is None:
            self._buf = torch.empty(self.shape, dtype=torch.float32)
        self._work = dist.irecv(self._buf, src=self.peer, group=self.group, tag=DENSE_TAG)

    def settle(self) -> None:
        """First stage: wait until the last step's rows have left (:meth:`finish` sends them without
        waiting). Called by :meth:`begin`; the trainer calls it once more after the step's
        all-reduce, which the last stage joins only after receiving them, so it does not block there.

        Raises:
            RuntimeError: from torch.distributed, when the peer died or the timeout passed."""
        if self._rows_work is not None:
            work, self._rows_work = self._rows_work, None
            work.wait()
        self._rows = None

    def send_dense(self, grad: torch.Tensor) -> None:
        """Last stage, once its ``lm_head`` gradient is final: start sending ``grad`` (``[V, H]``, the final
        ``lm_head`` gradient, any dtype, on the card) to the first stage as fp32 host memory.

        A contiguous fp32 CPU ``grad`` is sent without a copy: the caller must not write it before
        :meth:`finish` (which waits for the send before it adds the first stage's rows)."""
        import torch.distributed as dist

        if self.first:
            raise RuntimeError("send_dense is the last stage's half of the tied exchange")
        if grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous():
            # already the wire format in host memory (an fp32 gradient on a cpu card): sent as is, no
            # [V, H] copy. Nothing writes the buffer until finish() has waited for this send: finish
            # adds the first stage's rows only after the wait; the next write is the next step's
            # backward, after finish; the W passes left in this step's backward when it is sent early do
            # not touch lm_head (StageRunner.run_step runs lm_head's W groups first).
            self._sent = grad
        else:
            self._sent = self.backend.download(grad).float().contiguous()
        self._work = dist.isend(self._sent, dst=self.peer, group=self.group, tag=DENSE_TAG)

    def finish(self, grad: torch.Tensor, rows: torch.Tensor) -> None:
        """After the stage's backward: complete the exchange; ``grad`` (``[V, H]``, the stage's
        gradient buffer of the tied matrix, on the card) then holds the pair's sum. ``rows``: the
        step's :func:`looked_up_rows` (the same on both stages). The first stage returns as soon as
        its own sum is made, with its rows still on their way (:meth:`settle`)."""
        import torch.distributed as dist

        be = self.backend
        # fp32 gradient on a card with eager indexing: sum in place (2 passes over [V, H] instead of 4);
        # otherwise on the host in fp32 and back in the gradient's dtype. Same values either way.
        inplace = grad.dtype == torch.float32 and grad.device.type in INPLACE_DEVICES
        if self.first:
            if self._work is None:
                raise RuntimeError("TiedGradExchange.finish without begin on the first stage")
            if inplace:
                sparse = be.download(grad.index_select(0, rows.to(grad.device)))
                mine = None
            else:
                mine = be.download(grad).float()
                sparse = mine.index_select(0, rows)
            # [k, H] fp32: the only non-zero rows of the first stage's gradient. Sent without waiting:
            # the last stage receives them only at the end of its backward, and this stage's own sum
            # (and the caller's squared norm of it) need not wait for that (experiments/2026-12-01-bench-run8.md)
            self._rows = sparse.float().contiguous()
            self._rows_work = dist.isend(self._rows, dst=self.peer, group=self.group, tag=ROWS_TAG)
            self._work.wait()
            self._work = None
            with torch.no_grad():
                if inplace:
                    # g_first + g_last (a host-memory card adds the received buffer itself)
                    grad.add_(self._buf if grad.device.type == "cpu" else be.upload(self._buf))
                else:
                    grad.copy_(be.upload(mine.add_(self._buf).to(grad.dtype)))
            return
        if self._work is None:
            raise RuntimeError("TiedGradExchange.finish without send_dense on the last stage")
        theirs = torch.empty((rows.numel(), self.shape[1]), dtype=torch.float32)
        dist.recv(theirs, src=self.peer, group=self.group, tag=ROWS_TAG)
        self._work.wait()  # the dense gradient (or its host copy) is no longer read by gloo: writable again
        full, self._work, self._sent = self._sent, None, None
        with torch.no_grad():
            # g_last[rows] + g_first[rows] in fp32; the other rows stay g_last (g_first is 0 there)
            if inplace:
                on_host = grad.device.type == "cpu"
                grad.index_add_(0, rows if on_host else be.upload(rows), theirs if on_host else be.upload(theirs))
            else:  # (``full`` is a host copy here: a gradient sent as is is fp32 on a cpu card, summed in place)
                full.index_copy_(0, rows, full.index_select(0, rows).add_(theirs))
                grad.copy_(be.upload(full.to(grad.dtype)))
