"""Vocabulary parallelism's exchange through shared memory (``runtime.vocab_exchange=shm``): an
:class:`~npu_train.pipeline.vocab.Exchange` for a pipeline whose cards all sit on one host.

The two ``[b, S, H]`` tensors of ``V(m)`` go through ``/dev/shm`` instead of gloo over TCP loopback:

- the head card's final hidden state is **written once** into a slot of its segment and **read by every card**
  from there (:class:`~npu_train.pipeline.vocab.VocabWork` computes on the slot itself, no copy), where gloo's
  broadcast sends it to each card over a socket;
- each card writes its partial input gradient ``dz_p W_p`` into a slot of its own segment; the head card reads the
  ``P`` partials and sums them in card order (``0..P-1``) in the compute dtype, as gloo's reduce sums in it (in an
  order of its own: fp32 at P = 2 gives the same bits, ``a + b = b + a``).

Only the notifications stay in gloo (one int64 per tensor: a broadcast of the hidden state's sequence number, a
reduce that completes once every card wrote its partial), and the softmax statistics (``12 P`` bytes per token,
one all-reduce; ``experiments/bench/vocab_exchange.py`` prints its share). Every card calls the collectives in the
same order, so each tensor has a sequence number ``c`` (hidden states and partial gradients counted apart) and
slot ``c mod slots``; each slot carries the number it holds (``-1`` while it is written), checked before and after
a read, so a stale or overwritten slot raises instead of being read.

Why a slot is free when it is written again (no wait, no credit): ``V(m)``'s statistics all-reduce is a fence
every card passes only after every card reached it. A card is done reading hidden state ``c`` when its ``V(c)``
ends (its weight gradient reads it last), before it enters ``V(c + 1)``; the head writes hidden state ``c + 2``
after its ``V(c + 1)`` (right after its own ``F(c + 2)``), whose all-reduce every card has entered: two slots. A card
writes its partial ``c`` after ``V(c)``'s all-reduce, which the head joins only at its ``V(c)``; the head read
partial ``c - K`` at its ``B(c - K)``: safe when at most ``K - 1`` of the head card's ``V`` actions lie between its
``V(j)`` and its ``B(j)`` (:func:`reduce_slots`, from the schedule). The head also publishes how many sums it has
read; a card about to overwrite an unread partial raises (a schedule this argument does not cover).

Segments: ``/dev/shm/npt_<job_id>_<name>-c<i>`` (the pipeline's card ``i``), created by their card, unlinked by it at
:meth:`ShmExchange.close`, and with every other segment of the job by the launcher's teardown, an orphaned card
process or the next launch's sweep (``runtime/leftovers.py``): nothing is left after a crash.
"""
from __future__ import annotations

from typing import Optional

import torch

from npu_train.pipeline.vocab import GlooExchange
from npu_train.transport.shm import SLOT_ALIGN, ShmSegment, segment_name

__all__ = ["ShmExchange", "exchange_bytes", "reduce_slots", "X_SLOTS"]

#: hidden-state slots in the head card's segment (module docstring: two are always free in time)
X_SLOTS = 2
#: rows (tokens) summed at a time on the head: its accumulator, ``ROWS x H`` elements, stays in cache
ROWS = 64
_CTRL = 8  # int64 entries per control line (64 bytes)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def reduce_slots(kind: str, num_stages: int, num_micro: int, head: int) -> int:
    """Partial-gradient slots a card needs (module docstring): ``1 +`` the most ``V`` actions of the head card
    (stage ``head``) strictly between its ``V(m)`` and its last chunk's ``B(m)``, over ``m`` (1F1B: 1; GPipe:
    ``M``)."""
    from npu_train.pipeline.schedule import build_schedule, chunks_per_card

    acts = build_schedule(kind, num_stages, num_micro, head, vocab=True)
    last = chunks_per_card(kind) - 1
    pos_v = {a.micro: i for i, a in enumerate(acts) if a.kind == "V"}
    pos_b = {a.micro: i for i, a in enumerate(acts) if a.kind == "B" and a.chunk == last}
    k = 1
    for m in range(num_micro):
        k = max(k, 1 + sum(1 for j in range(num_micro) if pos_v[m] < pos_v[j] < pos_b[m]))
    return k


def exchange_bytes(kind: str, num_stages: int, num_micro: int, slot_bytes: int) -> int:
    """Bytes of /dev/shm one pipeline's exchange takes: the head card's :data:`X_SLOTS` hidden-state slots and every
    other card's :func:`reduce_slots` partial-gradient slots of ``slot_bytes``, with their control lines."""
    from npu_train.pipeline.schedule import card_of, chunks_per_card

    P = int(num_stages)
    head = card_of(kind, P, P * chunks_per_card(kind) - 1)[0]
    k = reduce_slots(kind, P, num_micro, head)
    return _Segment.nbytes(X_SLOTS, slot_bytes) + (P - 1) * _Segment.nbytes(k, slot_bytes)


