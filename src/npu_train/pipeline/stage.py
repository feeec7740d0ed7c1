"""Run one pipeline stage's schedule for one optimizer step (:class:`StageRunner`).

No processes or transport here: boundary traffic goes through a :class:`BoundaryComm` (``recv_act``,
``send_act``, ``recv_grad``, ``send_grad``), implemented by the worker over shm + ZeroMQ and by tests over
queues. The last stage divides each micro-batch's summed loss by the target tokens of the whole step
(``total_tokens``, all replicas), so the gradient does not depend on how the step is cut."""
from __future__ import annotations

import time
from typing import Callable, Optional, Protocol

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

    def __init__(self, module, backend, num_stages: int, stage: int, schedule: str, comm: Optional[BoundaryComm]):
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
        #: called once per step right after the first stage's first forward has been sent, before any
        #: backward: work that need not delay the next stage's start (StageTrainer.after_first_forward:
        #: the rest of the previous step's rows-first embedding update, the embedding's gradient buffer);
        #: its seconds are reported as ``deferred_opt_s`` and traced as a ``U`` action
        self.after_first_forward: Optional[Callable[[], None]] = None

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
            :attr:`after_first_forward`, in none of the others).
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
        saved: dict[int, tuple] = {}
        split = self.schedule in SPLIT_BACKWARD
        pending: dict = {}  # micro -> WeightGradWork (zb: between B and W)
        params = [p for p in self.module.parameters() if p.requires_grad] if split else []
        loss_sum = 0.0
        t_compute = t_wait = t_send = t_deferred = 0.0
        backwards_left = M
        tr = self.trace
        # tracing on an accelerator: the device is synchronized at every timestamp, so an action's
        # interval holds its kernels, not only their launch (CPU: synchronize() is a no-op)
        clock = time.perf_counter if tr is None else self._synced_clock
        for a in build_schedule(self.schedule, self.P, M, self.s):
            m = a.micro
            if a.kind == "F":
                t0 = clock()
                if self.first:
                    x = self.backend.upload(inputs[m])
                else:
                    x = self.comm.recv_act(step, m)
                    x.requires_grad_(True)
                t1 = clock()
                # split backward past the first stage: the graph cut per layer (StageModule.forward cuts=)
                cuts = [] if split and not self.first else None
                out = self.module(x) if cuts is None else self.module(x, cuts=cuts)
                if self.last:
                    ls, _ = causal_lm_loss_sum(out, self.backend.upload(labels[m]), fused=getattr(self.module, "fused_head", False))
                    loss = ls / total_tokens
                    loss_sum += float(ls.detach())
                    saved[m] = (x, loss, cuts)
                    t2 = t3 = clock()
                else:
                    saved[m] = (x, out, cuts)
                    t2 = clock()
                    self.comm.send_act(step, m, out.detach())
                    t3 = clock()
                t_wait += t1 - t0
                t_compute += t2 - t1
                t_send += t3 - t2
                if tr is not None:
                    tr.append(("F", m, t0, t1, t2, t3))
                if m == 0 and self.first and self.after_first_forward is not None:  # (every schedule starts with F0)
                    u0 = clock()
                    self.after_first_forward()
                    u1 = clock()
                    t_deferred += u1 - u0
                    if tr is not None:
                        tr.append(("U", -1, u0, u0, u1, u1))
            elif a.kind == "B":
                x, out, cuts = saved.pop(m) if not split else saved[m]
                t0 = clock()
                g = None
                if not self.last:
                    g = self.comm.recv_grad(step, m)
                t1 = clock()
                if split and not self.first:
                    dx, pending[m] = backward_input(out, g, x, params, cuts=cuts)
                else:  # full backward (first stage of zb: nothing waits for an input gradient)
                    out.backward(g)
                    dx = x.grad if not self.first else None
                    if split:
                        pending[m] = None
                t2 = clock()
                if not self.first:
                    self.comm.send_grad(step, m, dx)
                t3 = clock()
                t_wait += t1 - t0
                t_compute += t2 - t1
                t_send += t3 - t2
                if tr is not None:
                    tr.append(("B", m, t0, t1, t2, t3))
                del x, out, g, dx, cuts
                backwards_left -= 1
                if early is not None and split and backwards_left == 0:
                    t0 = clock()
                    for work in pending.values():
                        if work is not None:
                            work.run(only=early[0])
                    t1 = clock()
                    early[1]()
                    t2 = clock()
                    t_compute += t1 - t0
                    t_send += t2 - t1
                    if tr is not None:
                        tr.append(("E", -1, t0, t0, t1, t2))
                    early = None
            else:  # "W": weight gradients deferred by this micro-batch's B
                t0 = clock()
                work = pending.pop(m)
                del saved[m]
                if work is not None:
                    work.run()
                t1 = clock()
                t_compute += t1 - t0
                if tr is not None:
                    tr.append(("W", m, t0, t0, t1, t1))
                del work
        assert not saved and not pending, \
            f"schedule left micro-batches without backward: {sorted(saved)} {sorted(pending)}"
        if early is not None:
            early[1]()
        self.backend.synchronize()
        return {"loss_sum": loss_sum, "n_tokens": local_tokens,
                "compute_s": t_compute, "wait_s": t_wait, "send_s": t_send, "deferred_opt_s": t_deferred}
