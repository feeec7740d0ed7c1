"""Run one pipeline stage's schedule for one optimizer step (:class:`StageRunner`) over a
:class:`BoundaryComm`. The loss is divided by the whole step's count of the objective's units (target
tokens; DPO: pairs), so gradients do not depend on how the step is cut.
"""
from __future__ import annotations

import time
from typing import Optional, Protocol

import torch

from npu_train.errors import ConfigError
from npu_train.pipeline.backward import backward_input
from npu_train.pipeline.objective import SftObjective
from npu_train.pipeline.schedule import SPLIT_BACKWARD, build_schedule, chunks_per_card, virtual_stage


#: micro-batch ids of evaluation passes start here (training micro-batches are 0..M-1).
EVAL_MICRO_BASE = 1 << 20
#: micro-batch ids of the DPO reference pass start here (before step 1: step tag 0)
REF_MICRO_BASE = 1 << 22


class BoundaryComm(Protocol):
    """Stage-boundary transport: ``[micro_batch, seq_len, hidden]`` compute-dtype tensors, received on the card.
    Mixtures of experts with the load-balancing loss (:mod:`npu_train.pipeline.moeaux`) also pass ``meta`` (a
    small msgpack-able dict) with a tensor and receive it with ``with_meta=True`` as ``(tensor, meta or None)``;
    a transport used only for dense models may omit both."""

    def recv_act(self, step: int, micro: int, with_meta: bool = False) -> torch.Tensor: ...
    def send_act(self, step: int, micro: int, t: torch.Tensor, meta: Optional[dict] = None) -> None: ...
    def recv_grad(self, step: int, micro: int, with_meta: bool = False) -> torch.Tensor: ...
    def send_grad(self, step: int, micro: int, t: torch.Tensor, meta: Optional[dict] = None) -> None: ...


class _Chunk:
    """One chunk of a card: ``index`` on the card (0 or 1), ``first`` / ``last`` in the whole (virtual)
    pipeline (embedding input / loss), ``comm`` its boundaries, ``arg``: ``StageModule.forward``'s ``chunk``."""

    def __init__(self, index: int, first: bool, last: bool, comm, arg: Optional[int]):
        self.index, self.first, self.last, self.comm, self.arg = index, first, last, comm, arg


def work_clock(kind: str):
    """The CPU-time clock of a card's compute (seconds), or None where CPU time is not its work: on a cpu card
    the calling thread's CPU time (``time.thread_time``): at one torch thread the whole computation runs in this
    thread; at several, with passive OpenMP waits (``OMP_WAIT_POLICY=PASSIVE``, what the launcher starts cpu cards
    at several threads with, :func:`~npu_train.hostmem.card_wait_env`), its serial part and its share of
    each parallel region, what an unloaded host's wall clock takes. With spinning waits (the user's own
    ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT``) at several threads there is none: a thread spinning for a
    descheduled peer counts CPU time that is no work. Unlike the wall clock, it does not count the time other
    processes of a loaded host held the cores; an accelerator's work is not the host's CPU time."""
    from npu_train.hostmem import passive_waits

    if kind != "cpu":
        return None
    return time.thread_time if torch.get_num_threads() == 1 or passive_waits() else None


