"""Timing loops of the calibration (:class:`LoopBounds`, :func:`timed`, :func:`timed_pairs`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Callable

__all__ = ["LoopBounds", "FULL", "QUICK", "timed", "timed_pairs", "torch_dtype", "planner_dtype"]


def torch_dtype(name: str):
    """The torch dtype of a planner dtype name (``fp32`` | ``bf16``)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def planner_dtype(kind: str) -> str:
    """The compute dtype ``train.dtype=auto`` picks for ``kind`` (fp32 on cpu, bf16 elsewhere)."""
    return "fp32" if kind == "cpu" else "bf16"


@dataclass(frozen=True)
class LoopBounds:
    """How long one timing loop runs (seconds; :func:`timed`): at least ``min_reps`` and ``min_time``, stop
    after ``max_time`` (warm-up included) or ``max_reps``; ``warmup`` untimed calls first."""

    min_time: float
    max_time: float
    max_reps: int
    min_reps: int = 3
    warmup: int = 2


#: ``calibrate=true``: about 0.6 s per figure, at most 3 s (a whole cpu calibration ~25-45 s on 2 cores)
FULL = LoopBounds(min_time=0.6, max_time=3.0, max_reps=50, min_reps=3, warmup=2)
#: tests (``quick=True``): tiny sizes, a few repetitions
QUICK = LoopBounds(min_time=0.02, max_time=0.1, max_reps=3, min_reps=3, warmup=2)
def timed(fn: Callable[[], None], sync: Callable[[], None], loop: LoopBounds) -> float:
    """Median seconds of ``fn`` (``sync`` after each call) within ``loop``'s bounds."""
    t_start = time.perf_counter()
    for _ in range(loop.warmup):
        fn()
        sync()
    times: list[float] = []
    t_end = time.perf_counter() + loop.min_time
    while len(times) < loop.max_reps and (len(times) < loop.min_reps or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > loop.max_time:
            break
    return median(times)


def timed_pairs(first: Callable[[], None], second: Callable[[], None], sync: Callable[[], None],
                loop: LoopBounds, rounds: int) -> list[tuple[float, float]]:
    """``rounds`` pairs ``(s of first, s of second)`` timed back to back (``loop``'s bounds / ``rounds``) after
    the warm-up: a per-pair ratio cancels the machine's drift."""
    short = LoopBounds(min_time=loop.min_time / rounds, max_time=loop.max_time / rounds,
                       max_reps=loop.max_reps, min_reps=1, warmup=0)
    for _ in range(loop.warmup):
        second()
        first()
        sync()
    out = []
    for _ in range(rounds):
        t_first = timed(first, sync, short)
        out.append((t_first, timed(second, sync, short)))
    return out
