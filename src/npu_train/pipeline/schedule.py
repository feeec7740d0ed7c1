"""Pipeline schedules as pure lists of actions (no torch: the planner imports this module).

``F(m)`` receives from stage ``s-1`` and sends to ``s+1``; ``B(m)`` receives the output gradient and
sends the input gradient; ``W(m)`` (``zb*``) computes the weight gradients ``B(m)`` left out. Schedules:
``gpipe`` (Huang et al. 2019), ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021 §2.2), ``zb``, ``zb-h1``,
``zb-h2`` (Qi et al., ICLR 2024). Two chunks per card (:data:`CHUNKED_SCHEDULES`): ``zbv``, the V-shape
zero-bubble schedule (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory": card ``r`` holds chunks
``r`` and ``2P-1-r``), and ``interleaved`` 1F1B (Narayanan et al. 2021 §2.2: card ``r`` holds chunks ``r`` and
``P+r``); an action's ``chunk`` (0 or 1) names which. Start at :func:`build_schedule`; :func:`simulate` checks
deadlock freedom.

Vocabulary parallelism (``vocab=True``; Yeung et al. 2024, "Balancing Pipeline Parallelism with Vocabulary
Parallelism"): the output layer is sharded by vocabulary over the ``P`` cards, and every card's list gains one
joint action ``V(m)`` per micro-batch (:func:`vocab_positions`): all cards run it together (the last stage's
final hidden state to every card, each card's logits slice and softmax statistics combined, the partial input
gradients summed back), after the head stage's ``F(m)`` and before its ``B(m)``; the exchange runs in the
background where nothing waits for it (:func:`stage_timeline`'s ``lat``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Union

#: one chunk (a contiguous block of layers) per card
SCHEDULES = ("1f1b", "gpipe", "zb", "zb-h1", "zb-h2")
#: two chunks per card: virtual stages ``0..2P-1`` (:func:`virtual_stage`)
CHUNKED_SCHEDULES = ("zbv", "interleaved")
ALL_SCHEDULES = SCHEDULES + CHUNKED_SCHEDULES
#: schedules whose backward is split into B (input gradient) and W (weight gradient).
SPLIT_BACKWARD = ("zb", "zb-h1", "zb-h2", "zbv")

Durations = Union[float, Sequence[float]]


#: the joint vocabulary-parallel action of a micro-batch (every card of the pipeline at once)
VOCAB = "V"


class Action(NamedTuple):
    """``kind`` F (forward), B (backward; input gradient only if split), W (weight gradient) of ``micro`` on
    the card's chunk ``chunk`` (0, or 1 for :data:`CHUNKED_SCHEDULES`), or V (:data:`VOCAB`: the output layer's
    vocabulary slice of ``micro``, joint with every other card; ``chunk`` 0)."""

    kind: str
    micro: int
    chunk: int = 0

    def __repr__(self) -> str:  # compact for test failure messages
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


def chunks_per_card(kind: str) -> int:
    """Layer chunks one card holds: 2 for :data:`CHUNKED_SCHEDULES`, else 1."""
    return 2 if kind in CHUNKED_SCHEDULES else 1


def stages_needed(kind: str) -> int:
    """Pipeline stages (cards of one pipeline) schedule ``kind`` runs on at the least: 2 for
    :data:`CHUNKED_SCHEDULES` (chunk 0 hands its activations to chunk 1 over the link to another card, which one
    card has not), else 1. The one rule of the launcher's refusal, auto's candidates, a resume's kept schedule and
    the planner."""
    return 2 if kind in CHUNKED_SCHEDULES else 1


def virtual_stage(kind: str, num_stages: int, card: int, chunk: int) -> int:
    """The position in the whole pipeline (``0..cP-1``, ``c`` = :func:`chunks_per_card`) of ``card``'s
    ``chunk``: ``zbv`` the V (chunk 1 of card ``r`` is ``2P-1-r``), ``interleaved`` ``chunk * P + card``."""
    if kind == "zbv" and chunk == 1:
        return 2 * num_stages - 1 - card
    return chunk * num_stages + card


def card_of(kind: str, num_stages: int, v: int) -> tuple[int, int]:
    """``(card, chunk)`` holding virtual stage ``v`` (the inverse of :func:`virtual_stage`)."""
    P = num_stages
    if v < P:
        return v, 0
    return (2 * P - 1 - v if kind == "zbv" else v - P), 1


def _check(kind: str, num_stages: int, num_micro: int) -> None:
    if kind not in ALL_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: use one of {', '.join(ALL_SCHEDULES)}")
    if num_stages < 1 or num_micro < 1:
        raise ValueError(f"bad schedule arguments: P={num_stages}, M={num_micro}")
    if kind == "interleaved" and num_micro % num_stages:
        raise ValueError(f"schedule interleaved needs the micro-batches per step (M={num_micro}) to be a multiple "
                         f"of the pipeline stages (P={num_stages}): change train.accum or use zbv")


def build_schedule(kind: str, num_stages: int, num_micro: int, stage: int, vocab: bool = False) -> list[Action]:
    """The actions of ``stage`` for one step of ``num_micro`` (M) micro-batches on ``num_stages`` (P) stages;
    ``vocab``: with the joint ``V(m)`` actions of vocabulary parallelism (:func:`vocab_positions`). Raises
    ValueError for an unknown ``kind`` or out-of-range arguments."""
    _check(kind, num_stages, num_micro)
    if not 0 <= stage < num_stages:
        raise ValueError(f"bad schedule arguments: P={num_stages}, M={num_micro}, stage={stage}")
    if vocab:
        return list(_with_vocab(kind, num_stages, num_micro)[stage])
    return _base_schedule(kind, num_stages, num_micro, stage)


def _base_schedule(kind: str, num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """:func:`build_schedule` without vocabulary actions."""
    M = num_micro
    if kind in CHUNKED_SCHEDULES:
        return list(_chunked_orders(kind, num_stages, M)[stage])
    if kind == "gpipe":
        return [Action("F", m) for m in range(M)] + [Action("B", m) for m in range(M)]
    if kind == "zb-h2":
        return _zb_h2(num_stages, M, stage)
    split = kind in SPLIT_BACKWARD
    lag = stage if kind == "zb-h1" else 0  # W passes deferred past their B
    warmup = min(num_stages - stage - 1, M)
    actions = [Action("F", m) for m in range(warmup)]
    w = 0  # next W
    for b in range(M):
        f = warmup + b
        if f < M:
            actions.append(Action("F", f))
        actions.append(Action("B", b))
        if split and b - w >= lag:
            actions.append(Action("W", w))
            w += 1
    if split:
        actions.extend(Action("W", m) for m in range(w, M))
    return actions


def _zb_h2(P: int, M: int, s: int) -> list[Action]:
    """ZB-H2 (Qi et al. 2024, §3.1): ``min(2(P-s)-1, M)`` warm-up forwards, then ``B W F`` with ``W`` lagging
    ``2s`` micro-batches (``s`` when ``M < 2P-1``; checked with :func:`stage_timeline` for P <= 6, M <= 16)."""
    warmup = min(2 * (P - s) - 1, M)
    lag = 2 * s if M >= 2 * P - 1 else s
    actions = [Action("F", m) for m in range(warmup)]
    w, f = 0, warmup
    for b in range(M):
        actions.append(Action("B", b))
        if b + 1 - w > lag:
            actions.append(Action("W", w))
            w += 1
        if f < M:
            actions.append(Action("F", f))
            f += 1
    actions.extend(Action("W", m) for m in range(w, M))
    return actions


@lru_cache(maxsize=512)
def _chunked_orders(kind: str, P: int, M: int) -> tuple:
    """Every card's actions (tuples) of a two-chunk schedule."""
    if kind == "interleaved":
        return tuple(tuple(_interleaved(P, M, r)) for r in range(P))
    return _zbv(P, M)