class _Segment:
    """A card's segment: ``n`` control lines (slot ``i``'s sequence number at ``ctrl[8 i]``; line ``n``: the
    head's count of sums read) then ``n`` slots of ``slot_bytes``."""

    def __init__(self, seg: ShmSegment, n: int, slot_bytes: int):
        self.seg, self.n, self.slot_bytes = seg, int(n), int(slot_bytes)
        self.stride = _round_up(self.slot_bytes, SLOT_ALIGN)
        self.data = _CTRL * 8 * (self.n + 1)
        raw = torch.frombuffer(seg.buf, dtype=torch.uint8, count=self.data + self.stride * self.n)
        self.ctrl = raw[: self.data].view(torch.int64)
        self.raw = raw

    @staticmethod
    def nbytes(n: int, slot_bytes: int) -> int:
        return _CTRL * 8 * (n + 1) + _round_up(int(slot_bytes), SLOT_ALIGN) * n

    def stamp(self, slot: int) -> int:
        return int(self.ctrl[_CTRL * slot])

    def set_stamp(self, slot: int, c: int) -> None:
        self.ctrl[_CTRL * slot] = c

    @property
    def consumed(self) -> int:
        return int(self.ctrl[_CTRL * self.n])

    @consumed.setter
    def consumed(self, c: int) -> None:
        self.ctrl[_CTRL * self.n] = c

    def view(self, slot: int, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"vocabulary exchange: a tensor of {nbytes} bytes does not fit a slot of "
                             f"{self.slot_bytes} bytes ({self.seg.name}); the slots are sized for micro_batch x "
                             f"seq_len x hidden x element size")
        off = self.data + slot * self.stride
        return self.raw[off: off + nbytes].view(like.dtype).view(like.shape)

    def close(self) -> None:
        self.raw = self.ctrl = None
        self.seg.close()


class _Done:
    def __init__(self, h):
        self.h = h

    def wait(self):
        self.h.wait()


class _XRecv:
    """A card's receive of hidden state ``c``: :meth:`wait` waits for the head's notification and copies the slot
    into ``t`` (the :class:`~npu_train.pipeline.vocab.Exchange` protocol); :meth:`view` waits and returns the slot
    itself, no copy (:class:`~npu_train.pipeline.vocab.VocabWork`: the slot stays unwritten until every card has
    entered its next ``V``, module docstring)."""

    def __init__(self, ex: "ShmExchange", h, note: torch.Tensor, t: torch.Tensor, c: int):
        self.ex, self.h, self.note, self.t, self.c = ex, h, note, t, c
        self.arrived = self.copied = False

    def _arrive(self) -> torch.Tensor:
        ex, c = self.ex, self.c
        seg, slot = ex._head_seg, c % X_SLOTS
        if not self.arrived:
            self.h.wait()
            if int(self.note) != c:
                raise RuntimeError(f"vocabulary exchange: hidden state {int(self.note)} announced where {c} was "
                                   "expected (the cards called the exchange in different orders)")
            ex._check(seg, slot, c, "hidden state")
            self.arrived = True
        return seg.view(slot, self.t)

    def view(self) -> torch.Tensor:
        return self._arrive()

    def wait(self):
        src = self._arrive()
        if not self.copied:
            self.t.copy_(src)
            self.ex._check(self.ex._head_seg, self.c % X_SLOTS, self.c, "hidden state (overwritten while read)")
            self.copied = True


class _Sum:
    """The head's sum of partial gradient ``c``: ``wait()`` waits until every card wrote it, then sums in card
    order into ``t`` (the head's own partial, replaced by the sum, as gloo's reduce does)."""

    def __init__(self, ex: "ShmExchange", h, t: torch.Tensor, c: int):
        self.ex, self.h, self.t, self.c, self.done = ex, h, t, c, False

    def wait(self):
        if self.done:
            return
        self.h.wait()
        ex, c, t = self.ex, self.c, self.t
        slot = c % ex.slots
        srcs = []
        for p in range(ex.size):
            if p == ex.index:
                srcs.append(t)
            else:
                ex._check(ex._segs[p], slot, c, f"partial input gradient of card {p}")
                srcs.append(ex._segs[p].view(slot, t))
        flat = [s.reshape(-1, s.shape[-1]) for s in srcs]
        out = t.reshape(-1, t.shape[-1])
        for r0 in range(0, out.shape[0], ROWS):  # a few rows at a time: the accumulator stays in cache
            r1 = min(out.shape[0], r0 + ROWS)
            acc = flat[0][r0:r1].clone()  # a copy: the head's own rows are overwritten by the sum
            for f in flat[1:]:
                acc += f[r0:r1]
            out[r0:r1].copy_(acc)
        for p in range(ex.size):
            if p != ex.index:
                ex._check(ex._segs[p], slot, c, f"partial input gradient of card {p} (overwritten while read)")
        ex._seg.consumed = c + 1
        self.done = True


