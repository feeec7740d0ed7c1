"""Stage-boundary links of one card process: :class:`LinkComm`, the transport behind ``BoundaryComm``."""
from __future__ import annotations

import logging

import zmq

from npu_train.runtime.spec import WorkerSpec
from npu_train.transport import Mailbox, Outbox, TensorLink

log = logging.getLogger("npu_train.worker")


class LinkComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over the shared-memory/ZeroMQ transport.

    Links per boundary ``r|r+1``: ``act<r>`` (r -> r+1) and ``grad<r+1>`` (r+1 -> r), over the
    boundary's transport (:meth:`~npu_train.runtime.spec.WorkerSpec.boundary_mode`); each is
    created (shared-memory ring owned) by its sender in the constructor; receivers attach on
    first use, after the start-up barrier.
    """

    def __init__(self, spec: WorkerSpec, ctx: zmq.Context, backend):
        self.rank, self.P = r, P = spec.rank, spec.world_size
        self.timeout = float(spec.runtime.recv_timeout_s)
        self.backend = backend
        job, nb, k = spec.job_id, spec.slot_bytes, spec.slots
        # per boundary: shm within a node, inline (payload as a ZeroMQ TCP frame) across nodes
        up = spec.boundary_mode(r - 1) if r > 0 else None        # boundary r-1 | r
        down = spec.boundary_mode(r) if r < P - 1 else None      # boundary r | r+1
        self.mailbox = Mailbox(ctx, spec.inbox[r], spec.token, logger=log,
                               max_msg_bytes=nb + 65536 if "inline" in (up, down) else None)
        self.out = {p: Outbox(ctx, spec.inbox[p], spec.token, r) for p in (r - 1, r + 1) if 0 <= p < P}
        self.act_out = TensorLink(down, job, f"act{r}", nb, k).open_sender() if r < P - 1 else None
        self.grad_out = TensorLink(up, job, f"grad{r}", nb, k).open_sender() if r > 0 else None
        self.act_in = TensorLink(up, job, f"act{r - 1}", nb, k) if r > 0 else None
        self.grad_in = TensorLink(down, job, f"grad{r + 1}", nb, k) if r < P - 1 else None

    def recv_act(self, step, micro):
        return self.act_in.recv("act", step, micro, self.mailbox, self.out[self.rank - 1], self.timeout,
                                device=self.backend.device())

    def send_act(self, step, micro, t):
        self.act_out.send(t, "act", step, micro, self.out[self.rank + 1], self.mailbox, self.timeout)

    def recv_grad(self, step, micro):
        return self.grad_in.recv("grad", step, micro, self.mailbox, self.out[self.rank + 1], self.timeout,
                                 device=self.backend.device())

    def send_grad(self, step, micro, t):
        self.grad_out.send(t, "grad", step, micro, self.out[self.rank - 1], self.mailbox, self.timeout)

    def close(self) -> None:
        for l in (self.act_out, self.grad_out, self.act_in, self.grad_in):
            if l is not None:
                l.close()
        self.mailbox.close()
        for o in self.out.values():
            o.close()