def _interleaved(P: int, M: int, r: int, v: int = 2) -> list[Action]:
    """Interleaved 1F1B with ``v`` chunks a card (Narayanan et al. 2021 §2.2, Megatron-LM's order; ``M % P == 0``;
    the runtime uses ``v = 2``, ``experiments/bench/interleave_depth.py`` studies more): the ``k``-th forward of card
    ``r`` is micro-batch ``(k // vP) P + k % P`` on chunk ``(k % vP) // P``, backwards take the chunks in reverse;
    ``2(P-r-1) + (v-1)P`` warm-up forwards (at most ``vM``), then one forward and one backward."""
    total = v * M

    def order(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (v * P)) // P
        return (k // (v * P)) * P + k % P, chunk if forward else v - 1 - chunk

    warmup = min(2 * (P - r - 1) + (v - 1) * P, total)
    acts = [Action("F", *order(k, True)) for k in range(warmup)]
    for i in range(total - warmup):
        acts.append(Action("F", *order(warmup + i, True)))
        acts.append(Action("B", *order(i, False)))
    acts.extend(Action("B", *order(i, False)) for i in range(max(total - warmup, 0), total))
    return acts


def _zbv(P: int, M: int) -> tuple:
    """Every card's ZB-V order (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory" §6, as
    ``torch.distributed.pipelining.ScheduleZBVZeroBubble`` writes it): planned for ``N = max(M, 2P-1)``
    micro-batches, the ones ``>= M`` then dropped (every card drops the same ones, so the order stays valid)."""
    return tuple(tuple(a for a in _zbv_card(P, max(M, 2 * P - 1), r) if a.micro < M) for r in range(P))


def _zbv_card(P: int, N: int, r: int) -> list[Action]:
    """Card ``r``'s ZB-V actions for ``N >= 2P-1`` micro-batches (chunk 0: virtual stage ``r``, chunk 1:
    ``2P-1-r``). Warm-up: ``2(P-r)-1`` forwards of chunk 0, then ``r`` pairs (F chunk 1, F chunk 0), then
    ``P-r`` of (F, B, W) on chunk 1; steady: (F, B, W) on chunk 0 then on chunk 1; cool-down: ``r`` pairs of
    ``B``, ``P-r`` of (B, W) on chunk 0, then the ``W`` left (chunk 1, then chunk 0)."""
    cnt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0, ("W", 0): 0, ("W", 1): 0}
    acts: list[Action] = []

    def add(kind: str, chunk: int) -> None:
        acts.append(Action(kind, cnt[(kind, chunk)], chunk))
        cnt[(kind, chunk)] += 1

    for _ in range(2 * (P - r) - 1):
        add("F", 0)
    for _ in range(r):
        add("F", 1)
        add("F", 0)
    for _ in range(P - r):
        for k in "FBW":
            add(k, 1)
    while cnt[("F", 1)] < cnt[("F", 0)] or cnt[("F", 0)] < N:
        if cnt[("F", 0)] < N:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        for k in "FBW":
            add(k, 1)
    for _ in range(r):
        add("B", 0)
        add("B", 1)
    for _ in range(P - r):
        add("B", 0)
        add("W", 0)
    for chunk in (1, 0):
        while cnt[("W", chunk)] < cnt[("B", chunk)]:
            add("W", chunk)
    return acts


