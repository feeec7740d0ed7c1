"""The tied embedding's gradient sum between a replica's first and last stage, off the critical path: the
last stage sends its dense ``[V, H]`` gradient during the first stage's drain, the first returns only
the ``k`` rows it looked up. Bit-identical to an all-reduce; docs/design.md §17.
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
    """Sorted unique token ids of ``input_ids`` (list of int64 ``[b, S]``): int64 ``[k]`` embedding rows."""
    return torch.unique(torch.cat([x.reshape(-1) for x in input_ids]), sorted=True)


class TiedGradExchange:
    """Sums the tied embedding gradient ``[V, H]`` (``shape``) of one replica's ``first`` and last stage with
    ``peer`` over ``group``. Per step: :meth:`begin`, :meth:`send_dense` (last stage, once final), then
    :meth:`finish` on both. Raises RuntimeError from torch.distributed when the peer died or timed out."""

    def __init__(self, first: bool, peer: int, group, shape: tuple[int, int], backend):
        self.first, self.peer, self.group, self.backend = bool(first), int(peer), group, backend
        self.shape = tuple(int(s) for s in shape)
        self._buf: Optional[torch.Tensor] = None   # first stage: [V, H] fp32 receive buffer
        self._work = None                          # the pending dense isend / irecv
        self._sent: Optional[torch.Tensor] = None  # last stage: the dense host copy being sent
        self._rows: Optional[torch.Tensor] = None  # first stage: the [k, H] rows being sent
        self._rows_work = None                     # ... and their pending isend (see settle)

    def begin(self) -> None:
        """Before the first forward: the first stage posts the dense receive; no-op on the last."""
        import torch.distributed as dist

        if not self.first:
            return
        self.settle()
        if self._buf is None:
            self._buf = torch.empty(self.shape, dtype=torch.float32)
        self._work = dist.irecv(self._buf, src=self.peer, group=self.group, tag=DENSE_TAG)

    def settle(self) -> None:
        """First stage: wait until the last step's rows have left. Raises RuntimeError (peer dead, timeout)."""
        if self._rows_work is not None:
            work, self._rows_work = self._rows_work, None
            work.wait()
        self._rows = None

    def send_dense(self, grad: torch.Tensor) -> None:
        """Last stage: start sending the final ``grad`` (``[V, H]``) as fp32 host memory; a contiguous fp32 CPU
        ``grad`` goes without a copy and must not be written before :meth:`finish`."""
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
        """After the backward: ``grad`` (``[V, H]``, the stage's buffer) then holds the pair's sum; ``rows``: the
        step's :func:`looked_up_rows`."""
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
