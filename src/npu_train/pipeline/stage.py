"""Run one pipeline stage's schedule for one optimizer step (:class:`StageRunner`).

No processes or transport here: boundary traffic goes through a :class:`BoundaryComm` (``recv_act``,
``send_act``, ``recv_grad``, ``send_grad``), implemented by the worker over shm + ZeroMQ and by tests over
queues. The last stage divides each micro-batch's summed loss by the target tokens of the whole step
(``total_tokens``, all replicas), so the gradient does not depend on how the step is cut."""
from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from npu_train.errors import ConfigError
from npu_train.model.llama import IGNORE_INDEX, causal_lm_loss_sum
from npu_train.pipeline.backward import backward_input
from npu_train.pipeline.schedule import SPLIT_BACKWARD, build_schedule


#: micro-batch ids of evaluation passes start here (training micro-batches are 0..M-1).
EVAL_MICRO_BASE = 1 << 20


class BoundaryComm(Protocol):
    """Stage-boundary transport as seen by one stage. Tensors are CPU or device tensors of shape
    ``[micro_batch, seq_len, hidden]`` in the compute dtype; received tensors are already on the card."""

    def recv_act(self, step: int, micro: int) -> torch.Tensor: ...
    def send_act(self, step: int, micro: int, t: torch.Tensor) -> None: ...
    def recv_grad(self, step: int, micro: int) -> torch.Tensor: ...
    def send_grad(self, step: int, micro: int, t: torch.Tensor) -> None: ...


