"""Learning-rate schedule: linear warm-up (Goyal et al. 2017), then cosine decay to ``min_lr_ratio * lr``
(Loshchilov & Hutter 2017); a pure function of the step.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate of step ``step`` (0-based): ``lr*(step+1)/warmup_steps``, then cosine to ``lr*min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    floor = lr * min_lr_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def warmup_note(*, lr: float, warmup_steps: int, total_steps: int) -> "str | None":
    """A console note when the warm-up outlasts the run (``warmup_steps > total_steps``), else None."""
    from npu_train.errors import fmt_number

    if warmup_steps <= total_steps:
        return None
    top = lr_at(total_steps - 1, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps)
    return (f"note: train.warmup_steps={warmup_steps} > train.steps={total_steps}: the warm-up never ends, the "
            f"learning rate peaks at {fmt_number(float(f'{top:.3g}'))} ({top / lr:.0%} of train.lr={fmt_number(lr)}); lower train.warmup_steps or raise train.steps")
