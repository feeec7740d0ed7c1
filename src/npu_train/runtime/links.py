"""Stage-boundary links of one card process: :class:`LinkComm`, the transport behind ``BoundaryComm``."""
from __future__ import annotations

import logging
from typing import Optional

import zmq

from npu_train.pipeline.schedule import card_of, chunks_per_card, virtual_stage
from npu_train.runtime.copies import BoundaryCopies, overlap_decision
from npu_train.runtime.jobstore import peer_address, picks_port, publish_address
from npu_train.runtime.spec import WorkerSpec
from npu_train.transport import Mailbox, Outbox, TensorLink

log = logging.getLogger("npu_train.worker")


class LinkComm:
    """:class:`npu_train.pipeline.stage.BoundaryComm` over the shm/ZeroMQ transport: links ``act<s>`` and
    ``grad<s+1>`` per boundary of one replica (:meth:`~npu_train.runtime.layout.ParallelLayout.link_name`),
    created by the sender here; receivers attach on first use, after the start-up barrier.

    A card of a two-chunk schedule (``zbv``, ``interleaved``) has one :class:`ChunkLinks` per chunk
    (:meth:`chunk`), named by the virtual stages' boundaries (``act<v>`` from virtual stage ``v`` to ``v+1``,
    ``grad<v+1>`` back); a boundary whose two virtual stages sit on this card (ZB-V's turn on the last card)
    is an in-process hand-over.

    ``overlap`` (``runtime.overlap_copies``; :func:`~npu_train.runtime.copies.overlap_decision` decides with the
    backend's memory-type flag): the copies run in a :class:`~npu_train.runtime.copies.BoundaryCopies` thread
    (:attr:`copies`, None when synchronous); :meth:`flush` at the end of each step. ``store``: the job's store
    (:mod:`npu_train.runtime.jobstore`), through which mailboxes bound on kernel-picked ports (``tcp://host:*``)
    tell their peers their addresses (:attr:`peer_addr`: the peers' mailbox addresses as connected to)."""

    def __init__(self, spec: WorkerSpec, ctx: zmq.Context, backend, overlap: Optional[bool] = None, store=None):
        lay = spec.layout
        r, s, k, P = spec.rank, spec.stage_index, spec.replica, spec.num_stages
        self.rank, self.prev, self.next = r, lay.prev(r), lay.next(r)
        # None: wait while the peer lives (the coordinator's heartbeat check ends a job whose peer died)
        rt = spec.runtime.recv_timeout_s
        self.timeout = None if rt is None else float(rt)
        self.backend = backend
        self.spec = spec
        kind = spec.train.schedule
        C = chunks_per_card(kind)
        # the cards this one exchanges tensors with (chunked: the neighbours in the virtual pipeline)
        peers = set()
        for c in range(C):
            v = virtual_stage(kind, P, s, c)
            for w in (v - 1, v + 1):
                if 0 <= w < C * P and card_of(kind, P, w)[0] != s:
                    peers.add(card_of(kind, P, w)[0])
        modes = {self._mode(s, p) for p in peers}
        self.mailbox = Mailbox(ctx, spec.inbox[r], spec.token, logger=log,
                               max_msg_bytes=spec.slot_bytes + 65536 if "inline" in modes else None)
        # a mailbox on a port picked at its bind (``tcp://host:*``): its address goes through the job's store
        if store is not None and picks_port(spec.inbox[r]):
            publish_address(store, r, self.mailbox.addr)
        self.peer_addr = {}
        for q in (lay.rank(k, p) for p in sorted(peers)):
            self.peer_addr[q] = spec.inbox[q] if store is None else peer_address(store, q, spec.inbox[q])
        self.out = {q: Outbox(ctx, a, spec.token, r, send_timeout_s=self.timeout) for q, a in self.peer_addr.items()}
        self.handover = _Handover()
        self.views = [ChunkLinks(self, kind, c) for c in range(C)]
        self.links = [l for view in self.views for l in view.links()]
        on, self.overlap_why = overlap_decision(overlap, backend)
        # said when on, warned when asked for and unsafe here; the default off (cpu, cuda) is not news
        (log.info if on else log.warning if overlap else log.debug)("stage-boundary copies: %s", self.overlap_why)
        self.copies = None
        if on and peers:
            self.copies = BoundaryCopies(ctx, self.peer_addr, spec.token, r, self.timeout,
                                         getattr(backend, "thread_init", None))

    def _mode(self, a: int, b: int) -> str:
        """Transport between cards ``a`` and ``b`` of this replica: the boundary's, or for cards that are not
        neighbours (interleaved's turn from the last card to the first) inline if any boundary is."""
        lo, hi = min(a, b), max(a, b)
        if hi - lo == 1:
            return self.spec.boundary_mode(lo)
        modes = {self.spec.boundary_mode(x) for x in range(lo, hi)}
        return "inline" if "inline" in modes else self.spec.runtime.transport

    def chunk(self, c: int) -> "ChunkLinks":
        """The links of this card's chunk ``c``."""
        return self.views[c]

    # one chunk per card: this object is the BoundaryComm
    def recv_act(self, step, micro, with_meta=False):
        return self.views[0].recv_act(step, micro, with_meta)

    def send_act(self, step, micro, t, meta=None):
        self.views[0].send_act(step, micro, t, meta)

    def recv_grad(self, step, micro, with_meta=False):
        return self.views[0].recv_grad(step, micro, with_meta)

    def send_grad(self, step, micro, t, meta=None):
        self.views[0].send_grad(step, micro, t, meta)

    def fetch_act(self, step, micro):
        self.views[0].fetch_act(step, micro)

    def fetch_grad(self, step, micro):
        self.views[0].fetch_grad(step, micro)

    def flush(self) -> None:
        """End of a step: the copy thread's last send is out (no-op when synchronous)."""
        if self.copies is not None:
            self.copies.flush()

    def close(self) -> None:
        if self.copies is not None:
            self.copies.close()
        for l in self.links:
            l.close()
        self.mailbox.close()
        for o in self.out.values():
            o.close()


