"""Stage-boundary copies overlapped with compute: :class:`BoundaryCopies`, two copy threads per card process.

Without it every boundary copy runs in the card process's own thread between its actions: ``TensorLink.send``
copies card -> shared-memory slot before the next action starts, ``TensorLink.recv`` slot -> card after the
previous one ended (the planner's ``CostModel.boundary_copies``). With it, a send is handed to the send thread
(the card thread only reserves the slot, so every mailbox read stays in the card thread) and the card goes on;
before an action computes, the card thread looks whether the *next* action's input has already arrived and, if
so, has the fetch thread copy it onto the card while this action computes (card -> host and host -> card in
separate threads, as PCIe moves both directions at once; ``pipeline/schedule.py``'s ``copy_timeline`` is
this, step by step). Bounds (what the plan counts,
``planner/memory.py``'s ``overlap`` term): at most one send in flight (a send first waits for the previous
one) and one input fetched ahead, so a card holds at most two ``[b, S, H]`` boundary tensors more than the
synchronous path (a gradient kept alive by its pending send, the next action's input on the card one action
early). The copy threads run copies only, one at a time each; they never wait for a peer (a send's slot was
reserved, a fetched input's header had arrived), so they add no wait cycle to a schedule. Values are bytes
moved, so the training is bitwise the same with and without it.

Safe only where a second thread may allocate on the card: :func:`overlap_decision` (furiosa-torch 2026.2 kept
the device-memory-type flag process-wide, so an upload from another thread could land in a 0-byte pool;
``backends/furiosa.py`` probes it at setup). ZeroMQ sockets are per thread: each copy thread has its own
:class:`~npu_train.transport.Outbox` per peer, made and closed in that thread."""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

log = logging.getLogger("npu_train.worker")

__all__ = ["BoundaryCopies", "overlap_decision"]


def overlap_decision(setting: Optional[bool], backend) -> tuple[bool, str]:
    """``(on, why)`` for ``runtime.overlap_copies`` = ``setting`` on ``backend`` (after its ``setup()``):
    ``False`` off; otherwise only where ``backend.memory_flag_thread_local is True`` (else off, the synchronous
    copies); ``None`` (auto) on for accelerator cards of kind ``furiosa`` (cpu: the copies are memory copies on
    the card's own cores; cuda: one default stream, ask with ``true``); ``True`` on (tests use it on cpu)."""
    if setting is False:
        return False, "runtime.overlap_copies=false"
    flag = getattr(backend, "memory_flag_thread_local", None)
    if flag is not True:
        detail = getattr(backend, "memory_flag_probe_detail", "") or f"memory_flag_thread_local={flag}"
        return False, f"the device memory-type flag is not thread-local ({detail}): synchronous copies"
    if setting is None and getattr(backend, "kind", "") != "furiosa":
        return False, f"runtime.overlap_copies=null (auto): off on {getattr(backend, 'kind', '?')} cards"
    return True, "copy thread on (memory-type flag thread-local)"