class StageRunner:
    """Executes GPipe/1F1B/zero-bubble for one stage.

    In ``zb``/``zb-h1``/``zb-h2`` (:data:`npu_train.pipeline.schedule.SPLIT_BACKWARD`) a ``B`` action computes only
    the gradient w.r.t. the stage input and sends it upstream at once; the matching ``W`` adds
    the weight gradients to ``p.grad`` later (:mod:`npu_train.pipeline.backward`). On the first
    stage the input is token ids, no stage waits for its input gradient, so there ``B`` is the
    full backward and ``W`` does nothing (fewer graph walks, the graph is freed sooner).

    Args:
        module: the stage's :class:`npu_train.model.llama.StageModule` (on the card).
        backend: the card's backend (``upload``/``synchronize``).
        num_stages, stage: pipeline size P and this stage's index.
        schedule: one of :data:`npu_train.pipeline.schedule.SCHEDULES`.
        comm: the boundary transport (unused when P == 1).
        hooks: the stage's :class:`~npu_train.optim.hooks.StepHooks` or None; its first-forward-sent hooks
            run on the first stage right after the step's first forward was sent, timed as
            ``deferred_opt_s`` and traced as a ``U`` action.

    Attributes:
        trace: None (default), or a list the next :meth:`run_step` appends one tuple per action to:
            ``(kind, micro, t_start, t_ready, t_done, t_end)``, ``time.perf_counter`` seconds
            (CLOCK_MONOTONIC on Linux: comparable across the card processes of one host). ``kind``
            is ``"F"``, ``"B"``, ``"W"`` or ``"E"`` (the early weight-gradient groups, then their
            ``done()``, see ``early``); ``t_start`` to ``t_ready`` is the wait for the neighbour's
            tensor (0 long on the first stage's forward), ``t_ready`` to ``t_done`` the compute,
            ``t_done`` to ``t_end`` the send (``done()`` for ``E``). On an accelerator the device is
            synchronized at every timestamp while tracing (the intervals are device time; the
            overlap of kernel launches with the next action is lost). The first stage's forward
            "wait" is the upload of its token ids. The per-action timeline behind ``runtime.trace`` (:mod:`npu_train.metrics.trace`).

    Raises:
        ConfigError: ``zb`` with a module built with ``recompute=True`` (W would recompute
            every layer's forward a second time).
    """

    def __init__(self, module, backend, num_stages: int, stage: int, schedule: str, comm: Optional[BoundaryComm],
                 hooks=None):
        if schedule in SPLIT_BACKWARD and getattr(module, "recompute", False):
            raise ConfigError(f"train.schedule={schedule} does not combine with train.recompute=true: "
                              "use train.schedule=1f1b for activation recompute")
        self.module = module
        self.backend = backend
        self.P = num_stages
        self.s = stage
        self.schedule = schedule
        self.comm = comm
        self.first = stage == 0
        self.last = stage == num_stages - 1
        self.trace: Optional[list] = None
        self.hooks = hooks

    def run_step(self, step: int, inputs: Optional[list[torch.Tensor]], labels: Optional[list[torch.Tensor]],
                 total_tokens: Optional[int] = None, early: Optional[tuple] = None) -> dict:
        """Forward and backward all micro-batches of optimizer step ``step``; gradients accumulate in ``.grad``.

        Args:
            inputs: first stage only: M int64 CPU tensors ``[micro_batch, seq_len]``.
            labels: last stage only: M int64 CPU tensors ``[micro_batch, seq_len]``
                (``IGNORE_INDEX`` = ignored).
            total_tokens: last stage: the loss divisor, target tokens of the whole global step (all
                data-parallel replicas); None = the target tokens of ``labels``.
            early: ``(params, done)``: gradients wanted before the step's backward ends. In a
                split-backward schedule, right after the step's last ``B``, the weight-gradient
                groups holding ``params`` run for every micro-batch still waiting for its ``W``,
                then ``done()`` is called (the ``.grad`` of ``params`` is final), then the rest of
                those ``W`` passes run in schedule order. Without a split backward ``done()`` is
                called after the last action. The last stage's tied ``lm_head`` gradient leaves
                for the first stage this way while the deferred layer ``W`` passes still run
                (:mod:`npu_train.runtime.tied`). Same gradients, bit for bit: every group still
                runs once per micro-batch.

        Returns:
            ``{"loss_sum": float (last stage: summed token CE in nats, else 0), "n_tokens": int (last
            stage: target tokens of ``labels``, this replica's share),
            "compute_s", "wait_s", "send_s", "deferred_opt_s"}`` (seconds; ``deferred_opt_s``:
            the first-forward-sent hooks, in none of the others).
        """
        M = len(inputs) if inputs is not None else len(labels) if labels is not None else None
        if M is None:
            raise ValueError("a middle stage needs the number of micro-batches: pass inputs=None, labels=None via run_middle")
        return self._run(step, M, inputs, labels, total_tokens, early)

    def run_middle(self, step: int, num_micro: int) -> dict:
        """:meth:`run_step` for a stage that is neither first nor last."""
        return self._run(step, num_micro, None, None)

    @torch.no_grad()
    def run_eval(self, step: int, num_micro: int, inputs: Optional[list[torch.Tensor]],
                 labels: Optional[list[torch.Tensor]]) -> dict:
        """Forward-only pass over ``num_micro`` held-out micro-batches (no gradients, no backward).

        Boundary traffic uses the same links as training, with the micro-batch index offset by
        ``EVAL_MICRO_BASE`` so evaluation messages can never be confused with training ones.

        Returns ``{"loss_sum": float (last stage), "n_tokens": int (last stage)}``.
        """
        loss_sum, n_tok = 0.0, 0
        for m in range(num_micro):
            tag = EVAL_MICRO_BASE + m
            x = self.backend.upload(inputs[m]) if self.first else self.comm.recv_act(step, tag)
            out = self.module(x)
            if self.last:
                ls, n = causal_lm_loss_sum(out, self.backend.upload(labels[m]))
                loss_sum += float(ls)
                n_tok += int(n)
            else:
                self.comm.send_act(step, tag, out)
        return {"loss_sum": loss_sum, "n_tokens": n_tok}

    def _synced_clock(self) -> float:
        self.backend.synchronize()
        return time.perf_counter()

    def _run(self, step, M, inputs, labels, total_tokens=None, early=None) -> dict:
        local_tokens = 0
        if self.last:
            local_tokens = int(sum(int((l != IGNORE_INDEX).sum()) for l in labels))
            if total_tokens is None:
                total_tokens = local_tokens
            if total_tokens == 0:
                raise ValueError(f"step {step}: no target tokens in the step's micro-batches")
        run = _StepRun(self, step, M, inputs, labels, total_tokens, early)
        for a in build_schedule(self.schedule, self.P, M, self.s):
            if a.kind == "F":
                run.forward(a.micro)
            elif a.kind == "B":
                run.backward(a.micro)
            else:
                run.weight(a.micro)
        return run.end(local_tokens)


