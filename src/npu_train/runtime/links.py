"""Stage-boundary links of one card process: :class:`LinkComm`, the transport behind ``BoundaryComm``."""
from __future__ import annotations

import logging

import zmq

from npu_train.runtime.spec import WorkerSpec
from npu_train.transport import Mailbox, Outbox, TensorLink

log = logging.getLogger("npu_train.worker")


class LinkComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over the shared-memory/ZeroMQ transport.

    Links per boundary ``r|r+1``: ``act<r>`` (r -> r+1) and ``grad<r+1>`` (r+1 -> r); each is
    created (shared-memory ring owned) by its sender in the constructor; receivers attach on
    first use, after the start-up barrier.
    """

    def __init__(self, spec: WorkerSpec, ctx: zmq.Context, backend):
        self.rank, self.P = r, P = spec.rank, spec.world_size
        # None: wait while the peer lives (the coordinator's heartbeat check ends a job whose peer died)
        rt = spec.runtime.recv_timeout_s
        self.timeout = None if rt is None else float(rt)
        self.backend = backend
        mode, job, nb, k = spec.runtime.transport, spec.job_id, spec.slot_bytes, spec.slots
        self.mailbox = Mailbox(ctx, spec.inbox[r], spec.token, logger=log,
                               max_msg_bytes=nb + 65536 if mode == "inline" else None)
        self.out = {p: Outbox(ctx, spec.inbox[p], spec.token, r, send_timeout_s=self.timeout)
                    for p in (r - 1, r + 1) if 0 <= p < P}
        self.act_out = TensorLink(mode, job, f"act{r}", nb, k).open_sender() if r < P - 1 else None
        self.grad_out = TensorLink(mode, job, f"grad{r}", nb, k).open_sender() if r > 0 else None
        self.act_in = TensorLink(mode, job, f"act{r - 1}", nb, k) if r > 0 else None
        self.grad_in = TensorLink(mode, job, f"grad{r + 1}", nb, k) if r < P - 1 else None

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