class BoundaryCopies:
    """The copy threads of one card process (``send``: card -> slot and the header; ``fetch``: slot -> card and the
    credit) and their bookkeeping (one card thread uses it).

    ``ctx``: the process's ZeroMQ context; ``addrs``: peer rank -> its inbox address; ``token``/``rank``: as the
    card's :class:`~npu_train.transport.Outbox`; ``timeout``: the send timeout (None: forever); ``thread_init``:
    run first in each copy thread (``Backend.thread_init``: the device context, memory accounting). Counters:
    ``sends`` (handed to the thread), ``fetched`` (inputs copied ahead), ``direct`` (inputs copied in the card
    thread: not there when looked for)."""

    def __init__(self, ctx, addrs: dict, token: str, rank: int, timeout: Optional[float],
                 thread_init: Optional[Callable[[], None]] = None):
        self.ctx, self.addrs, self.token, self.rank, self.timeout = ctx, dict(addrs), token, rank, timeout
        # per thread: peer rank -> Outbox, touched only in that thread
        self._outs: dict = {"send": {}, "fetch": {}}
        self._pools = {w: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"npu-train-{w}",
                                             initializer=thread_init) for w in ("send", "fetch")}
        self._send: Optional[Future] = None
        self._ahead: Optional[tuple] = None  # (key, Future of (tensor, header))
        self.sends = self.fetched = self.direct = 0

    def _out(self, which: str, peer: int):
        """Copy thread ``which``'s own outbox to ``peer`` (made on first use, in that thread)."""
        o = self._outs[which].get(peer)
        if o is None:
            from npu_train.transport import Outbox

            o = self._outs[which][peer] = Outbox(self.ctx, self.addrs[peer], self.token, self.rank,
                                          send_timeout_s=self.timeout)
        return o

    # ------------------------------------------------------------------ sends
    def send(self, link, t, kind: str, step: int, micro: int, peer: int, mailbox, extra=None) -> None:
        """Send ``t`` on ``link`` to ``peer``: wait for the previous send, reserve a slot here (credits come to
        ``mailbox``, read in this thread), then the copy and the header in the send thread."""
        self.wait_send()
        slot = link.reserve(t, mailbox, self.timeout, extra=extra)
        self._send = self._pools["send"].submit(self._post, link, slot, t, kind, step, micro, peer, extra)
        self.sends += 1

    def _post(self, link, slot, t, kind, step, micro, peer, extra) -> None:
        link.post(slot, t, kind, step, micro, self._out("send", peer), extra=extra)

    def wait_send(self) -> None:
        """Block until the send in flight (if any) is out; re-raises its error."""
        fut, self._send = self._send, None
        if fut is not None:
            fut.result()

    # ------------------------------------------------------------------ receives
    def fetch_ahead(self, link, kind: str, step: int, micro: int, peer: int, mailbox, device) -> bool:
        """If the message ``(kind, step, micro)`` of ``link`` is already in ``mailbox`` and nothing else is fetched
        ahead, have the fetch thread copy it onto ``device`` (and return its credit); True when it does."""
        if self._ahead is not None:
            return False
        got = link.take(kind, step, micro, mailbox, wait=False)
        if got is None:
            return False
        h, payload = got
        fut = self._pools["fetch"].submit(self._finish, link, h, payload, peer, device)
        self._ahead = ((link.name, kind, step, micro), fut)
        return True

    def _finish(self, link, h, payload, peer, device):
        return link.finish(h, payload, self._out("fetch", peer), device, return_header=True)

    def recv(self, link, kind: str, step: int, micro: int, peer: int, mailbox, reply, device):
        """``(tensor on device, header)`` of ``(kind, step, micro)``: the copy fetched ahead, else a receive in
        this thread (replying through the card thread's ``reply``)."""
        if self._ahead is not None and self._ahead[0] == (link.name, kind, step, micro):
            fut, self._ahead = self._ahead[1], None
            self.fetched += 1
            return fut.result()
        self.direct += 1
        return link.recv(kind, step, micro, mailbox, reply, self.timeout, device=device, return_header=True)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """End of a step: the last send is out and nothing is fetched ahead (a fetched input no action took would
        be a schedule bug: ``RuntimeError``)."""
        self.wait_send()
        if self._ahead is not None:
            key, self._ahead = self._ahead[0], None
            raise RuntimeError(f"boundary input {key} was fetched ahead but no action took it")

    def close(self) -> None:
        """Wait for the copies, close each copy thread's sockets (in it) and end it. Idempotent."""
        if self._pools is None:
            return
        try:
            self.wait_send()
        except Exception as e:  # noqa: BLE001  (closing after a failure: the error was reported)
            log.debug("boundary copy failed before close: %r", e)
        if self._ahead is not None:  # a fetch no action took (an error ended the step): let it finish
            fut, self._ahead = self._ahead[1], None
            try:
                fut.result()
            except Exception as e:  # noqa: BLE001
                log.debug("boundary fetch failed before close: %r", e)
        for which, pool in self._pools.items():
            pool.submit(self._close_outs, which).result()
            pool.shutdown(wait=True)
        self._pools = None

    def _close_outs(self, which: str) -> None:
        for o in self._outs[which].values():
            o.close()
        self._outs[which].clear()
