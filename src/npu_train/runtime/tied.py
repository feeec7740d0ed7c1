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

The dense transfer: with both stages on one node (every stage boundary on shared memory) the last
stage copies its gradient into a ``[V, H]`` fp32 shared-memory segment (``npt_<job>_tied<replica>``,
created by the last stage, removed with the job's other segments) and sends a 1-element flag; the
first stage adds the segment to its gradient directly and sends a 1-element acknowledgement back,
which the last stage waits for before it writes the segment again (the next step). Across nodes
the dense gradient goes through gloo. Over gloo's loopback TCP the 113 MB took the first stage
~0.27 s after its backward on the 2-core machine (``tied`` in ``runtime.trace``, zb-h2, P = 2,
M = 8, seq 128) because the transfer runs on the same cores as both stages' compute; through shared
memory it is one copy on the last stage and the add on the first (``experiments/2026-12-01-bench-run7.md``).

Memory: the first stage keeps one ``[V, H]`` fp32 host receive buffer (``V*H*4`` bytes, allocated
once); the last stage one ``[V, H]`` fp32 host copy from the end of its backward until the
exchange ends, except on a ``cpu`` card with an fp32 gradient (already host memory in the wire
dtype: sent as is, without a copy; it is not written until the send has completed). With shared
memory the segment (on the last stage's node, ``/dev/shm``) replaces the first stage's buffer and the
last stage's send copies into it. Both are host RAM (card memory only on a ``cpu`` card; the placement model's
``held`` term, :mod:`npu_train.planner.memory`).
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["TiedGradExchange", "looked_up_rows"]

#: gloo point-to-point tags of the messages (distinct from any other p2p in the tied group): the dense
#: gradient (or, through shared memory, its 1-element "written" flag), the rows, the "read" acknowledgement
DENSE_TAG, ROWS_TAG, ACK_TAG = 71, 72, 73
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
        shm_name: full shared-memory segment name for the dense gradient (both stages on one node;
            :func:`npu_train.transport.shm.segment_name`), created by the last stage here, attached by
            the first stage at its first :meth:`begin` (after a barrier: the trainer's); None = gloo.

    Use per step: :meth:`begin` before the step's first forward (first stage: posts the dense
    receive), :meth:`send_dense` on the last stage as soon as its ``lm_head`` gradient is final
    (the trainer passes it as ``early`` to ``StageRunner.run_step``), then
    :meth:`finish` on both after their backward, which leaves the sum in the gradient buffer.

    Raises:
        RuntimeError: from torch.distributed, when the peer died or the collective timeout passed.
        ShmTooSmallError: ``/dev/shm`` cannot hold the ``V*H*4``-byte segment (names the fix).
    """

    def __init__(self, first: bool, peer: int, group, shape: tuple[int, int], backend,
                 shm_name: Optional[str] = None):
        self.first, self.peer, self.group, self.backend = bool(first), int(peer), group, backend
        self.shape = tuple(int(s) for s in shape)
        self._buf: Optional[torch.Tensor] = None   # first stage: [V, H] fp32 receive buffer (or the segment)
        self._work = None                          # the pending dense isend / irecv (shm: the flag's)
        self._sent: Optional[torch.Tensor] = None  # last stage: the dense host copy being sent
        self.shm_name = shm_name
        self._seg = None                           # the ShmSegment of the dense gradient
        self._shm: Optional[torch.Tensor] = None   # [V, H] fp32 view of it
        self._ack = None                           # the pending "read" acknowledgement (isend / irecv)
        self._flag = torch.zeros(1)
        if shm_name is not None and not self.first:
            from npu_train.transport.shm import ShmSegment

            self._seg = ShmSegment.create(shm_name, self.shape[0] * self.shape[1] * 4)
            self._shm = torch.frombuffer(self._seg.buf, dtype=torch.float32).view(self.shape)

    def _wait_ack(self) -> None:
        if self._ack is not None:
            self._ack.wait()
            self._ack = None

    def begin(self) -> None:
        """Before the step's first forward: the first stage posts the receive of the last stage's
        dense gradient (so the transfer can run during the first stage's drain); no-op on the last."""
        import torch.distributed as dist

        if not self.first:
            return
        if self.shm_name is not None:
            self._wait_ack()  # the previous step's acknowledgement has left
            if self._seg is None:
                from npu_train.transport.shm import ShmSegment

                self._seg = ShmSegment.attach(self.shm_name)
                self._buf = torch.frombuffer(self._seg.buf, dtype=torch.float32).view(self.shape)
            self._work = dist.irecv(self._flag, src=self.peer, group=self.group, tag=DENSE_TAG)
            return
        if self._buf is None:
            self._buf = torch.empty(self.shape, dtype=torch.float32)
        self._work = dist.irecv(self._buf, src=self.peer, group=self.group, tag=DENSE_TAG)

    def send_dense(self, grad: torch.Tensor) -> None:
        """Last stage, once its ``lm_head`` gradient is final: start sending ``grad`` (``[V, H]``, the final
        ``lm_head`` gradient, any dtype, on the card) to the first stage as fp32 host memory.

        A contiguous fp32 CPU ``grad`` is sent without a copy: the caller must not write it before
        :meth:`finish` (which waits for the send before it adds the first stage's rows)."""
        import torch.distributed as dist

        if self.first:
            raise RuntimeError("send_dense is the last stage's half of the tied exchange")
        if self._shm is not None:
            self._wait_ack()  # the first stage has read the previous step's gradient
            if grad.dtype == torch.float32 and grad.device.type in INPLACE_DEVICES:
                self._shm.copy_(grad)  # finish() sums in place on the card: no host copy kept
            else:  # finish() sums on the host in fp32: keep the host copy, the segment is the first stage's
                self._sent = self.backend.download(grad).float().contiguous()
                self._shm.copy_(self._sent)
            self._work = dist.isend(self._flag, dst=self.peer, group=self.group, tag=DENSE_TAG)
            return
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
        step's :func:`looked_up_rows` (the same on both stages)."""
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
            # [k, H] fp32: the only non-zero rows of the first stage's gradient
            dist.send(sparse.float().contiguous(), dst=self.peer, group=self.group, tag=ROWS_TAG)
            self._work.wait()
            self._work = None
            with torch.no_grad():
                if inplace:
                    # g_first + g_last (a host-memory card adds the received buffer itself)
                    grad.add_(self._buf if grad.device.type == "cpu" else be.upload(self._buf))
                else:
                    grad.copy_(be.upload(mine.add_(self._buf).to(grad.dtype)))
            if self.shm_name is not None:  # the segment is read: the last stage may write it again
                self._ack = dist.isend(self._flag, dst=self.peer, group=self.group, tag=ACK_TAG)
            return
        if self._work is None:
            raise RuntimeError("TiedGradExchange.finish without send_dense on the last stage")
        theirs = torch.empty((rows.numel(), self.shape[1]), dtype=torch.float32)
        dist.recv(theirs, src=self.peer, group=self.group, tag=ROWS_TAG)
        self._work.wait()  # the dense gradient (or its host copy) is no longer read by gloo: writable again
        full, self._work, self._sent = self._sent, None, None
        if self._shm is not None:  # the first stage acknowledges once it has read the segment
            self._ack = dist.irecv(self._flag, src=self.peer, group=self.group, tag=ACK_TAG)
        with torch.no_grad():
            # g_last[rows] + g_first[rows] in fp32; the other rows stay g_last (g_first is 0 there)
            if inplace:
                on_host = grad.device.type == "cpu"
                grad.index_add_(0, rows if on_host else be.upload(rows), theirs if on_host else be.upload(theirs))
            else:  # (``full`` is a host copy here: a gradient sent as is is fp32 on a cpu card, summed in place)
                full.index_copy_(0, rows, full.index_select(0, rows).add_(theirs))
                grad.copy_(be.upload(full.to(grad.dtype)))

    def close(self) -> None:
        """Unmap the shared-memory segment (the last stage, its creator, also removes its name; the
        launcher removes every segment of the job on any exit path as well). Idempotent."""
        self._buf = self._shm = None
        if self._seg is not None:
            self._seg.close()
            if self._seg.owner:
                self._seg.unlink()
            self._seg = None