def head_position(kind: str, num_stages: int) -> tuple[int, int]:
    """``(card, chunk)`` of the last virtual stage (the final norm, and the head unless vocabulary-parallel)."""
    return card_of(kind, num_stages, num_stages * chunks_per_card(kind) - 1)


#: where the other cards' ``V(m)`` may go, in unit times after the head's ``F(m)`` ends (:func:`vocab_positions`;
#: the first of equally fast)
VOCAB_OFFSETS = (0.0, 1.0, -1.0)


def vocab_positions(kind: str, num_stages: int, num_micro: int) -> list[list[int]]:
    """Where each card's ``V(m)`` goes (per card, per micro-batch ``m``: how many of the card's other actions come
    before it). The head card: right after its last-stage ``F(m)``. Another card: after every action of its own
    that ends by then plus an offset (:data:`VOCAB_OFFSETS`) in the unit-time timeline without ``V`` actions (F = B
    = W = 1; an unsplit B 2), never after its own ``B(m)``, so the cards reach the joint action about together.
    Of the offsets, the one whose cards run free of deadlock with unbounded, 2-, 3- and min(M, P)+1-slot links
    (:func:`simulate`) and whose unit-time step (``V`` taking no time) is the shortest: the offset 0 orders the
    actions as the unit-time timeline does, so it always runs (``V(m)`` after everything it waits for, before
    everything that waits for it); 1 suits zb-h1 (P = 8, M = 32: 111 units against 128), -1 zb-h2 (109 / 110)."""
    P, M = num_stages, num_micro
    best = None
    for d in VOCAB_OFFSETS:
        pos = _offset_positions(kind, P, M, d)
        scheds = _insert_vocab(kind, P, M, pos)
        try:
            for slots in (None, 2, 3, min(M, P) + 1):
                _simulate(kind, P, M, scheds, slots, True)
            t = max(_run_program(_program(kind, P, M, scheds, True), P, _unit_durations(kind, P),
                                 _vocab_parts(0.0, P, (0.0, 0.0, 0.0), head_position(kind, P)[0]))[0])
        except RuntimeError:
            continue
        if best is None or t < best[0]:
            best = (t, pos)
    if best is None:
        raise RuntimeError(f"schedule {kind}: no deadlock-free place for the vocabulary actions, P={P}, M={M}")
    return best[1]