class _StepRun:
    """One step of a :class:`StageRunner`: the schedule's actions on the saved micro-batch graphs, with
    the seconds of each kind of work (``compute``, ``wait``, ``send``, ``deferred``)."""

    def __init__(self, runner: StageRunner, step: int, M: int, inputs, labels, total_tokens, early):
        self.r, self.step, self.inputs, self.labels, self.total_tokens = runner, step, inputs, labels, total_tokens
        self.early = early
        self.saved: dict[int, tuple] = {}
        self.split = runner.schedule in SPLIT_BACKWARD
        self.pending: dict = {}  # micro -> WeightGradWork (zb: between B and W)
        self.params = [p for p in runner.module.parameters() if p.requires_grad] if self.split else []
        self.loss_sum = 0.0
        self.compute = self.wait = self.send = self.deferred = 0.0
        self.backwards_left = M
        self.tr = runner.trace
        # tracing on an accelerator: the device is synchronized at every timestamp, so an action's
        # interval holds its kernels, not only their launch (CPU: synchronize() is a no-op)
        self.clock = time.perf_counter if self.tr is None else runner._synced_clock

    def _account(self, kind: str, m: int, t0: float, t1: float, t2: float, t3: float) -> None:
        self.wait += t1 - t0
        self.compute += t2 - t1
        self.send += t3 - t2
        if self.tr is not None:
            self.tr.append((kind, m, t0, t1, t2, t3))

    def forward(self, m: int) -> None:
        r, clock = self.r, self.clock
        t0 = clock()
        if r.first:
            x = r.backend.upload(self.inputs[m])
        else:
            x = r.comm.recv_act(self.step, m)
            x.requires_grad_(True)
        t1 = clock()
        # split backward past the first stage: the graph cut per layer (StageModule.forward cuts=)
        cuts = [] if self.split and not r.first else None
        out = r.module(x) if cuts is None else r.module(x, cuts=cuts)
        if r.last:
            ls, _ = causal_lm_loss_sum(out, r.backend.upload(self.labels[m]), fused=getattr(r.module, "fused_head", False))
            self.loss_sum += float(ls.detach())
            self.saved[m] = (x, ls / self.total_tokens, cuts)
            t2 = t3 = clock()
        else:
            self.saved[m] = (x, out, cuts)
            t2 = clock()
            r.comm.send_act(self.step, m, out.detach())
            t3 = clock()
        self._account("F", m, t0, t1, t2, t3)
        hooks = r.hooks
        if m == 0 and r.first and hooks is not None and hooks.has_first_forward_work:  # (every schedule starts with F0)
            u0 = clock()
            hooks.first_forward_sent()
            u1 = clock()
            self.deferred += u1 - u0
            if self.tr is not None:
                self.tr.append(("U", -1, u0, u0, u1, u1))

    def backward(self, m: int) -> None:
        r, clock = self.r, self.clock
        x, out, cuts = self.saved.pop(m) if not self.split else self.saved[m]
        t0 = clock()
        g = None if r.last else r.comm.recv_grad(self.step, m)
        t1 = clock()
        if self.split and not r.first:
            dx, self.pending[m] = backward_input(out, g, x, self.params, cuts=cuts)
        else:  # full backward (first stage of zb: nothing waits for an input gradient)
            out.backward(g)
            dx = x.grad if not r.first else None
            if self.split:
                self.pending[m] = None
        t2 = clock()
        if not r.first:
            r.comm.send_grad(self.step, m, dx)
        t3 = clock()
        self._account("B", m, t0, t1, t2, t3)
        del x, out, g, dx, cuts
        self.backwards_left -= 1
        if self.early is not None and self.split and self.backwards_left == 0:
            self._early_weight_grads()

    def _early_weight_grads(self) -> None:
        """After the last ``B``: the W groups of the ``early`` parameters, then its ``done()``."""
        clock, (params, done) = self.clock, self.early
        t0 = clock()
        for work in self.pending.values():
            if work is not None:
                work.run(only=params)
        t1 = clock()
        done()
        t2 = clock()
        self.compute += t1 - t0
        self.send += t2 - t1
        if self.tr is not None:
            self.tr.append(("E", -1, t0, t0, t1, t2))
        self.early = None

    def weight(self, m: int) -> None:
        """``W``: the weight gradients deferred by micro-batch ``m``'s ``B``."""
        t0 = self.clock()
        work = self.pending.pop(m)
        del self.saved[m]
        if work is not None:
            work.run()
        t1 = self.clock()
        self.compute += t1 - t0
        if self.tr is not None:
            self.tr.append(("W", m, t0, t0, t1, t1))

    def end(self, local_tokens: int) -> dict:
        assert not self.saved and not self.pending, \
            f"schedule left micro-batches without backward: {sorted(self.saved)} {sorted(self.pending)}"
        if self.early is not None:
            self.early[1]()
        self.r.backend.synchronize()
        return {"loss_sum": self.loss_sum, "n_tokens": local_tokens, "compute_s": self.compute,
                "wait_s": self.wait, "send_s": self.send, "deferred_opt_s": self.deferred}
