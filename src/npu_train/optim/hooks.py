"""The optimizer-step hooks: where parts of an optimizer step run inside the forward and backward.

:class:`StepHooks` names three points; every piece of step work that starts early registers there:

- **gradient ready** (:meth:`~StepHooks.on_grad_ready`): a micro-batch's gradient was just added into
  ``.grad`` (post-accumulate-grad hook; the zero-bubble W passes fire it too), in registration order.
  Users: the fp32 fold, then the offload overlap's final-gradient count (:mod:`npu_train.optim.adamw`).
- **layer ready** (:meth:`~StepHooks.on_layer_ready`): forward pre-hook of a layer. User: the offload
  overlap's wait for that layer's host update (:func:`npu_train.runtime.overlap.install_waits`).
- **first forward sent** (:meth:`~StepHooks.on_first_forward_sent`): once per step on the first stage,
  after its first forward left the card (fired by :class:`~npu_train.pipeline.stage.StageRunner`).
  Users: the rows-first embedding update's finish, then the sparse embedding gradient's zeroing.
"""
from __future__ import annotations

from typing import Callable

import torch


class StepHooks:
    """The registry of a stage's optimizer-step hooks (module docstring)."""

    def __init__(self):
        self._first_forward: list[Callable[[], object]] = []
        self.handles: list = []  # torch hook handles (``.remove()``)

    def on_grad_ready(self, param: torch.nn.Parameter, fn: Callable[[torch.nn.Parameter], None]) -> None:
        """Call ``fn(param)`` each time a micro-batch's gradient has been added into ``param.grad``."""
        self.handles.append(param.register_post_accumulate_grad_hook(fn))

    def on_layer_ready(self, module: torch.nn.Module, fn: Callable[[], None]) -> None:
        """Call ``fn()`` before every forward through ``module``."""
        self.handles.append(module.register_forward_pre_hook(lambda _m, _args: fn()))

    def on_first_forward_sent(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once per step after the first stage's first forward has been sent."""
        self._first_forward.append(fn)

    @property
    def has_first_forward_work(self) -> bool:
        return bool(self._first_forward)

    def first_forward_sent(self) -> None:
        """Fire the first-forward-sent hooks (the pipeline's runner calls it)."""
        for fn in self._first_forward:
            fn()