def _offset_positions(kind: str, P: int, M: int, delta: float) -> list[list[int]]:
    """:func:`vocab_positions` of one offset ``delta``."""
    ends = _unit_ends(kind, P, M)
    h, hc = head_position(kind, P)
    base_h = _base_schedule(kind, P, M, h)
    f_at = {a.micro: i for i, a in enumerate(base_h) if a.kind == "F" and a.chunk == hc}
    out = []
    for s in range(P):
        if s == h:
            out.append([f_at[m] + 1 for m in range(M)])
            continue
        base = _base_schedule(kind, P, M, s)
        first_b = {}
        for i, a in enumerate(base):
            if a.kind == "B":
                first_b.setdefault(a.micro, i)
        row, k = [], 0
        for m in range(M):
            t = ends[h][f_at[m]] + delta
            while k < len(ends[s]) and ends[s][k] <= t:
                k += 1
            row.append(max(row[-1] if row else 0, min(k, first_b.get(m, len(base)))))
        out.append(row)
    return out


def _unit_durations(kind: str, P: int) -> tuple:
    """``(F, B, W)`` durations per virtual stage at unit times (:func:`stage_timeline`'s ``dur``)."""
    V = P * chunks_per_card(kind)
    split = kind in SPLIT_BACKWARD
    return ([1.0] * V, [1.0 if split and v > 0 else 2.0 for v in range(V)], [1.0 if v > 0 else 0.0 for v in range(V)])


def _unit_ends(kind: str, P: int, M: int) -> list[list[float]]:
    """Per card, the end of each of its actions (schedule order, no ``V``) in the unit-time timeline."""
    dur = _unit_durations(kind, P)
    end, free = [], [0.0] * P
    ends: list[list[float]] = [[] for _ in range(P)]
    for s, v, k, deps in _timeline_program(kind, P, M):
        start = max([free[s]] + [end[j] for j in deps])
        free[s] = start + dur[k][v]
        end.append(free[s])
        ends[s].append(free[s])
    return ends


@lru_cache(maxsize=256)
def _with_vocab(kind: str, P: int, M: int) -> tuple:
    """Every card's actions with ``V(m)`` inserted at :func:`vocab_positions` (tuples)."""
    return _insert_vocab(kind, P, M, vocab_positions(kind, P, M))


def _insert_vocab(kind: str, P: int, M: int, pos: list) -> tuple:
    """Every card's actions with ``V(m)`` inserted at ``pos`` (:func:`vocab_positions`' form; tuples)."""
    out = []
    for s in range(P):
        base = _base_schedule(kind, P, M, s)
        acts: list[Action] = []
        k = 0
        for m in range(M):
            acts.extend(base[k:pos[s][m]])
            k = max(k, pos[s][m])
            acts.append(Action(VOCAB, m))
        acts.extend(base[k:])
        out.append(tuple(acts))
    return tuple(out)


def in_flight_profile(actions: Sequence[Action]) -> list[int]:
    """Micro-batches held (from ``F`` to their last backward action) after each action; with two chunks per
    card, chunk micro-batches (each holds one chunk's activations)."""
    last = {}
    for i, a in enumerate(actions):
        if a.kind in "BW":
            last[(a.micro, a.chunk)] = i
    live, out = 0, []
    for i, a in enumerate(actions):
        if a.kind == "F":
            live += 1
        elif last.get((a.micro, a.chunk)) == i:
            live -= 1
        out.append(live)
    return out


def held_profile(kind: str, stage: int, num_stages: int, num_micro: int, held: Sequence[float],
                 pending: Sequence[float] = (0.0, 0.0)) -> list[tuple[Action, float, float]]:
    """``(action, before, after)`` for each of ``stage``'s actions: the bytes ``sum_c held[c] * live_c +
    pending[c] * waiting_c`` just before and just after it; ``live_c`` the micro-batches chunk ``c`` holds (``F`` to
    its last backward action), ``waiting_c`` those between ``B`` and ``W`` (a split backward past the first
    virtual stage); ``held`` / ``pending`` bytes per micro-batch of each chunk (one entry per chunk the card
    holds)."""
    acts = build_schedule(kind, num_stages, num_micro, stage)
    last = {}
    for i, a in enumerate(acts):
        if a.kind in "BW":
            last[(a.micro, a.chunk)] = i
    split = kind in SPLIT_BACKWARD
    total, out = 0.0, []
    for i, a in enumerate(acts):
        c, before = a.chunk, total
        if a.kind == "F":
            total += held[c]
        elif last.get((a.micro, c)) == i:
            total -= held[c]
        if split and virtual_stage(kind, num_stages, stage, c) > 0:
            total += pending[c] if a.kind == "B" else -pending[c] if a.kind == "W" else 0.0
        out.append((a, before, total))
    return out


def peak_held_bytes(kind: str, stage: int, num_stages: int, num_micro: int, held: Sequence[float],
                    pending: Sequence[float] = (0.0, 0.0)) -> float:
    """Peak over ``stage``'s actions of the bytes :func:`held_profile` counts after each."""
    return max([0.0] + [after for _a, _before, after in held_profile(kind, stage, num_stages, num_micro, held,
                                                                      pending)])