class StageRunner:
    """Executes a schedule for one card (two chunks for a two-chunk schedule: ``comm.chunk(c)`` gives each
    chunk's ``BoundaryComm``); split-backward ``W`` via :mod:`npu_train.pipeline.backward` (the
    first stage runs the full backward in ``B``).

    ``hooks``: :class:`~npu_train.optim.hooks.StepHooks` fired after the first forward (``deferred_opt_s``).
    ``trace``: None or a list that gets ``(kind, micro, t_start, t_ready, t_done, t_end)`` per action
    (``perf_counter`` s, device synchronized; :mod:`npu_train.metrics.trace`). Raises ConfigError for a
    split-backward schedule with ``recompute=True``. ``objective``: the last stage's loss
    (:mod:`npu_train.pipeline.objective`; default next-token cross-entropy); its targets are what ``labels``
    holds per micro-batch. ``moe``: a mixture-of-experts stage's
    :class:`~npu_train.pipeline.moeaux.StageRouting` (router statistics, the load-balancing loss), or None.
    ``vocab``: vocabulary parallelism's :class:`~npu_train.pipeline.vocab.VocabWork` (every card runs the
    schedule's joint ``V(m)``; the head card's last chunk ends at the final norm, its backward starts from the
    summed input gradient ``V(m)`` returns; every card needs the step's targets), or None."""

    def __init__(self, module, backend, num_stages: int, stage: int, schedule: str, comm: Optional[BoundaryComm],
                 hooks=None, objective=None, moe=None, vocab=None):
        if schedule in SPLIT_BACKWARD and getattr(module, "recompute", False):
            raise ConfigError(f"train.schedule={schedule} does not combine with train.recompute=true: "
                              "use train.schedule=1f1b for activation recompute")
        if moe is not None:
            from npu_train.pipeline.moeaux import check_aux_schedule

            check_aux_schedule(moe.weight, schedule)
        self.moe = moe
        self.vocab = vocab
        self.module = module
        self.backend = backend
        self.P = num_stages
        self.s = stage
        self.schedule = schedule
        self.comm = comm
        C = chunks_per_card(schedule)
        V = C * num_stages
        self.chunks = []
        for c in range(C):
            v = virtual_stage(schedule, num_stages, stage, c)
            cc = comm if C == 1 or comm is None else comm.chunk(c)
            self.chunks.append(_Chunk(c, v == 0, v == V - 1, cc, None if C == 1 else c))
        self.first = any(ch.first for ch in self.chunks)  # takes the input ids
        self.last = any(ch.last for ch in self.chunks)  # computes the loss
        self.trace: Optional[list] = None
        #: the clock ``compute_cpu_s`` is read with (None: not reported); :func:`work_clock`
        self.cpu_clock = work_clock(getattr(backend, "kind", ""))
        self.hooks = hooks
        self.objective = objective if objective is not None else SftObjective()

    def run_step(self, step: int, inputs: Optional[list[torch.Tensor]], labels: Optional[list[torch.Tensor]],
                 total_tokens: Optional[int] = None, early: Optional[tuple] = None,
                 positions: Optional[list] = None) -> dict:
        """Forward and backward all micro-batches of ``step``; gradients accumulate in ``.grad``.

        ``inputs`` (first stage): M int64 CPU ``[micro_batch, seq_len]``; ``labels`` (last): M targets of the
        objective (SFT: int64 CPU ``[micro_batch, seq_len]``; DPO: :class:`~npu_train.pipeline.objective.PairTargets`). ``positions``
        (every stage, packed rows; None: unpacked): M int64 CPU ``[micro_batch, seq_len]`` or None entries,
        given to the module (``StageModule.forward(positions=)``). ``total_tokens``:
        the loss divisor in the objective's units (SFT target tokens, DPO pairs; all replicas; None: from
        ``labels``). ``early=(params, done)``: after the last ``B``
        run the W groups of ``params``, call ``done()``, then the other ``W`` (the tied head gradient leaves
        early; same gradients). Returns ``{"loss_sum" (nats), "n_tokens", "n_units" (the objective's divisor
        units here), "stats" (the objective's statistic sums), "compute_s", "compute_cpu_s" (the compute's CPU
        seconds by :func:`work_clock`, None on an accelerator), "wait_s", "send_s", "deferred_opt_s"}``. Raises ValueError for a step without target tokens."""
        M = len(inputs) if inputs is not None else len(labels) if labels is not None else None
        if M is None:
            raise ValueError("a middle stage needs the number of micro-batches: pass inputs=None, labels=None via run_middle")
        return self._run(step, M, inputs, labels, total_tokens, early, positions)

    def run_middle(self, step: int, num_micro: int, positions: Optional[list] = None) -> dict:
        """:meth:`run_step` for a stage that is neither first nor last."""
        return self._run(step, num_micro, None, None, positions=positions)

    def module_kwargs(self, positions: Optional[list], m: int, ch: Optional[_Chunk] = None) -> dict:
        """``{"positions": [b, S] on the card}`` for micro-batch ``m`` of packed rows (and ``chunk`` on a
        two-chunk card), else ``{}``."""
        kw = {} if ch is None or ch.arg is None else {"chunk": ch.arg}
        if positions is None or positions[m] is None:
            return kw
        kw["positions"] = self.backend.upload(positions[m])
        return kw

    @torch.no_grad()
    def run_eval(self, step: int, num_micro: int, inputs: Optional[list[torch.Tensor]],
                 labels: Optional[list[torch.Tensor]], positions: Optional[list] = None) -> dict:
        """Forward-only pass over held-out micro-batches (ids + :data:`EVAL_MICRO_BASE`); ``{"loss_sum",
        "n_tokens", "n_units", "stats"}`` (last stage; zeros elsewhere)."""
        obj = self.objective
        fused = getattr(self.module, "fused_head", False)  # training's head arithmetic: DPO values equal the pass's
        loss_sum, n_tok, n_units, stats = 0.0, 0, 0, [0.0] * len(obj.stats)
        if self.vocab is not None:  # each micro-batch through the card's chunks, then the joint V(m)
            for m in range(num_micro):
                outs = [self._forward_only_step(step, EVAL_MICRO_BASE + m, ch, inputs, positions, m)
                        for ch in self.chunks]
                x = next((o for o in outs if o is not None), None)
                self.vocab.post_x(m, x, tuple(labels[m].shape))
                ls = self.vocab.run(m, labels[m], 1.0, train=False)
                if self.last:
                    loss_sum += ls
                    n_tok += obj.tokens(labels[m])
                    n_units += obj.units(labels[m])
            self.vocab.finish()
            _flush(self)
            return {"loss_sum": loss_sum, "n_tokens": n_tok, "n_units": n_units, "stats": stats}
        for m, ch in self._forward_only(num_micro):  # the last chunk's outputs: the loss
            out = self._forward_only_step(step, EVAL_MICRO_BASE + m, ch, inputs, positions, m)
            if out is not None:
                ls, st = obj.loss_sum(out, labels[m], self.backend, fused)
                loss_sum += float(ls)
                n_tok += obj.tokens(labels[m])
                n_units += obj.units(labels[m])
                stats = [a + b for a, b in zip(stats, st)]
        _flush(self)
        return {"loss_sum": loss_sum, "n_tokens": n_tok, "n_units": n_units, "stats": stats}

    @torch.no_grad()
    def run_reference(self, num_micro: int, inputs: Optional[list], labels: Optional[list],
                      positions: Optional[list] = None) -> Optional[list]:
        """Forward-only pass of the DPO reference model (the caller sets the weights: the initial ones, or
        LoRA adapters disabled) over ``num_micro`` micro-batches (ids + :data:`REF_MICRO_BASE`, step tag 0).
        ``labels``: shifted int64 ``[b, seq_len]`` per micro-batch (last stage). Returns, on the last stage,
        the rows' summed completion log-probabilities: one float64 CPU ``[b]`` per micro-batch (else None)."""
        out_rows = [] if self.last else None
        fused = getattr(self.module, "fused_head", False)  # training's head arithmetic: the policy's own values
        for m, ch in self._forward_only(num_micro):
            out = self._forward_only_step(0, REF_MICRO_BASE + m, ch, inputs, positions, m)
            if out is not None:
                out_rows.append(self.objective.logps(out, labels[m], self.backend, fused).double().cpu())
        _flush(self)
        return out_rows

    def _forward_only(self, num_micro: int):
        """``(micro-batch, chunk)`` in a forward-only pass's order: each micro-batch through the card's chunks
        in turn (deadlock-free: every card's chunks in virtual order)."""
        return [(m, ch) for m in range(num_micro) for ch in self.chunks]

    def _forward_only_step(self, step: int, tag: int, ch: _Chunk, inputs, positions, m: int):
        """One forward-only pass of micro-batch ``m`` (message id ``tag``) through chunk ``ch``: the output of
        the loss chunk, else None (sent on)."""
        x = self.backend.upload(inputs[m]) if ch.first else ch.comm.recv_act(step, tag)
        out = self.module(x, **self.module_kwargs(positions, m, ch))
        if ch.last:
            return out
        ch.comm.send_act(step, tag, out)
        return None

    def _synced_clock(self) -> float:
        self.backend.synchronize()
        return time.perf_counter()

    def _run(self, step, M, inputs, labels, total_tokens=None, early=None, positions=None) -> dict:
        local_tokens = local_units = 0
        if self.last:
            local_tokens = sum(self.objective.tokens(l) for l in labels)
            local_units = sum(self.objective.units(l) for l in labels)
            if total_tokens is None:
                total_tokens = local_units
            if total_tokens == 0:
                raise ValueError(f"step {step}: no target tokens in the step's micro-batches")
        if self.moe is not None:
            self.moe.begin_step()
        run = _StepRun(self, step, M, inputs, labels, total_tokens, early, positions)
        actions = build_schedule(self.schedule, self.P, M, self.s, vocab=self.vocab is not None)
        for i, a in enumerate(actions):
            run.next = actions[i + 1] if i + 1 < len(actions) else None
            if a.kind == "F":
                run.forward(a.micro, a.chunk)
            elif a.kind == "B":
                run.backward(a.micro, a.chunk)
            elif a.kind == "W":
                run.weight(a.micro, a.chunk)
            else:
                run.vocab(a.micro)
        return run.end(local_tokens, local_units)


