"""Pipeline schedules as pure lists of actions (no torch: the planner imports this module).

``F(m)`` receives from stage ``s-1`` and sends to ``s+1``; ``B(m)`` receives the output gradient and
sends the input gradient; ``W(m)`` (``zb*``) computes the weight gradients ``B(m)`` left out. Schedules:
``gpipe`` (Huang et al. 2019), ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021 §2.2), ``zb``, ``zb-h1``,
``zb-h2`` (Qi et al., ICLR 2024). Start at :func:`build_schedule`; :func:`simulate` checks deadlock freedom.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

SCHEDULES = ("1f1b", "gpipe", "zb", "zb-h1", "zb-h2")
#: schedules whose backward is split into B (input gradient) and W (weight gradient).
SPLIT_BACKWARD = ("zb", "zb-h1", "zb-h2")

Durations = Union[float, Sequence[float]]


class Action(NamedTuple):
    """``kind`` F (forward), B (backward; input gradient only if split) or W (weight gradient) of ``micro``."""

    kind: str
    micro: int

    def __repr__(self) -> str:  # compact for test failure messages
        return f"{self.kind}{self.micro}"


def _check(kind: str, num_stages: int, num_micro: int) -> None:
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    if num_stages < 1 or num_micro < 1:
        raise ValueError(f"bad schedule arguments: P={num_stages}, M={num_micro}")


def build_schedule(kind: str, num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """The actions of ``stage`` for one step of ``num_micro`` (M) micro-batches on ``num_stages`` (P) stages.
    Raises ValueError for an unknown ``kind`` or out-of-range arguments."""
    _check(kind, num_stages, num_micro)
    if not 0 <= stage < num_stages:
        raise ValueError(f"bad schedule arguments: P={num_stages}, M={num_micro}, stage={stage}")
    M = num_micro
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


def in_flight_profile(actions: Sequence[Action]) -> list[int]:
    """Micro-batches held (from ``F`` to their last backward action) after each action."""
    last = {}
    for i, a in enumerate(actions):
        if a.kind != "F":
            last[a.micro] = i
    live, out = 0, []
    for i, a in enumerate(actions):
        if a.kind == "F":
            live += 1
        elif last.get(a.micro) == i:
            live -= 1
        out.append(live)
    return out


def peak_in_flight(kind: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Most micro-batches held at once: ``min(M, P-stage)`` (1f1b, zb), ``min(M, P)`` (zb-h1), ``2P-1``
    (zb-h2), M (gpipe). Raises ValueError as :func:`build_schedule`."""
    return max(in_flight_profile(build_schedule(kind, num_stages, num_micro, stage)))


def peak_pending_weight_grads(kind: str, stage: int, num_stages: int, num_micro: int) -> int:
    """Most micro-batches between ``B`` and ``W`` on ``stage`` (each keeps its weight ops' output gradients):
    zb 1, zb-h1 ``min(M, stage+1)``, zb-h2 ``2 stage + 1``; 0 unsplit and on the first stage."""
    acts = build_schedule(kind, num_stages, num_micro, stage)
    if kind not in SPLIT_BACKWARD or stage == 0:
        return 0
    pending = peak = 0
    for a in acts:
        pending += 1 if a.kind == "B" else -1 if a.kind == "W" else 0
        peak = max(peak, pending)
    return peak


def simulate(kind: str, num_stages: int, num_micro: int, slots: Optional[int] = None) -> int:
    """Run all stages' schedules against each other in unit ticks; returns the ticks. ``slots``: tensors in
    flight per link and direction (None: unbounded). Raises RuntimeError on deadlock."""
    P = num_stages
    scheds = [build_schedule(kind, P, num_micro, s) for s in range(P)]
    pos = [0] * P
    done = {k: [set() for _ in range(P)] for k in "FBW"}
    act_link = [0] * P   # act_link[s]: tensors sent s -> s+1, not yet received
    grad_link = [0] * P  # grad_link[s]: tensors sent s -> s-1, not yet received
    cap = float("inf") if slots is None else int(slots)
    if cap < 1:
        raise ValueError(f"slots must be >= 1 or None, got {slots}")
    ticks = 0
    while any(pos[s] < len(scheds[s]) for s in range(P)):
        finished = [(s, scheds[s][pos[s]]) for s in range(P) if pos[s] < len(scheds[s])
                    and _can_start(scheds[s][pos[s]], s, P, done, act_link, grad_link, cap)]
        if not finished:
            raise RuntimeError(f"schedule {kind} deadlocks for P={P}, M={num_micro}, slots={slots} at {pos}")
        for s, a in finished:
            done[a.kind][s].add(a.micro)
            pos[s] += 1
            _move_tensors(a, s, P, act_link, grad_link)
        ticks += 1
    return ticks