def peak_in_flight(kind: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Most micro-batches held at once: ``min(M, P-stage)`` (1f1b, zb), ``min(M, P)`` (zb-h1), ``2P-1``
    (zb-h2), M (gpipe). Raises ValueError as :func:`build_schedule`."""
    return max(in_flight_profile(build_schedule(kind, num_stages, num_micro, stage)))


def peak_pending_weight_grads(kind: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Most micro-batches between ``B`` and ``W`` on ``stage`` (each keeps its weight ops' output gradients):
    zb 1, zb-h1 ``min(M, stage+1)``, zb-h2 ``2 stage + 1``; 0 unsplit and on the first (virtual) stage, whose
    ``B`` is the whole backward."""
    acts = build_schedule(kind, num_stages, num_micro, stage)
    if kind not in SPLIT_BACKWARD:
        return 0
    pending = peak = 0
    for a in acts:
        if virtual_stage(kind, num_stages, stage, a.chunk) == 0:
            continue
        pending += 1 if a.kind == "B" else -1 if a.kind == "W" else 0
        peak = max(peak, pending)
    return peak


def simulate(kind: str, num_stages: int, num_micro: int, slots: Optional[int] = None, vocab: bool = False) -> int:
    """Run all cards' schedules against each other in unit ticks; returns the ticks. ``slots``: tensors in
    flight per link and direction between two cards (None: unbounded; a hand-over between two chunks of one
    card is in-process and unbounded). ``vocab``: with the joint ``V(m)`` actions (:func:`build_schedule`), each
    run in one tick by every card once all have reached it and the last stage's ``F(m)`` is done, the last stage's
    ``B(m)`` after it. Raises RuntimeError on deadlock."""
    P = num_stages
    return _simulate(kind, P, num_micro, [build_schedule(kind, P, num_micro, s, vocab) for s in range(P)], slots, vocab)


def _simulate(kind: str, P: int, num_micro: int, scheds, slots: Optional[int], vocab: bool) -> int:
    """:func:`simulate` of the cards' action lists ``scheds``."""
    V = P * chunks_per_card(kind)
    pos = [0] * P
    done = {k: [set() for _ in range(V)] for k in "FBW"}
    done[VOCAB] = set() if vocab else None
    # per boundary b (virtual stages b and b+1): tensors sent, not yet received; None: same card
    local = [card_of(kind, P, b)[0] == card_of(kind, P, b + 1)[0] for b in range(V - 1)]
    links = _Links([0] * V, [0] * V, local, float("inf") if slots is None else int(slots))
    if links.cap < 1:
        raise ValueError(f"slots must be >= 1 or None, got {slots}")
    ticks = 0
    while any(pos[s] < len(scheds[s]) for s in range(P)):
        ready = []
        for s in range(P):
            if pos[s] < len(scheds[s]):
                a = scheds[s][pos[s]]
                v = virtual_stage(kind, P, s, a.chunk)
                if a.kind != VOCAB and _can_start(a, v, V, done, links):
                    ready.append((s, v, a))
        nxt = [scheds[s][pos[s]] if pos[s] < len(scheds[s]) else None for s in range(P)]
        joint = _joint_ready(nxt, done["F"][V - 1])
        if not ready and not joint:
            raise RuntimeError(f"schedule {kind} deadlocks for P={P}, M={num_micro}, slots={slots}"
                               f"{', vocab' if vocab else ''} at {pos}")
        for s, v, a in ready:
            done[a.kind][v].add(a.micro)
            pos[s] += 1
            _move_tensors(a, v, V, links)
        if joint:
            done[VOCAB].add(nxt[0].micro)
            pos = [p + 1 for p in pos]
        ticks += 1
    return ticks


def _joint_ready(nxt: list, head_done: set) -> bool:
    """Whether a joint ``V(m)`` can run: every card's next action is it (``nxt``), and the last stage's ``F(m)`` is
    done (in ``head_done``: its final hidden state exists)."""
    a = nxt[0]
    return a is not None and a.kind == VOCAB and all(b == a for b in nxt) and a.micro in head_done


class _Links(NamedTuple):
    """:func:`simulate`'s boundaries: ``act[b]`` / ``grad[b]`` tensors in flight over boundary ``b`` (virtual
    stages ``b`` -> ``b+1`` / ``b+1`` -> ``b``), ``local[b]`` when both ends are one card, ``cap`` slots."""

    act: list
    grad: list
    local: list
    cap: float

    def free(self, counts: list, b: int) -> bool:
        return self.local[b] or counts[b] < self.cap


def _can_start(a: Action, v: int, V: int, done: dict, links: _Links) -> bool:
    """Whether virtual stage ``v`` can run ``a`` now (input arrived, outgoing slot free)."""
    if a.kind == "F":
        return (v == 0 or a.micro in done["F"][v - 1]) and (v == V - 1 or links.free(links.act, v))
    if a.kind == "B":
        # the last stage's output gradient: from V(m) with vocabulary actions (done[VOCAB] a set), else its loss
        after = a.micro in done["B"][v + 1] if v < V - 1 else done[VOCAB] is None or a.micro in done[VOCAB]
        return a.micro in done["F"][v] and after and (v == 0 or links.free(links.grad, v - 1))
    return a.micro in done["B"][v]


def _move_tensors(a: Action, v: int, V: int, links: _Links) -> None:
    """The link counts after virtual stage ``v`` ran ``a``: its input received, its output sent."""
    if a.kind == "F":
        if v > 0:
            links.act[v - 1] -= 1
        if v < V - 1:
            links.act[v] += 1
    elif a.kind == "B":
        if v < V - 1:
            links.grad[v] -= 1
        if v > 0:
            links.grad[v - 1] += 1


def _per_stage(v: Durations, n: int, name: str) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * n
    out = [float(x) for x in v]
    if len(out) != n:
        raise ValueError(f"{name}: need one value per stage ({n}), got {len(out)}")
    return out


def stage_timeline(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
                   t_w: Durations = 1.0, t_v=None, lat: Sequence[float] = (0.0, 0.0, 0.0)
                   ) -> tuple[list[float], list[float]]:
    """Earliest-start execution; returns per card ``(end, busy)``. ``t_f, t_b, t_w``: time per micro-batch
    (one value, or one per stage: per virtual stage, ``2P`` of them, for :data:`CHUNKED_SCHEDULES`); unsplit
    ``B`` takes ``t_b + t_w``, as does the first (virtual) stage's in a split schedule. ``t_v`` (None: no
    vocabulary actions): each card's share of a joint ``V(m)``, one value or one per card (all of it before the
    cards meet), or per card ``(s, g, w)``: its logits slice, its partial input gradient, its weight gradient
    (pipeline/vocab.py's order). ``lat``: the exchange's seconds, in the background (pipeline/vocab.py's
    ``VocabWork``): the hidden state from the head card (sent as its ``F(m)`` ends), the softmax statistics, the
    partial input gradients' sum onto the head. A card starts its ``s`` once it reached ``V(m)`` and the hidden
    state arrived; the cards meet when the last has done its ``s`` (plus the statistics' time), then each does ``g``
    and ``w`` and goes on; the head's ``B(m)`` waits for the last ``g`` plus the sum's time. Raises RuntimeError
    on deadlock.

    The order the actions are placed in and what each waits for do not depend on the durations
    (:func:`_timeline_program`, cached per schedule), so a call is one pass over the ``~3PM`` actions: the
    planner's split search evaluates thousands of timelines."""
    P = num_stages
    V = P * chunks_per_card(kind)
    tf, tb, tw = (_per_stage(x, V, n) for x, n in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    tv = None if t_v is None else _vocab_parts(t_v, P, tuple(lat), head_position(kind, P)[0])
    split = kind in SPLIT_BACKWARD
    # per action kind (F, B, W) and virtual stage: its duration
    dur = (tf, [tb[v] if split and v > 0 else tb[v] + tw[v] for v in range(V)],
           [tw[v] if v > 0 else 0.0 for v in range(V)])
    return _run_program(_timeline_program(kind, P, num_micro, tv is not None), P, dur, tv)


def copy_timeline(kind: str, num_stages: int, num_micro: int, t_f: Durations, t_b: Durations, t_w: Durations,
                  copies: Sequence[tuple], t_v=None, lat: Sequence[float] = (0.0, 0.0, 0.0)
                  ) -> tuple[list[float], list[float], list[float]]:
    """:func:`stage_timeline` with the stage-boundary copies in a copy thread per card (``runtime/copies.py``);
    returns per card ``(end, busy, exposed)``, ``exposed`` the copy seconds its own thread waited for.

    ``copies``: per virtual stage ``(F in, F out, B in, B out)`` seconds (its ``F`` receives the activation and sends
    its own, its ``B`` the gradients), outside ``t_f, t_b``. What the runtime does: a send is handed to the card's
    send thread as the action's compute ends, once the card's previous send is out, and reaches the other card
    when its copy ends. Before an action computes, the card looks for the next action's input: if it had arrived
    by then, the fetch thread copies it onto the card meanwhile (one at a time, so that thread is always free
    then; the next action starts when the copy ends), else the card copies it itself when it gets there
    (``exposed``). After a joint ``V(m)`` the card does not look ahead. A card ends when its compute and its last
    send are done. Raises RuntimeError on deadlock."""
    P = num_stages
    V = P * chunks_per_card(kind)
    tf, tb, tw = (_per_stage(x, V, n) for x, n in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    if len(copies) != V:
        raise ValueError(f"copies: need one (F in, F out, B in, B out) per virtual stage ({V}), got {len(copies)}")
    tv = None if t_v is None else _vocab_parts(t_v, P, tuple(lat), head_position(kind, P)[0])
    split = kind in SPLIT_BACKWARD
    dur = (tf, [tb[v] if split and v > 0 else tb[v] + tw[v] for v in range(V)],
           [tw[v] if v > 0 else 0.0 for v in range(V)])
    return _run_copies(_timeline_program(kind, P, num_micro, tv is not None), P, dur, tv, copies)


class _Card:
    """One card's clocks in :func:`_run_copies`: ``free`` (its thread), ``sent`` (its last send out), ``look`` (when
    it last looked ahead; None: not since a ``V(m)``), ``busy``, ``exposed``."""

    __slots__ = ("free", "sent", "look", "busy", "exposed")

    def __init__(self):
        self.free = self.sent = self.busy = self.exposed = 0.0
        self.look: Optional[float] = None


def _run_copies(prog: tuple, P: int, dur: tuple, tv: Optional[tuple], copies: Sequence[tuple]):
    """:func:`copy_timeline` over :func:`_timeline_program`'s ``prog``."""
    cards = [_Card() for _ in range(P)]
    end: list = []  # when each entry's compute ended
    out: list = []  # when its output reached another card (its send's copy done)
    for s, v, k, deps in prog:
        if s < 0:  # a joint V(m), as in _run_program; no look-ahead after it
            ts, tg, tw, (lx, lst, ldx), h = tv
            sent = end[deps[0]]
            met = max(max(cards[p].free, sent + (0.0 if p == h else lx)) + ts[p] for p in range(P)) + lst
            for p, c in enumerate(cards):
                c.free, c.look = met + tg[p] + tw[p], None
                c.busy += ts[p] + tg[p] + tw[p]
            end.append(max(met + g for g in tg) + ldx)
            out.append(end[-1])
            continue
        c = cards[s]
        start, arrive = c.free, None
        for j in deps:
            if 0 <= prog[j][0] != s:
                arrive = out[j]
            elif end[j] > start:
                start = end[j]
        cin, cout = (copies[v][2 * k], copies[v][2 * k + 1]) if k < 2 else (0.0, 0.0)
        if arrive is not None:
            if c.look is not None and arrive <= c.look:  # there when the card looked: fetched ahead
                start = max(start, c.look + cin)
            else:  # copied by the card itself when it got there
                start = max(start, arrive) + cin
                c.exposed += cin
        c.look = start
        d = dur[k][v]
        c.busy += d
        t = start + d
        end.append(t)
        if cout > 0.0:
            t = max(t, c.sent)  # the previous send is out first
            c.sent = t + cout
            out.append(c.sent)
        else:
            out.append(t)
        c.free = t
    return [max(c.free, c.sent) for c in cards], [c.busy for c in cards], [c.exposed for c in cards]


def _vocab_parts(t_v, P: int, lat: tuple, head: int) -> tuple:
    """``(s, g, w per card, (hidden state, statistics, sum) seconds, head card)`` of :func:`stage_timeline`'s
    ``t_v`` and ``lat``."""
    if isinstance(t_v, (int, float)):
        parts = [(float(t_v), 0.0, 0.0)] * P
    else:
        parts = [(float(x), 0.0, 0.0) if isinstance(x, (int, float)) else tuple(float(y) for y in x) for x in t_v]
    if len(parts) != P:
        raise ValueError(f"t_v: need one value per card ({P}), got {len(parts)}")
    if len(lat) != 3:
        raise ValueError(f"lat: need (hidden state, statistics, sum) seconds, got {lat}")
    return tuple(zip(*parts)) + (lat, head)


def _run_program(prog: tuple, P: int, dur: tuple, tv: Optional[tuple]) -> tuple[list[float], list[float]]:
    """Per card ``(end, busy)`` of :func:`_timeline_program`'s ``prog`` with ``dur[kind index][virtual stage]`` and
    the joint ``V(m)``'s parts ``tv`` (:func:`_vocab_parts`)."""
    end = []
    free, busy = [0.0] * P, [0.0] * P
    for s, v, k, deps in prog:
        if s < 0:  # a joint V(m): each card's logits slice once the hidden state is there, then they meet
            ts, tg, tw, (lx, lst, ldx), h = tv
            sent = end[deps[0]]  # the head's F(m)
            met = max(max(free[p], sent + (0.0 if p == h else lx)) + ts[p] for p in range(P)) + lst
            free = [met + tg[p] + tw[p] for p in range(P)]
            busy = [b + ts[p] + tg[p] + tw[p] for p, b in enumerate(busy)]
            end.append(max(met + g for g in tg) + ldx)  # the summed input gradient at the head
            continue
        start = free[s]
        for j in deps:
            if end[j] > start:
                start = end[j]
        d = dur[k][v]
        free[s] = start + d
        end.append(free[s])
        busy[s] += d
    return free, busy


@lru_cache(maxsize=256)
def _timeline_program(kind: str, P: int, M: int, vocab: bool = False) -> tuple:
    """:func:`stage_timeline`'s actions in the order it places them, each ``(card, virtual stage, kind index
    (0 F, 1 B, 2 W), indices of the earlier entries it waits for)``: each card takes its next action as soon as
    the actions that action depends on are placed, cards visited in turn; a joint ``V(m)`` (``vocab``) is one
    entry ``(-1, -1, 3, (index of the last stage's F(m),))`` placed once every card has reached it. Raises
    RuntimeError on deadlock."""
    return _program(kind, P, M, [build_schedule(kind, P, M, s, vocab) for s in range(P)], vocab)


def _program(kind: str, P: int, M: int, scheds, vocab: bool) -> tuple:
    """:func:`_timeline_program` of the cards' action lists ``scheds``."""
    V = P * chunks_per_card(kind)
    index: dict[tuple[str, int, int], int] = {}
    prog = []
    pos = [0] * P
    progressed = True
    while progressed:
        progressed = False
        for s in range(P):
            while pos[s] < len(scheds[s]):
                a = scheds[s][pos[s]]
                if a.kind == VOCAB:
                    break
                v = virtual_stage(kind, P, s, a.chunk)
                deps = _deps(a, v, V, vocab)
                if any(d not in index for d in deps):
                    break
                index[(a.kind, v, a.micro)] = len(prog)
                prog.append((s, v, "FBW".index(a.kind), tuple(index[d] for d in deps)))
                pos[s] += 1
                progressed = True
        nxt = {scheds[s][pos[s]] if pos[s] < len(scheds[s]) else None for s in range(P)}
        if (len(nxt) == 1 and None not in nxt and next(iter(nxt)).kind == VOCAB
                and ("F", V - 1, next(iter(nxt)).micro) in index):
            index[(VOCAB, -1, next(iter(nxt)).micro)] = len(prog)
            prog.append((-1, -1, 3, (index[("F", V - 1, next(iter(nxt)).micro)],)))
            pos = [p + 1 for p in pos]
            progressed = True
    if any(pos[s] < len(scheds[s]) for s in range(P)):
        raise RuntimeError(f"schedule {kind} deadlocks for P={P}, M={M}{', vocab' if vocab else ''}")
    return tuple(prog)


def _deps(a: Action, v: int, V: int, vocab: bool = False) -> list:
    """The actions ``a`` on virtual stage ``v`` waits for, as ``(kind, v, micro)`` (``vocab``: the last stage's
    ``B(m)`` waits for ``V(m)``)."""
    if a.kind == "F":
        return [("F", v - 1, a.micro)] if v > 0 else []
    if a.kind == "B":
        nxt = [("B", v + 1, a.micro)] if v < V - 1 else [(VOCAB, -1, a.micro)] if vocab else []
        return [("F", v, a.micro)] + nxt
    return [("B", v, a.micro)]


def step_time(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
              t_w: Durations = 1.0, t_v=None, lat: Sequence[float] = (0.0, 0.0, 0.0)) -> float:
    """One step's forward/backward time (unit of ``t_*``), from :func:`stage_timeline`."""
    return max(stage_timeline(kind, num_stages, num_micro, t_f, t_b, t_w, t_v, lat)[0])


def bubble_fraction(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
                    t_w: Durations = 1.0, t_v=None, lat: Sequence[float] = (0.0, 0.0, 0.0)) -> float:
    """Idle share ``1 - sum(busy) / (P * step_time)``. Unit times: ``(P-1)/(M+P-1)`` (1f1b, gpipe),
    ``2(P-1)/(3M+2(P-1))`` (zb), ``(P-1)/(3M+P-1)`` (zb-h1 for M >= P, zb-h2 for M >= 2P-1)."""
    end, busy = stage_timeline(kind, num_stages, num_micro, t_f, t_b, t_w, t_v, lat)
    T = max(end)
    return 1.0 - sum(busy) / (num_stages * T) if T > 0 else 0.0
