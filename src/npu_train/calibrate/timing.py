"""Timing loops of the calibration (:class:`LoopBounds`, :func:`timed`, :func:`timed_pairs`) and the
dtype names it measures in; torch is imported inside the functions."""
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
    """How long one figure's timing loop runs (:func:`timed`).

    Attributes:
        min_time: seconds the repetitions run at least (once ``min_reps`` are done, the loop stops
            at the first repetition that ends after ``min_time``).
        max_time: seconds (warm-up included) after which the loop stops once one repetition is done.
        max_reps: most repetitions.
        min_reps: fewest repetitions (unless ``max_time`` passes first).
        warmup: untimed calls first (the first call allocates; the figure is the median after it).
    """

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
    """``rounds`` pairs ``(seconds of first, seconds of second)``, each pair timed back to back with
    ``loop``'s bounds divided by ``rounds`` (one repetition at least, no warm-up inside), after
    ``loop.warmup`` untimed calls of both: a ratio of the two taken per pair cancels the machine's
    drift between figures (:func:`~npu_train.calibrate.measure.head_vs_layer`, :func:`~npu_train.calibrate.splitcost.split_backward_ratio`)."""
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
