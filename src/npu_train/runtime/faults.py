"""Test-only fault injection in a card process: ``NPT_FAULT="rank=1,phase=backward,step=2,action=kill"``.

``rank``: the card process; ``step``: 1-based (default 1); ``phase``: ``load``, ``forward``, ``backward``,
``collective``, ``optimizer``, ``checkpoint`` (after writing the shard, before reporting it);
``action``: ``kill``, ``stop`` (SIGSTOP), ``raise`` (RuntimeError), ``sleep:S`` (s), ``inf`` (backward:
an inf gradient).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

import torch

log = logging.getLogger("npu_train.worker")


_FAULT_PHASES = ("load", "forward", "backward", "collective", "optimizer", "checkpoint")
_SETUP_PHASES = ("load",)  # fired before the first step: the step number is not checked
#: seconds a kill / stop waits first: ZeroMQ sends from its own I/O thread, so a signal right after
#: ``StageTrainer.enter`` can stop that thread before it delivers the phase message, and the coordinator
#: names the previous phase (seen under load: "checkpoint save of step 2" for a stop in step 3's forward)
SETTLE_S = 0.5


class FaultHook:
    """Test-only: fires the ``NPT_FAULT`` action once at (rank, phase, step); see the module docstring."""

    def __init__(self, text: str, rank: int):
        kv = dict(p.split("=", 1) for p in text.replace(" ", "").split(",") if p)
        self.active = int(kv.get("rank", 0)) == rank
        self.phase = kv.get("phase", "forward")
        self.step = int(kv.get("step", 1))
        self.action = kv.get("action", "kill")
        if self.phase not in _FAULT_PHASES:
            raise ValueError(f"NPT_FAULT: phase={self.phase!r}, use one of {_FAULT_PHASES}")
        self.current_step = 0  # 1-based step being run, set by the training loop
        self.fired = False

    @classmethod
    def from_env(cls, rank: int) -> "FaultHook | None":
        text = os.environ.get("NPT_FAULT", "")
        return cls(text, rank) if text else None

    def __call__(self, phase: str) -> None:
        if not self.active or self.fired or phase != self.phase:
            return
        if phase not in _SETUP_PHASES and self.current_step != self.step:
            return
        self.fired = True
        log.warning("NPT_FAULT: %s at step %d %s", self.action, self.step, phase)
        sys.stderr.flush()
        if self.action in ("kill", "stop"):
            time.sleep(SETTLE_S)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "raise":
            raise RuntimeError(f"NPT_FAULT: injected failure at step {self.step} {phase}")
        elif self.action == "inf":
            pass  # applied to the gradient by the hook installed in install()
        elif self.action.startswith("sleep:"):
            time.sleep(float(self.action.split(":", 1)[1]))
        else:
            raise ValueError(f"NPT_FAULT: unknown action {self.action!r}")

    def install(self, module) -> None:
        """Forward pre-hook on the stage module and a gradient hook on its first parameter."""
        if not self.active:
            return
        module.register_forward_pre_hook(lambda *_: self("forward"))
        first = next(p for p in module.parameters() if p.requires_grad)

        def on_grad(g):
            fired = self.fired
            self("backward")
            if self.action == "inf" and self.fired and not fired:
                if g.is_sparse:  # a cpu card's embedding gradient (StageModule.sparse_embed_grad): its rows
                    g = g.coalesce()
                    return torch.sparse_coo_tensor(g.indices(), torch.full_like(g.values(), float("inf")), g.shape)
                return torch.full_like(g, float("inf"))
            return g

        first.register_hook(on_grad)
