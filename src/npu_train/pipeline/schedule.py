"""Pipeline schedules as pure lists of actions.

A schedule is the ordered list of ``Action``s one stage executes for the ``M`` micro-batches of
one optimizer step. Communication is implicit in the actions:

- ``F(m)`` on stage ``s > 0`` first receives the activation of micro-batch ``m`` from stage
  ``s-1``; on stage ``s < P-1`` it ends by sending its output activation to stage ``s+1``.
- ``B(m)`` on stage ``s < P-1`` first receives the gradient w.r.t. its output from stage ``s+1``;
  on stage ``s > 0`` it ends by sending the gradient w.r.t. its input to stage ``s-1``.

Schedules (Huang et al. 2019, "GPipe"; Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 2.2 for 1F1B / PipeDream-Flush):

- ``gpipe``: all forwards, then all backwards. Stage ``s`` holds activations of all ``M``
  micro-batches at its peak.
- ``1f1b``: ``min(P-s-1, M)`` warm-up forwards, then alternate one forward / one backward, then
  the remaining backwards. Stage ``s`` holds at most ``min(M, P-s)`` micro-batches of activations.

Both have the same bubble fraction ``(P-1) / (M+P-1)`` of the step.
"""
from __future__ import annotations

from typing import NamedTuple

SCHEDULES = ("1f1b", "gpipe")


class Action(NamedTuple):
    """One schedule step: ``kind`` is ``"F"`` (forward) or ``"B"`` (backward) of micro-batch ``micro``."""

    kind: str
    micro: int

    def __repr__(self) -> str:  # compact for test failure messages
        return f"{self.kind}{self.micro}"


def build_schedule(kind: str, num_stages: int, num_micro: int, stage: int) -> list[Action]:
    """Return the actions of ``stage`` (0-based) for one optimizer step.

    Args:
        kind: ``"1f1b"`` or ``"gpipe"``.
        num_stages: P >= 1.
        num_micro: M >= 1 micro-batches per optimizer step (gradient accumulation steps).
        stage: 0 <= stage < P.

    Raises:
        ValueError: unknown schedule or out-of-range arguments.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    if num_stages < 1 or num_micro < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"bad schedule arguments: P={num_stages}, M={num_micro}, stage={stage}")
    if kind == "gpipe":
        return [Action("F", m) for m in range(num_micro)] + [Action("B", m) for m in range(num_micro)]
    warmup = min(num_stages - stage - 1, num_micro)
    actions = [Action("F", m) for m in range(warmup)]
    f, b = warmup, 0
    while f < num_micro:
        actions.append(Action("F", f))
        f += 1
        actions.append(Action("B", b))
        b += 1
    while b < num_micro:
        actions.append(Action("B", b))
        b += 1
    return actions


def peak_in_flight(actions: list[Action]) -> int:
    """Largest number of micro-batches whose forward ran but whose backward has not (activations held)."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def simulate(kind: str, num_stages: int, num_micro: int) -> int:
    """Run all stages' schedules against each other with unit-time actions and unbounded buffers.

    Returns the number of time ticks the step takes. Raises ``RuntimeError`` on deadlock (used by
    the tests to prove every (P, M) combination completes).
    """
    scheds = [build_schedule(kind, num_stages, num_micro, s) for s in range(num_stages)]
    pos = [0] * num_stages
    done_f = [set() for _ in range(num_stages)]
    done_b = [set() for _ in range(num_stages)]
    ticks = 0
    while any(pos[s] < len(scheds[s]) for s in range(num_stages)):
        progressed = False
        finished = []
        for s in range(num_stages):
            if pos[s] >= len(scheds[s]):
                continue
            a = scheds[s][pos[s]]
            if a.kind == "F":
                ready = s == 0 or a.micro in done_f[s - 1]
            else:
                ready = a.micro in done_f[s] and (s == num_stages - 1 or a.micro in done_b[s + 1])
            if ready:
                finished.append((s, a))
        for s, a in finished:
            (done_f if a.kind == "F" else done_b)[s].add(a.micro)
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {kind} deadlocks for P={num_stages}, M={num_micro} at {pos}")
        ticks += 1
    return ticks