def _flush(runner: "StageRunner") -> None:
    """The end of a pass: every chunk's comm's overlapped copies done (``flush``, where the comm has one)."""
    for ch in runner.chunks:
        flush = getattr(ch.comm, "flush", None)
        if flush is not None:
            flush()


class _StepRun:
    """One step's actions on the saved micro-batch graphs, with their seconds."""

    def __init__(self, runner: StageRunner, step: int, M: int, inputs, labels, total_tokens, early, positions=None):
        self.r, self.step, self.inputs, self.labels, self.total_tokens = runner, step, inputs, labels, total_tokens
        self.positions = positions
        self.early = early
        self.next = None  # the action after the current one (fetch_next)
        self.saved: dict[int, tuple] = {}
        self.M = M
        if runner.vocab is not None and not runner.last:  # the first hidden state's receive, posted ahead
            runner.vocab.post_x(0, None, tuple(labels[0].shape))
        self.split = runner.schedule in SPLIT_BACKWARD
        self.pending: dict = {}  # micro -> WeightGradWork (zb: between B and W)
        self.params = [p for p in runner.module.parameters() if p.requires_grad] if self.split else []
        self.loss_sum = 0.0
        self.stats = [0.0] * len(runner.objective.stats)
        self.compute = self.wait = self.send = self.deferred = 0.0
        self.cpu = runner.cpu_clock or (lambda: 0.0)
        self.compute_cpu = 0.0  # CPU seconds of the compute intervals (0 without a cpu clock)
        self.backwards_left = M * len(runner.chunks)
        self.tr = runner.trace
        # tracing on an accelerator: the device is synchronized at every timestamp, so an action's
        # interval holds its kernels, not only their launch (CPU: synchronize() is a no-op)
        self.clock = time.perf_counter if self.tr is None else runner._synced_clock
        #: the module's heap-guard check (``StageModule.layer_check``), also run at every action's start
        self.check = getattr(runner.module, "layer_check", None) or (lambda: None)

    def fetch_next(self) -> None:
        """Before this action computes: the next action's input from another card, copied onto the card ahead if
        it has arrived (a comm with ``fetch_act`` / ``fetch_grad``: the copy thread of
        :mod:`npu_train.runtime.copies`; anything else: nothing)."""
        a, r = self.next, self.r
        if a is None or a.kind not in ("F", "B"):
            return
        ch = r.chunks[a.chunk]
        if a.kind == "F" and not ch.first:
            fetch = getattr(ch.comm, "fetch_act", None)
        elif a.kind == "B" and not ch.last:
            fetch = getattr(ch.comm, "fetch_grad", None)
        else:
            return
        if fetch is not None:
            fetch(self.step, a.micro)

    def _account(self, kind: str, m: int, t0: float, t1: float, t2: float, t3: float) -> None:
        self.wait += t1 - t0
        self.compute += t2 - t1
        self.send += t3 - t2
        if self.tr is not None:
            self.tr.append((kind, m, t0, t1, t2, t3))

    def forward(self, m: int, c: int = 0) -> None:
        r, clock = self.r, self.clock
        self.check()
        ch = r.chunks[c]
        t0 = clock()
        x, up = (r.backend.upload(self.inputs[m]), None) if ch.first else self._recv_act(ch, m)
        self.fetch_next()
        t1 = clock()
        k1 = self.cpu()
        # split backward past the first stage: the graph cut per layer (StageModule.forward cuts=)
        cuts = [] if self.split and not ch.first else None
        kw = r.module_kwargs(self.positions, m, ch)
        if r.moe is not None:
            r.moe.start()
        out = r.module(x, **kw) if cuts is None else r.module(x, cuts=cuts, **kw)
        meta = r.moe.finish(m, up) if r.moe is not None else None
        if ch.last and r.vocab is not None:  # the final norm's output: its broadcast to every card starts now
            self.saved[(m, c)] = (x, out, cuts)
            r.vocab.post_x(m, out.detach(), tuple(out.shape[:2]))
            self.compute_cpu += self.cpu() - k1
            t2 = t3 = clock()
        elif ch.last:
            ls, st = r.objective.loss_sum(out, self.labels[m], r.backend, getattr(r.module, "fused_head", False))
            self.loss_sum += float(ls.detach())
            self.stats = [a + b for a, b in zip(self.stats, st)]
            aux = r.moe.loss_term(m) if r.moe is not None else None  # this stage's routers' share of the aux loss
            self.saved[(m, c)] = (x, ls / self.total_tokens if aux is None else ls / self.total_tokens + aux, cuts)
            self.compute_cpu += self.cpu() - k1
            t2 = t3 = clock()
        else:
            self.saved[(m, c)] = (x, out, cuts)
            self.compute_cpu += self.cpu() - k1
            t2 = clock()
            if meta is None:
                ch.comm.send_act(self.step, m, out.detach())
            else:
                ch.comm.send_act(self.step, m, out.detach(), meta=meta)
            t3 = clock()
        self._account("F", m, t0, t1, t2, t3)
        hooks = r.hooks
        # (every schedule starts with F0 on the first stage)
        if m == 0 and ch.first and hooks is not None and hooks.has_first_forward_work:
            u0 = clock()
            hooks.first_forward_sent()
            u1 = clock()
            self.deferred += u1 - u0
            if self.tr is not None:
                self.tr.append(("U", -1, u0, u0, u1, u1))

    def _recv_act(self, ch, m: int) -> tuple:
        """``(activation requiring grad, the header's router statistics or None)`` of micro-batch ``m``."""
        moe = self.r.moe
        if moe is not None and moe.on:
            x, up = ch.comm.recv_act(self.step, m, with_meta=True)
        else:
            x, up = ch.comm.recv_act(self.step, m), None
        return x.requires_grad_(True), up

    def vocab(self, m: int) -> None:
        """``V(m)``: this card's share of the output layer for micro-batch ``m`` (:mod:`npu_train.pipeline.vocab`);
        the head card keeps the summed input gradient for its ``B(m)`` and the micro-batch's loss."""
        r, clock = self.r, self.clock
        t0 = clock()
        k1 = self.cpu()
        ls = r.vocab.run(m, self.labels[m], self.total_tokens)
        if r.last:
            self.loss_sum += ls
        elif m + 1 < self.M:  # the next hidden state's receive, posted ahead: it travels while this card works
            r.vocab.post_x(m + 1, None, tuple(self.labels[m + 1].shape))
        self.compute_cpu += self.cpu() - k1
        t1 = clock()
        # its waits (the hidden state, the statistics' collectives) first: idle, as a neighbour's wait is
        self._account("V", m, t0, min(t1, t0 + r.vocab.last_wait), t1, t1)

    def _recv_grad(self, ch, m: int) -> tuple:
        """``(output gradient, this stage's aux-loss root or None)`` of micro-batch ``m`` (last stage: None;
        vocabulary-parallel: ``V(m)``'s summed input gradient, host, in the compute dtype)."""
        moe = self.r.moe
        if ch.last and self.r.vocab is not None:
            return self.r.vocab.take_dx(m), None
        if ch.last:
            return None, None
        if moe is None or not moe.on:
            return ch.comm.recv_grad(self.step, m), None
        g, meta = ch.comm.recv_grad(self.step, m, with_meta=True)
        return g, moe.backward_root(m, meta)

    def backward(self, m: int, c: int = 0) -> None:
        r, clock = self.r, self.clock
        self.check()
        ch = r.chunks[c]
        x, out, cuts = self.saved.pop((m, c)) if not self.split else self.saved[(m, c)]
        t0 = clock()
        g, root = self._recv_grad(ch, m)
        if ch.last and g is not None:  # V(m)'s gradient: onto the card in the output's dtype
            g = r.backend.upload(g.to(out.dtype))
        self.fetch_next()
        t1 = clock()
        k1 = self.cpu()
        if self.split and not ch.first:
            dx, self.pending[(m, c)] = backward_input(out, g, x, self.params, cuts=cuts)
        else:  # full backward (first stage of zb: nothing waits for an input gradient)
            if root is None:
                out.backward(g)
            else:  # the routers' share of the load-balancing loss joins the output gradient
                torch.autograd.backward([out, root], [g, torch.ones_like(root)])
            dx = x.grad if not ch.first else None
            if self.split:
                self.pending[(m, c)] = None
        self.compute_cpu += self.cpu() - k1
        t2 = clock()
        if not ch.first:
            meta = r.moe.grad_meta(m) if r.moe is not None and r.moe.on else None
            if meta is None:
                ch.comm.send_grad(self.step, m, dx)
            else:
                ch.comm.send_grad(self.step, m, dx, meta=meta)
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
        k1 = self.cpu()
        for work in self.pending.values():
            if work is not None:
                work.run(only=params)
        self.compute_cpu += self.cpu() - k1
        t1 = clock()
        done()
        t2 = clock()
        self.compute += t1 - t0
        self.send += t2 - t1
        if self.tr is not None:
            self.tr.append(("E", -1, t0, t0, t1, t2))
        self.early = None

    def weight(self, m: int, c: int = 0) -> None:
        """``W``: the weight gradients deferred by micro-batch ``m``'s ``B`` on chunk ``c``."""
        self.check()
        self.fetch_next()
        t0 = self.clock()
        k1 = self.cpu()
        work = self.pending.pop((m, c))
        del self.saved[(m, c)]
        if work is not None:
            work.run()
        self.compute_cpu += self.cpu() - k1
        t1 = self.clock()
        self.compute += t1 - t0
        if self.tr is not None:
            self.tr.append(("W", m, t0, t0, t1, t1))

    def end(self, local_tokens: int, local_units: int) -> dict:
        assert not self.saved and not self.pending, \
            f"schedule left micro-batches without backward: {sorted(self.saved)} {sorted(self.pending)}"
        if self.r.vocab is not None:
            self.r.vocab.finish()
        if self.early is not None:
            self.early[1]()
        _flush(self.r)
        self.r.backend.synchronize()
        moe = self.r.moe
        extra = {} if moe is None else {"moe_aux_sum": moe.aux_sum, "expert_load": moe.expert_load()}
        return {"loss_sum": self.loss_sum, "n_tokens": local_tokens, "n_units": local_units, "stats": self.stats,
                **extra,
                "compute_s": self.compute,
                # CPU seconds of the same intervals by StageRunner.cpu_clock; None without one
                "compute_cpu_s": self.compute_cpu if self.r.cpu_clock is not None else None,
                "wait_s": self.wait, "send_s": self.send, "deferred_opt_s": self.deferred}
