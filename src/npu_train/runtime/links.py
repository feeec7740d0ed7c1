"""Stage-boundary links of one card process: :class:`LinkComm`, the transport behind ``BoundaryComm``."""
from __future__ import annotations

import logging

import zmq

from npu_train.runtime.spec import WorkerSpec
from npu_train.transport import Mailbox, Outbox, TensorLink

log = logging.getLogger("npu_train.worker")


class LinkComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over the shm/ZeroMQ transport: links ``act<s>`` and
    ``grad<s+1>`` per boundary of one replica (:meth:`~npu_train.runtime.layout.ParallelLayout.link_name`),
    created by the sender here; receivers attach on first use, after the start-up barrier."""

    def __init__(self, spec: WorkerSpec, ctx: zmq.Context, backend):
        lay = spec.layout
        r, s, k, P = spec.rank, spec.stage_index, spec.replica, spec.num_stages
        self.rank, self.prev, self.next = r, lay.prev(r), lay.next(r)
        # None: wait while the peer lives (the coordinator's heartbeat check ends a job whose peer died)
        rt = spec.runtime.recv_timeout_s
        self.timeout = None if rt is None else float(rt)
        self.backend = backend
        job, nb, n = spec.job_id, spec.slot_bytes, spec.slots
        # per boundary (indexed by the lower global rank of the pair): shm within a node, inline
        # (payload as a ZeroMQ TCP frame) across nodes
        up = spec.boundary_mode(self.prev) if self.prev is not None else None
        down = spec.boundary_mode(r) if self.next is not None else None
        self.mailbox = Mailbox(ctx, spec.inbox[r], spec.token, logger=log,
                               max_msg_bytes=nb + 65536 if "inline" in (up, down) else None)
        self.out = {p: Outbox(ctx, spec.inbox[p], spec.token, r, send_timeout_s=self.timeout)
                    for p in (self.prev, self.next) if p is not None}
        name = lay.link_name
        self.act_out = TensorLink(down, job, name("act", s, k), nb, n).open_sender() if s < P - 1 else None
        self.grad_out = TensorLink(up, job, name("grad", s, k), nb, n).open_sender() if s > 0 else None
        self.act_in = TensorLink(up, job, name("act", s - 1, k), nb, n) if s > 0 else None
        self.grad_in = TensorLink(down, job, name("grad", s + 1, k), nb, n) if s < P - 1 else None

    def recv_act(self, step, micro):
        return self.act_in.recv("act", step, micro, self.mailbox, self.out[self.prev], self.timeout,
                                device=self.backend.device())

    def send_act(self, step, micro, t):
        self.act_out.send(t, "act", step, micro, self.out[self.next], self.mailbox, self.timeout)

    def recv_grad(self, step, micro):
        return self.grad_in.recv("grad", step, micro, self.mailbox, self.out[self.next], self.timeout,
                                 device=self.backend.device())

    def send_grad(self, step, micro, t):
        self.grad_out.send(t, "grad", step, micro, self.out[self.prev], self.mailbox, self.timeout)

    def close(self) -> None:
        for l in (self.act_out, self.grad_out, self.act_in, self.grad_in):
            if l is not None:
                l.close()
        self.mailbox.close()
        for o in self.out.values():
            o.close()