class _Handover:
    """Tensors handed between two chunks of one card: ``acts`` / ``grads`` by ``(step, micro)``."""

    def __init__(self):
        self.acts: dict = {}
        self.grads: dict = {}


class ChunkLinks:
    """The ``BoundaryComm`` of one chunk (virtual stage ``v``) of a card: links to the card holding ``v-1``
    (activations in, gradients out) and ``v+1`` (activations out, gradients in), or the card's
    :class:`_Handover` where that is this card."""

    def __init__(self, comm: LinkComm, kind: str, c: int):
        spec, lay = comm.spec, comm.spec.layout
        s, k, P = spec.stage_index, spec.replica, spec.num_stages
        self.comm = comm
        chunked = chunks_per_card(kind) > 1
        v = virtual_stage(kind, P, s, c) if chunked else s
        V = P * chunks_per_card(kind)
        name = lay.link_name
        job, nb, n = spec.job_id, spec.slot_bytes, spec.slots
        prev = card_of(kind, P, v - 1)[0] if v > 0 else None
        nxt = card_of(kind, P, v + 1)[0] if v < V - 1 else None
        self.local_prev, self.local_next = prev == s, nxt == s
        self.prev_rank = None if prev is None or self.local_prev else lay.rank(k, prev)
        self.next_rank = None if nxt is None or self.local_next else lay.rank(k, nxt)
        up = comm._mode(s, prev) if self.prev_rank is not None else None
        down = comm._mode(s, nxt) if self.next_rank is not None else None
        self.act_out = TensorLink(down, job, name("act", v, k), nb, n).open_sender() if down else None
        self.grad_out = TensorLink(up, job, name("grad", v, k), nb, n).open_sender() if up else None
        self.act_in = TensorLink(up, job, name("act", v - 1, k), nb, n) if up else None
        self.grad_in = TensorLink(down, job, name("grad", v + 1, k), nb, n) if down else None
        # message kinds: one chunk per card keeps "act" / "grad"; two chunks name each link's own
        self.kinds = (("act", "act", "grad", "grad") if not chunked else
                      (f"act{v - 1}", f"act{v}", f"grad{v + 1}", f"grad{v}"))

    def flush(self) -> None:
        self.comm.flush()

    def links(self) -> list:
        return [l for l in (self.act_out, self.grad_out, self.act_in, self.grad_in) if l is not None]

    # ``meta`` (mixtures of experts: the router statistics, npu_train.pipeline.moeaux) rides in the header's
    # ``moe`` field and ``with_meta=True`` returns ``(tensor, meta or None)``; a hand-over between two chunks of
    # this card carries none (the load-balancing loss refuses two-chunk schedules)
    def recv_act(self, step, micro, with_meta=False):
        if self.local_prev:
            t = self.comm.handover.acts.pop((step, micro))
            return (t, None) if with_meta else t
        return self._recv(self.act_in, self.kinds[0], step, micro, self.prev_rank, with_meta)

    def send_act(self, step, micro, t, meta=None):
        if self.local_next:
            self.comm.handover.acts[(step, micro)] = t
            return
        self._send(self.act_out, t, self.kinds[1], step, micro, self.next_rank, meta)

    def recv_grad(self, step, micro, with_meta=False):
        if self.local_next:
            t = self.comm.handover.grads.pop((step, micro))
            return (t, None) if with_meta else t
        return self._recv(self.grad_in, self.kinds[2], step, micro, self.next_rank, with_meta)

    def send_grad(self, step, micro, t, meta=None):
        if self.local_prev:
            self.comm.handover.grads[(step, micro)] = t
            return
        self._send(self.grad_out, t, self.kinds[3], step, micro, self.prev_rank, meta)

    # the next action's input, copied onto the card ahead while this action computes (copy thread only;
    # nothing for a hand-over or when the message has not arrived yet)
    def fetch_act(self, step, micro):
        c = self.comm
        if c.copies is not None and not self.local_prev and self.act_in is not None:
            c.copies.fetch_ahead(self.act_in, self.kinds[0], step, micro, self.prev_rank, c.mailbox,
                                 c.backend.device())

    def fetch_grad(self, step, micro):
        c = self.comm
        if c.copies is not None and not self.local_next and self.grad_in is not None:
            c.copies.fetch_ahead(self.grad_in, self.kinds[2], step, micro, self.next_rank, c.mailbox,
                                 c.backend.device())

    def _recv(self, link, kind, step, micro, peer, with_meta):
        c = self.comm
        if c.copies is not None:
            got = c.copies.recv(link, kind, step, micro, peer, c.mailbox, c.out[peer], c.backend.device())
            return _split(got, True) if with_meta else got[0]
        return _split(link.recv(kind, step, micro, c.mailbox, c.out[peer], c.timeout,
                                device=c.backend.device(), return_header=with_meta), with_meta)

    def _send(self, link, t, kind, step, micro, peer, meta):
        c = self.comm
        extra = None if meta is None else {"moe": meta}
        if c.copies is not None:
            c.copies.send(link, t, kind, step, micro, peer, c.mailbox, extra=extra)
            return
        link.send(t, kind, step, micro, c.out[peer], c.mailbox, c.timeout, extra=extra)


def _split(got, with_meta: bool):
    """``TensorLink.recv``'s result as ``(tensor, header's moe field)`` when ``with_meta``, else the tensor."""
    return (got[0], got[1].get("moe")) if with_meta else got