def _can_start(a: Action, s: int, P: int, done: dict, act_link: list, grad_link: list, cap: float) -> bool:
    """Whether stage ``s`` can run ``a`` now (input arrived, outgoing slot free)."""
    if a.kind == "F":
        return (s == 0 or a.micro in done["F"][s - 1]) and (s == P - 1 or act_link[s] < cap)
    if a.kind == "B":
        return (a.micro in done["F"][s] and (s == P - 1 or a.micro in done["B"][s + 1])
                and (s == 0 or grad_link[s] < cap))
    return a.micro in done["B"][s]


def _move_tensors(a: Action, s: int, P: int, act_link: list, grad_link: list) -> None:
    """The link counts after stage ``s`` ran ``a``: its input received, its output sent."""
    if a.kind == "F":
        if s > 0:
            act_link[s - 1] -= 1
        if s < P - 1:
            act_link[s] += 1
    elif a.kind == "B":
        if s < P - 1:
            grad_link[s + 1] -= 1
        if s > 0:
            grad_link[s] += 1


def _per_stage(v: Durations, P: int, name: str) -> list[float]:
    if isinstance(v, (int, float)):
        return [float(v)] * P
    out = [float(x) for x in v]
    if len(out) != P:
        raise ValueError(f"{name}: need one value per stage ({P}), got {len(out)}")
    return out


def stage_timeline(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
                   t_w: Durations = 1.0) -> tuple[list[float], list[float]]:
    """Earliest-start execution; returns per stage ``(end, busy)``. ``t_f, t_b, t_w``: time per micro-batch
    (one value or one per stage); unsplit ``B`` takes ``t_b + t_w``, as does the first stage's in ``zb*``.
    Raises RuntimeError on deadlock."""
    P = num_stages
    tf, tb, tw = (_per_stage(v, P, n) for v, n in ((t_f, "t_f"), (t_b, "t_b"), (t_w, "t_w")))
    split = kind in SPLIT_BACKWARD
    scheds = [build_schedule(kind, P, num_micro, s) for s in range(P)]

    def dur(s: int, k: str) -> float:
        if k == "F":
            return tf[s]
        if k == "B":
            return tb[s] if split and s > 0 else tb[s] + tw[s]
        return tw[s] if s > 0 else 0.0

    end: dict[tuple[str, int, int], float] = {}
    pos, free, busy = [0] * P, [0.0] * P, [0.0] * P
    progressed = True
    while progressed:
        progressed = False
        for s in range(P):
            while pos[s] < len(scheds[s]):
                a = scheds[s][pos[s]]
                if a.kind == "F":
                    deps = [("F", s - 1, a.micro)] if s > 0 else []
                elif a.kind == "B":
                    deps = [("F", s, a.micro)] + ([("B", s + 1, a.micro)] if s < P - 1 else [])
                else:
                    deps = [("B", s, a.micro)]
                if any(d not in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                d = dur(s, a.kind)
                end[(a.kind, s, a.micro)] = free[s] = start + d
                busy[s] += d
                pos[s] += 1
                progressed = True
    if any(pos[s] < len(scheds[s]) for s in range(P)):
        raise RuntimeError(f"schedule {kind} deadlocks for P={P}, M={num_micro}")
    return free, busy


def step_time(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
              t_w: Durations = 1.0) -> float:
    """One step's forward/backward time (unit of ``t_*``), from :func:`stage_timeline`."""
    return max(stage_timeline(kind, num_stages, num_micro, t_f, t_b, t_w)[0])


def bubble_fraction(kind: str, num_stages: int, num_micro: int, t_f: Durations = 1.0, t_b: Durations = 1.0,
                    t_w: Durations = 1.0) -> float:
    """Idle share ``1 - sum(busy) / (P * step_time)``. Unit times: ``(P-1)/(M+P-1)`` (1f1b, gpipe),
    ``2(P-1)/(3M+2(P-1))`` (zb), ``(P-1)/(3M+P-1)`` (zb-h1 for M >= P, zb-h2 for M >= 2P-1)."""
    end, busy = stage_timeline(kind, num_stages, num_micro, t_f, t_b, t_w)
    T = max(end)
    return 1.0 - sum(busy) / (num_stages * T) if T > 0 else 0.0
