"""The optimizer-step hooks: where parts of an optimizer step run inside the forward and backward.

An optimizer step is not only the call after the backward: some of its work starts as soon as its
inputs are ready. :class:`StepHooks` names those points, and every such piece registers through it:

- **gradient ready** (:meth:`StepHooks.on_grad_ready`): autograd has just added one micro-batch's
  gradient into a parameter's ``.grad`` (torch's post-accumulate-grad hook; the zero-bubble W
  passes of :mod:`npu_train.pipeline.backward` fire it too). Once per parameter and micro-batch,
  in registration order. Users (:class:`~npu_train.optim.adamw.StageOptimizer`): the fp32 fold of a
  low-precision ``.grad`` into its accumulator, then the offload overlap's count that starts a
  layer's gradient download and host AdamW once the gradient is final (:mod:`npu_train.optim.offload`).
- **layer ready** (:meth:`StepHooks.on_layer_ready`): before the forward through a layer's module
  (a forward pre-hook). User: the offload overlap, which waits there for that layer's pending host
  update only (:func:`npu_train.runtime.overlap.install_waits`).
- **first forward sent** (:meth:`StepHooks.on_first_forward_sent`): once per step on the first stage,
  right after its first micro-batch's forward has left the card, before any backward
  (:class:`~npu_train.pipeline.stage.StageRunner` fires it and times it as ``deferred_opt_s``). Users:
  the rest of the rows-first embedding update (:mod:`npu_train.optim.rowsfirst`), then the sparse
  embedding gradient's zeroed buffer (:class:`~npu_train.runtime.trainer.StageTrainer`).
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