class ShmExchange(GlooExchange):
    """:class:`~npu_train.pipeline.vocab.Exchange` of one pipeline's cards on one host (module docstring); the
    statistics all-reduces (and ``broadcast`` / ``reduce_sum``, through the async halves below) are
    :class:`~npu_train.pipeline.vocab.GlooExchange`'s.

    ``group`` / ``xgroup``: the pipeline's gloo groups (statistics and partial-gradient notifications /
    hidden-state notifications), ``head``: the head stage's global rank; ``job_id`` and ``name`` (e.g. ``vx0``: the
    replica) name the segments; ``slot_bytes``: the largest ``[b, S, H]`` tensor (micro_batch x seq_len x hidden x
    element size); ``slots``: partial-gradient slots per card (:func:`reduce_slots`). Every card of the group
    constructs it at the same point (it creates its segment, meets the others at a barrier, attaches theirs).
    Raises :class:`~npu_train.transport.shm.ShmTooSmallError` when /dev/shm has no room."""

    def __init__(self, group, head: int, xgroup, job_id: str, name: str, slot_bytes: int, slots: int):
        import torch.distributed as dist

        self.group, self.xgroup, self.head = group, xgroup, int(head)
        self.size, self.index = dist.get_world_size(group), dist.get_rank(group)
        self.head_index = dist.get_group_rank(group, self.head)
        self.is_head = self.index == self.head_index
        self.slots = int(slots)
        self.nb = self.nr = 0  # hidden states / partial gradients posted so far
        n = X_SLOTS if self.is_head else self.slots
        names = [segment_name(job_id, f"{name}-c{p}") for p in range(self.size)]
        nslots = [X_SLOTS if p == self.head_index else self.slots for p in range(self.size)]
        own = ShmSegment.create(names[self.index], _Segment.nbytes(n, slot_bytes))
        self._seg = _Segment(own, n, slot_bytes)
        for i in range(n):
            self._seg.set_stamp(i, -1)
        self._seg.consumed = 0
        self._segs: dict = {self.index: self._seg}
        try:
            dist.barrier(group=group)  # every segment exists
            wanted = range(self.size) if self.is_head else [self.head_index]
            for p in wanted:
                if p != self.index:
                    self._segs[p] = _Segment(ShmSegment.attach(names[p]), nslots[p], slot_bytes)
        except BaseException:
            self.close()
            raise
        self._head_seg = self._segs[self.head_index]

    def _check(self, seg: _Segment, slot: int, c: int, what: str) -> None:
        got = seg.stamp(slot)
        if got != c:
            raise RuntimeError(f"vocabulary exchange: {what} {c} expected in {seg.seg.name} slot {slot}, found "
                               f"{got} (a stale or overwritten slot); runtime.vocab_exchange=gloo avoids the shared "
                               "memory path")

    # -- the hidden state -----------------------------------------------------------------------------------
    def broadcast_async(self, t: torch.Tensor):
        import torch.distributed as dist

        c = self.nb
        self.nb += 1
        if self.is_head:
            slot = c % X_SLOTS
            seg = self._seg
            seg.set_stamp(slot, -1)
            seg.view(slot, t).copy_(t)
            seg.set_stamp(slot, c)
            note = torch.tensor([c], dtype=torch.int64)
            return _Done(dist.broadcast(note, src=self.head, group=self.xgroup, async_op=True))
        note = torch.empty(1, dtype=torch.int64)
        h = dist.broadcast(note, src=self.head, group=self.xgroup, async_op=True)
        return _XRecv(self, h, note, t, c)

    # -- the partial input gradients -------------------------------------------------------------------------
    def reduce_sum_async(self, t: torch.Tensor):
        import torch.distributed as dist

        c = self.nr
        self.nr += 1
        note = torch.zeros(1, dtype=torch.int64)
        if self.is_head:
            return _Sum(self, dist.reduce(note, dst=self.head, group=self.group, async_op=True), t, c)
        slot = c % self.slots
        read = self._head_seg.consumed
        if c >= self.slots and read <= c - self.slots:
            raise RuntimeError(f"vocabulary exchange: card {self.index} would overwrite partial input gradient "
                               f"{c - self.slots} before the head card read it (it read {read}; {self.slots} slots); "
                               "runtime.vocab_exchange=gloo avoids the shared memory path")
        seg = self._seg
        seg.set_stamp(slot, -1)
        seg.view(slot, t).copy_(t)
        seg.set_stamp(slot, c)
        note += 1
        return _Done(dist.reduce(note, dst=self.head, group=self.group, async_op=True))

    def close(self) -> None:
        """Unmap every segment, unlink this card's own. Idempotent."""
        segs, self._segs = getattr(self, "_segs", {}), {}
        own = getattr(self, "_seg", None)
        for s in segs.values():
            s.close()
        if own is not None:
            own.close()
            own.seg.unlink()
            self._seg = None
