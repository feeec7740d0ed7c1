"""Learning-rate schedule: linear warm-up then cosine decay to ``min_lr_ratio * lr``.

The schedule is a pure function of the optimizer step, so resuming needs only the step number.
Formula as in Loshchilov & Hutter 2017 (SGDR, cosine annealing without restarts) with a linear
warm-up (Goyal et al. 2017).
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate used by optimizer step ``step`` (0-based).

    Steps ``0 .. warmup_steps-1`` ramp linearly ``lr*(step+1)/warmup_steps``; afterwards the rate
    follows a half cosine from ``lr`` (at ``warmup_steps``) to ``lr*min_lr_ratio`` (at ``total_steps``).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def warmup_note(*, lr: float, warmup_steps: int, total_steps: int) -> "str | None":
    """A note for the console when the linear warm-up does not end within the run
    (``warmup_steps > total_steps``): the highest rate the run reaches, as a fraction of ``lr``
    (:func:`lr_at` of the last step), and the fix; ``None`` otherwise."""
    if warmup_steps <= total_steps:
        return None
    top = lr_at(total_steps - 1, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    return (f"note: train.warmup_steps={warmup_steps} > train.steps={total_steps}: the warm-up never ends, the "
            f"learning rate peaks at {top:.3g} ({top / lr:.0%} of train.lr={lr:g}); lower train.warmup_steps or raise train.steps")
