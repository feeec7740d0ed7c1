"""The train loop of one card process: :class:`StageTrainer` (:meth:`~StageTrainer.train_step` is one
optimizer step: data, schedule, tied and replica sums, one world all-reduce, non-finite check, clip,
LR, AdamW, metrics, checkpoint). The step in detail: docs/design.md §17; the process around it:
:mod:`npu_train.runtime.worker`.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch

from npu_train.pipeline.objective import PairTargets
from npu_train.runtime.spec import WorkerSpec
from npu_train.runtime.stagebuild import build_stage, compute_dtype, resume_stage, sparse_embed_grad_for
from npu_train.runtime.tied import TiedGradExchange, looked_up_rows

log = logging.getLogger("npu_train.worker")


#: gloo point-to-point tags of the output layer's rows sent to the head card at a save (vocabulary parallelism;
#: runtime/tied.py uses 71 and 72)
VOCAB_SAVE_TAG = 80


class NonFiniteError(RuntimeError):
    """A nan/inf loss or grad norm with ``train.nonfinite=stop``, naming the step, stages and fix."""


@dataclass
class StepTotals:
    """One step's values after the all-reduce (same on every rank); ``tied_s`` s from ``tied_start``
    (perf_counter)."""

    grad_norm: float
    loss: float
    tokens: int
    interrupted: bool
    bad_ranks: list
    tied_s: float
    tied_start: float
    #: the objective's divisor units (SFT: target tokens, DPO: pairs) and per-step metrics (DPO rewards)
    units: int = 0
    objective_metrics: Optional[dict] = None
    #: mixtures of experts: the load-balancing loss, mean over the step's micro-batches (None: off or dense)
    aux_loss: Optional[float] = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.grad_norm) and math.isfinite(self.loss)


#: the phase families a card's peak memory is reported by (``mem_phases``), from the phase names :meth:`StageTrainer.enter` sends
PHASE_FAMILIES = (("step ", "steps"), ("evaluation", "eval"), ("DPO reference", "reference"),
                  ("checkpoint save", "save"), ("resume", "resume"), ("shutdown", "shutdown"))


def phase_family(phase: str) -> str:
    """The family of phase name ``phase`` (:data:`PHASE_FAMILIES`; every start-up phase: ``"load"``)."""
    return next((fam for prefix, fam in PHASE_FAMILIES if phase.startswith(prefix)), "load")


class StageTrainer:
    """Trains one pipeline stage for ``spec.train.steps`` steps: :meth:`setup`, :meth:`run`, :meth:`close`.
    ``ctrl``: the coordinator channel; ``fault``: :mod:`npu_train.runtime.faults` hook or None;
    ``phase``: the current phase, reported when an exception escapes."""

    def __init__(self, spec: WorkerSpec, ctx, ctrl, fault=None):
        self.spec, self.ctx, self.ctrl, self.fault = spec, ctx, ctrl, fault
        self.phase = "start"
        # rank: global rank; stage / replica / P: this pipeline position (ParallelLayout)
        self.rank, self.stage, self.replica, self.P = spec.rank, spec.stage_index, spec.replica, spec.num_stages
        self.dp, self.zero = spec.dp, spec.zero
        self.tr = spec.train
        # first: holds the embedding (virtual stage 0), last: the head and loss (ZB-V: both on card 0)
        from npu_train.pipeline.schedule import card_of, chunks_per_card

        head_card = card_of(self.tr.schedule, self.P, self.P * chunks_per_card(self.tr.schedule) - 1)[0]
        self.first, self.last = self.stage == 0, self.stage == head_card
        self.head_card = head_card
        self.comm = None
        self.tied_group = None
        self.tied = None  # TiedGradExchange on the first and last stage of a tied pair
        self.tied_name = "model.embed_tokens.weight" if self.first else "lm_head.weight"
        self.stage_group = None
        #: vocabulary parallelism (train.vocab): the pipeline's exchange (pipeline/vocab.py) and this card's rows
        self.vocab = bool(getattr(self.tr, "vocab", False))
        self.vocab_ex = None
        #: phase family -> this card's peak memory in it, bytes (the backend's measure: cpu RssAnon + RssShmem)
        self.mem_phases: dict[str, int] = {}
        self.heap_guard = None  # a cpu card's HeapGuard (setup)

    def grad_buf(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s step gradient buffer, to change in place."""
        from npu_train.optim.adamw import grad_or_zeros

        return self.opt.grad_buffer(name) if name in self.opt.params else grad_or_zeros(self.params[name])

    def enter(self, phase: str) -> None:
        """Record ``phase`` and tell the coordinator (it names the phase if the process dies there); a new phase
        family closes the last one's peak (:meth:`fold_peak`)."""
        if getattr(self, "backend", None) is not None and phase_family(phase) != phase_family(self.phase):
            self.fold_peak(reset=True)
        self.phase = phase
        self.ctrl.send("phase", phase=phase)

    def fold_peak(self, reset: bool) -> int:
        """Fold the backend's peak since its last reset into :attr:`mem_phases` under the current phase's
        family (then restart it when ``reset``); returns that peak, bytes."""
        pk = int(self.backend.max_memory_allocated())
        fam = phase_family(self.phase)
        self.mem_phases[fam] = max(self.mem_phases.get(fam, 0), pk)
        if reset:
            self.backend.reset_peak_memory()
        return pk

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Device, model, optimizer, gloo group, links, resume, data. Raises BackendUnavailableError,
        TransportError or gloo errors."""
        from npu_train.backends import make_backend

        spec, card = self.spec, self.spec.card
        self.enter("device setup")
        self.backend = make_backend(card, **spec.runtime.backend_kwargs(card.kind))
        self.backend.setup()
        self.enter("model load")
        self._load()
        self.enter("rendezvous")
        self._rendezvous()
        self.start = int(spec.start_step)
        if spec.resume_dir:
            from npu_train.hostmem import release_freed_memory

            self._resume()
            release_freed_memory()
        else:
            torch.manual_seed(self.tr.seed + self.stage)
        self._load_data()
        self.heap_guard = self._heap_guard()
        self.peak = self._peak_flops()
        self.ctrl.send("ready", params=sum(p.numel() for p in self.params.values()))

    def _load(self) -> None:
        """The stage's module and its optimizer, then what the load freed returned to the OS (no step reuses it).
        The load's peak (:meth:`~npu_train.planner.memory.MemoryModel.load_peak`: the weights, the optimizer's state
        and the initial values it was made from, at once) lasts milliseconds, from the optimizer's moments to ``del
        masters``: it is sampled into the backend's peak there (a cpu card's peak is sampled at backend calls; a
        sampler from outside every 0.1 s misses it)."""
        from npu_train.hostmem import release_freed_memory

        masters = self._load_model()
        self._make_optimizer(masters)
        self.backend.memory_allocated()  # the load's peak, into max_memory_allocated
        del masters
        release_freed_memory()

    def _heap_guard(self):
        """A cpu card keeping freed memory with a planned heap cap (``StageInfo.heap_cap_bytes``): its
        :class:`~npu_train.hostmem.HeapGuard`, armed and checked at every decoder layer; else None."""
        spec = self.spec
        cap = spec.stage.heap_cap_bytes
        if cap is None or spec.card.kind != "cpu" or not spec.runtime.keep_host_memory or self.tr.recompute:
            return None
        from npu_train.hostmem import HeapGuard, heap_guard_available

        if not heap_guard_available():
            log.warning("heap guard: not available (needs glibc >= 2.33); the plan's heap cap is not kept")
            return None
        guard = HeapGuard.create(cap, spec.stage.heap_slack_bytes, spec.stage.heap_limit_bytes)
        self.module.layer_check = guard.check
        for p in self.params.values():  # the fresh gradients added into .grad and freed, one tensor at a time
            p.register_post_accumulate_grad_hook(guard.check)
        return guard

    def _peak_flops(self):
        """This card's peak FLOP/s in the compute dtype (:class:`~npu_train.metrics.mfu.Peak`): the data sheet's
        for RNGD and known GPUs, else a matmul measured here (every CPU card, at its own thread count)."""
        from npu_train.metrics.mfu import Peak, measure_matmul_flops, spec_peak_flops

        kind, dt = self.spec.card.kind, self.tr.dtype
        name = torch.cuda.get_device_name(self.backend.device()) if kind == "cuda" else ""
        peak = spec_peak_flops(kind, dt, name)
        if peak is None:
            self.enter("peak FLOP/s (a matmul)")
            f = measure_matmul_flops(self.backend.device(), compute_dtype(dt), self.backend.synchronize)
            peak = Peak(f, f"measured matmul {f / 1e9:.1f} GFLOP/s {dt} at {torch.get_num_threads()} thread(s)")
        return peak

    def _load_model(self) -> dict:
        """The stage's module on the card (compiled/warmed up where configured); returns the fp32 masters."""
        spec, tr, backend = self.spec, self.tr, self.backend
        self.module, masters = build_stage(spec, backend, compute_dtype(tr.dtype))
        lora = tr.lora_spec()
        if lora is not None:  # frozen base in the compute dtype; only the adapters have masters and moments
            from npu_train.model.lora import apply_lora, is_router

            routers = {n: t for n, t in masters.items() if is_router(n)} if lora.train_router else None
            del masters
            with backend.alloc_lock():
                masters = apply_lora(self.module, lora, tr.seed, base=routers)
            track = getattr(backend, "track", None)
            for n, p in self.module.named_parameters():
                if p.requires_grad and track is not None:
                    track(p)
        self.params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
        self.module.sparse_embed_grad = self.sparse_embed = sparse_embed_grad_for(spec.card.kind, self.params)
        backend.prepare_module(self.module)  # furiosa: whole-layer compiled graphs when configured
        if self.fault is not None:
            self.fault.install(self.module)
            self.fault("load")
        self.compile_s = 0.0
        if spec.runtime.warmup and spec.card.kind == "furiosa":  # before the optimizer exists: no state to touch
            from npu_train.runtime.warmup import warm_up_stage

            self.enter("warm-up (graph compilation)")
            dt, hid = compute_dtype(tr.dtype), int(spec.model_cfg["hidden_size"])
            seq_len = spec.slot_bytes // (tr.micro_batch * hid * dt.itemsize)  # slot = b x S x H x element
            self.compile_s = warm_up_stage(self.module, backend, first=self.first, last=self.last,
                                           micro_batch=tr.micro_batch, seq_len=seq_len, hidden_size=hid,
                                           dtype=dt, betas=(tr.beta1, tr.beta2), eps=tr.eps)
        return masters

    def _make_optimizer(self, masters: dict) -> None:
        """The optimizer over the parameters this replica owns, and the stage's step hooks."""
        from npu_train.optim.adamw import StageOptimizer
        from npu_train.optim.hooks import StepHooks
        from npu_train.runtime.overlap import install_waits, layer_groups
        from npu_train.runtime.replicas import zero_owners

        tr = self.tr
        # ZeRO-1: this replica keeps master + moments only of the parameters it owns
        self.owners = zero_owners({n: p.numel() for n, p in self.params.items()}, self.dp) if self.zero else None
        self.owned = {n: p for n, p in self.params.items() if self.owners is None or self.owners[n] == self.replica}
        self.hooks = StepHooks()
        self.opt = StageOptimizer(self.owned, masters, list(self.spec.resident_names),
                                  self.backend, lr=tr.lr, betas=(tr.beta1, tr.beta2), eps=tr.eps,
                                  weight_decay=tr.weight_decay, fp32_grad_accum=tr.grad_accum == "fp32",
                                  layers=layer_groups(self.owned), overlap=tr.offload_overlap,
                                  delayed=tr.offload_update == "delayed", hooks=self.hooks,
                                  # the first stage's embedding: the next step's rows first (optim.rowsfirst);
                                  # not on a single stage (a tied head reads every row)
                                  rows_first="model.embed_tokens.weight" if self.first and not self.last
                                  and self.dp == 1 else None)
        if tr.offload_overlap:  # the forward through an offloaded layer waits for its host update only
            install_waits(self.module, self.opt, list(self.opt.host_groups))
        if self.sparse_embed:  # after the optimizer's rest of the rows-first update
            self.hooks.on_first_forward_sent(self.zero_embed_grad)

    def _rendezvous(self) -> None:
        """The gloo group and its subgroups (replicas of a stage, the tied pair), the boundary links."""
        import torch.distributed as dist

        from npu_train.runtime.links import LinkComm

        from npu_train.runtime.jobstore import join_store

        spec, lay = self.spec, self.spec.layout
        # the launcher hosts the store on a port it holds (runtime/jobstore.py): no port race with other jobs
        timeout = float(spec.runtime.collective_timeout_s)
        self.store = join_store(spec.dist_init, timeout)
        dist.init_process_group("gloo", store=self.store, rank=self.rank, world_size=lay.world,
                                timeout=timedelta(seconds=timeout))
        # every rank creates every subgroup, in the same order (a torch.distributed requirement)
        self.stage_ranks = lay.stage_group(self.stage)
        if self.dp > 1:
            for ranks in lay.stage_groups():
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self.stage_group = g
        # tied embeddings are trained (and their gradients summed) only in full fine-tuning
        self.tied_pair = bool(spec.model_cfg["tie_word_embeddings"]) and self.head_card != 0 and self.tr.mode == "full"
        if self.tied_pair:
            for ranks in lay.tied_groups():
                g = dist.new_group(ranks)
                if self.rank in ranks:
                    self.tied_group = g
                    if self.first or self.last:
                        shape = tuple(self.params[self.tied_name].shape)
                        self.tied = TiedGradExchange(self.first, ranks[-1] if self.first else ranks[0], g, shape,
                                                     self.backend)
        if self.vocab:  # one group per replica: its pipeline's cards (pipeline/vocab.py's collectives)
            from npu_train.pipeline.vocab import GlooExchange

            shm = self._vocab_shm()
            for k in range(self.dp):
                ranks = [lay.rank(k, s) for s in range(self.P)]
                g, gx = dist.new_group(ranks), dist.new_group(ranks)  # gx: the hidden states' broadcasts
                if self.rank in ranks:
                    if shm:  # the tensors through /dev/shm, the notifications and statistics through g / gx
                        from npu_train.pipeline.vocabshm import ShmExchange, reduce_slots

                        self.vocab_ex = ShmExchange(g, lay.rank(k, self.head_card), gx, spec.job_id, f"vx{k}",
                                                    spec.slot_bytes, reduce_slots(self.tr.schedule, self.P,
                                                                                  self.tr.accum, self.head_card))
                    else:
                        self.vocab_ex = GlooExchange(g, lay.rank(k, self.head_card), xgroup=gx)
            log.info("vocabulary exchange: %s", "shared memory (runtime.vocab_exchange=shm)" if shm else
                     "gloo" + (" (runtime.vocab_exchange=shm: not every card on one host with runtime.transport=shm)"
                               if getattr(spec.runtime, "vocab_exchange", "gloo") == "shm" else ""))
        if self.P > 1:
            self.comm = LinkComm(spec, self.ctx, self.backend, overlap=spec.runtime.overlap_copies, store=self.store)
            if self.comm.mailbox.addr != spec.inbox[self.rank]:  # a port picked at the bind: for job.json
                self.ctrl.send("inbox", addr=self.comm.mailbox.addr)
            dist.barrier()  # every ring exists before anyone receives

    def _vocab_shm(self) -> bool:
        """Whether the vocabulary exchange goes through shared memory: :func:`~npu_train.pipeline.hosts.
        vocab_exchange_shm` of ``runtime.vocab_exchange`` and every boundary of the job (every card on this host
        with ``runtime.transport=shm``; else gloo), the launcher's and the plan's rule too."""
        from npu_train.pipeline.hosts import vocab_exchange_shm

        spec = self.spec
        return vocab_exchange_shm(getattr(spec.runtime, "vocab_exchange", "gloo"),
                                  [spec.boundary_mode(b) for b in range(spec.world_size - 1)])

    def _resume(self) -> None:
        """Masters, moments, weights and RNG from ``spec.resume_dir``, one tensor at a time."""
        from npu_train.checkpoint.store import CheckpointReader

        self.enter("resume")
        from npu_train.runtime.stagebuild import vocab_rows_of

        resume_stage(CheckpointReader(self.spec.resume_dir), self.opt, self.params, self.owned, self.backend,
                     self.stage, rows=vocab_rows_of(self.spec), vocab_size=int(self.spec.model_cfg["vocab_size"]))

    def _load_data(self) -> None:
        """The packed data, the samplers (all replicas', for the loss divisor), the runner, the evaluation batches."""
        from npu_train.data.batches import micro_batch_positions, micro_batch_tensors
        from npu_train.data.packfile import load_packed
        from npu_train.data.sampler import make_sampler
        from npu_train.pipeline.objective import make_objective
        from npu_train.pipeline.stage import StageRunner

        tr = self.tr
        self.data = load_packed(self.spec.data_file)
        self.objective = make_objective(tr)
        self.pairs = self.objective.name == "dpo"
        self.ref_train = self.ref_val = None  # DPO: reference log-probabilities per row (last stage)
        self.micro_batch_tensors = micro_batch_tensors
        # packed rows: every stage looks up its micro-batches' positions itself (same sampler indices)
        self.micro_batch_positions = micro_batch_positions if self.data.train_positions is not None else None
        # one sampler per replica: this replica's share, and (last stage) the others' for the loss divisor
        self.samplers = [make_sampler(self.data.train.shape[0], tr.micro_batch, tr.accum, tr.seed,
                                      dp_rank=k, dp_size=self.dp, pairs=self.pairs) for k in range(self.dp)]
        self.sampler = self.samplers[self.replica]
        self.runner = StageRunner(self.module, self.backend, self.P, self.stage, tr.schedule, self.comm,
                                  hooks=self.hooks, objective=self.objective, moe=self._moe_routing(),
                                  vocab=self._vocab_work())
        self._held_out(tr)

    def _vocab_work(self):
        """This card's :class:`~npu_train.pipeline.vocab.VocabWork` under vocabulary parallelism, else None."""
        if not self.vocab:
            return None
        from npu_train.pipeline.vocab import VocabWork
        from npu_train.runtime.stagebuild import vocab_rows_of

        wait = (lambda: self.opt.wait_layer("head")) if "head" in self.opt.host_groups else None
        return VocabWork(self.module.vocab_weight(), vocab_rows_of(self.spec)[0], self.vocab_ex,
                         self.stage == self.head_card, before=wait)

    def _moe_routing(self):
        """A mixture-of-experts stage's :class:`~npu_train.pipeline.moeaux.StageRouting` (router statistics over
        the step's ``accum x dp`` micro-batches, the load-balancing loss weight ``train.moe_aux_loss``), else None."""
        rec = getattr(self.module, "router_recorder", None)
        if rec is None:
            return None
        from npu_train.pipeline.moeaux import StageRouting

        return StageRouting(rec, self.module.cfg.num_experts, self.tr.moe_aux_loss, self.tr.accum * self.dp,
                            self.last)

    def _held_out(self, tr) -> None:
        """The held-out micro-batches (:func:`~npu_train.runtime.spec.eval_micro_batches`): the first
        ``eval_batches`` of the validation split, or its few rows padded to one micro-batch (rows repeated,
        their targets ignored)."""
        from npu_train.model.llama import IGNORE_INDEX
        from npu_train.runtime.spec import eval_micro_batches

        mb = tr.micro_batch
        real = eval_micro_batches(self.data.val.shape[0], mb, int(tr.eval_batches or 0), self.pairs)
        self.n_eval = len(real)
        rows = [torch.arange(m * mb, (m + 1) * mb) % max(1, self.data.val.shape[0]) for m in range(self.n_eval)]
        self.eval_batches = []
        for idx, n in zip(rows, real):
            x, y = self.micro_batch_tensors(self.data, idx, split="val")
            self.eval_batches.append((x, y.index_fill(0, torch.arange(n, mb), IGNORE_INDEX) if n < mb else y))
        self.eval_positions = None if self.micro_batch_positions is None else [
            self.micro_batch_positions(self.data, idx, split="val") for idx in rows]

    # ------------------------------------------------------------------ one step
    def global_tokens(self, step: int) -> int:
        """The loss divisor of step ``step``'s global batch (all replicas), from the samplers, no collective:
        its target tokens (SFT) or pairs (DPO: fixed, ``dp x accum x micro_batch / 2``)."""
        if self.pairs:
            return self.dp * self.tr.accum * self.tr.micro_batch // 2
        n = 0
        for smp in self.samplers:
            for i in smp.micro_batches_for_step(step):
                n += int((self.micro_batch_tensors(self.data, i)[1] != -100).sum())
        return n

    def train_step(self, step: int) -> dict:
        """Run 0-based step ``step``; sends its metrics. Returns ``{"loss" (nats/target token), "grad_norm",
        "lr", "tokens", "interrupted"}``."""
        from npu_train.optim.lr import lr_at

        tr = self.tr
        # phases are named with the 1-based step number, as printed by the coordinator
        if self.fault is not None:
            self.fault.current_step = step + 1
        t0, c0 = time.perf_counter(), time.process_time()
        self.fold_peak(reset=True)  # what came since the last fold (an evaluation, a save) to its phase
        self.enter(f"step {step + 1} forward/backward")
        idx = self.sampler.micro_batches_for_step(step)
        mbs = [self.micro_batch_tensors(self.data, i) for i in idx]
        if self.pairs and self.last:
            mbs = [(x, PairTargets(y, self.ref_train[i])) for (x, y), i in zip(mbs, idx)]
        pos = None if self.micro_batch_positions is None else [self.micro_batch_positions(self.data, i) for i in idx]
        res = self._forward_backward(step, mbs, pos)
        t1, c1 = time.perf_counter(), time.process_time()
        self.enter(f"step {step + 1} collectives")
        if self.fault is not None:
            self.fault("collective")
        tot = self._reduce(res, mbs)
        t2, c2 = time.perf_counter(), time.process_time()
        lr = lr_at(step, lr=tr.lr, warmup_steps=tr.warmup_steps, total_steps=tr.steps, min_lr_ratio=tr.min_lr_ratio)
        if self.heap_guard is not None:  # the update's temporaries start from at most the cap's holes
            self.heap_guard.check()
        ot = self._update(step, tot, lr)
        t3, c3 = time.perf_counter(), time.process_time()
        step_peak = self.fold_peak(reset=False)  # this step's peak, also in the run's "steps" peak
        trace = {}
        if self.runner.trace is not None:  # npu_train.metrics.trace: actions, then the step's phases
            te = tot.tied_start + tot.tied_s
            trace["actions"] = self.runner.trace + [("collectives", -1, t1, t1, t2, t2)] + (
                [("tied", -1, tot.tied_start, tot.tied_start, te, te)] if self.tied is not None else []) + [
                ("optimizer", -1, t2, t2, t3, t3)]
        self.ctrl.send("step", step=step + 1, loss=tot.loss, lr=lr, grad_norm=tot.grad_norm, tokens=tot.tokens,
                       skipped=not tot.finite, objective=tot.objective_metrics,
                       moe=None if self.runner.moe is None else {"aux_loss": tot.aux_loss,
                                                                 "expert_load": res.get("expert_load")},
                       time_s=t3 - t0, compute_s=res["compute_s"], wait_s=res["wait_s"] + (t2 - t1),
                       # wait_s split: waits for a neighbour's activation / gradient inside the
                       # schedule (pipeline bubble) and the end-of-step collectives (tied / replica
                       # all-reduce, grad norm + loss all-reduce, including the wait for the slowest stage)
                       bubble_s=res["wait_s"], collective_s=t2 - t1, tied_s=tot.tied_s,
                       send_s=res["send_s"],  # optimizer_s: with the previous step's rest of the embedding update
                       optimizer_s=ot["device_optimizer"] + ot["host_optimizer"] + res["deferred_opt_s"],
                       host_optimizer_s=ot["host_optimizer"], transfer_s=ot["transfer"],
                       mem_peak=step_peak, mem_now=self.backend.memory_allocated(), mem_phases=dict(self.mem_phases),
                       peak_flops=self.peak.flops, peak_source=self.peak.source,
                       compile_s=self.compile_s if step == self.start else 0.0, host=self.opt.host.take_stats(),
                       marks=[t0, t1, t2],
                       # CPU seconds of this process (all threads) in the step and in its three phases
                       # (schedule, collectives, optimizer): the work done, independent of waits and of
                       # other processes competing for the cores
                       cpu_s=c3 - c0, cpu_phases_s=[c1 - c0, c2 - c1, c3 - c2],
                       # the compute's own CPU seconds (cpu cards; pipeline.stage.work_clock): what the
                       # fitted figures learn the card's speed from, not the loaded host's wall clock
                       **({} if res.get("compute_cpu_s") is None else {"compute_cpu_s": res["compute_cpu_s"]}),
                       **trace, **self.backend.step_stats())
        return {"loss": tot.loss, "grad_norm": tot.grad_norm, "lr": lr, "tokens": tot.tokens,
                "interrupted": tot.interrupted}

    def _forward_backward(self, step: int, mbs: list, positions: Optional[list] = None) -> dict:
        """The schedule over ``mbs`` (``[(inputs, labels)]``, with ``positions`` of packed rows or None); returns
        StageRunner.run_step's dict."""
        tr = self.tr
        for p in self.params.values():
            p.grad = None
        # gradients changed by a collective after the backward are final only after it
        late = self.params if self.dp > 1 else [self.tied_name] if self.tied_pair else []
        if not late and self.first and self.last and "lm_head.weight" not in self.params:
            # a tied embedding and head on this card: 2 accumulations per micro-batch, final at the step's end
            late = [n for n in ("model.embed_tokens.weight",) if n in self.params]
        self.opt.begin_step(tr.accum, late)
        if self.tied is not None:
            self.tied.begin()  # first stage: the last stage's dense tied gradient may arrive from now on
        early = None
        if self.tied is not None and self.last:
            # the lm_head gradient leaves as soon as it is final, before the deferred layer W passes
            early = ([self.params[self.tied_name]], lambda: self.tied.send_dense(self.grad_buf(self.tied_name)))
        self.runner.trace = [] if self.spec.runtime.trace else None  # per-action timeline (runtime.trace)
        targets = self.last or self.vocab  # vocabulary-parallel: every card takes its share of the loss
        if self.first or targets:
            return self.runner.run_step(step, [x for x, _ in mbs] if self.first else None,
                                        [y for _, y in mbs] if targets else None,
                                        total_tokens=self.global_tokens(step) if targets else None, early=early,
                                        positions=positions)
        return self.runner.run_middle(step, tr.accum, positions=positions)

    def _reduce(self, res: dict, mbs: list) -> "StepTotals":
        """Tied sum, replica all-reduce, then the world all-reduce of norm, loss, tokens, stop and non-finite
        flags."""
        import torch.distributed as dist

        exclude = ["lm_head.weight"] if (self.tied_pair and self.last) else []
        # each stage's (replica-summed) gradient counted once: by replica 0, or with ZeRO-1 by the owners
        counts = self.zero or self.replica == 0
        sq_terms: Optional[dict] = None  # set: the sum of squares is taken in two parts around the exchange
        if self.tied is not None and self.dp == 1 and counts:
            # every gradient but the tied one is final: its sum of squares is taken now, while the
            # first stage would wait in the exchange for the last stage's end (experiments/2026-12-01-bench-run6.md)
            sq_terms = self.opt.grad_sq_terms(exclude, only=[n for n in self.params if n != self.tied_name])
        t_tied = ta_tied = time.perf_counter()
        if self.tied is not None:  # sum the tied gradient of the pair (npu_train.runtime.tied)
            g = self.grad_buf(self.tied_name)  # fp32 accumulator with bf16 compute (or .grad)
            self.tied.finish(g, looked_up_rows([x for x, _ in mbs]))
            del g
        t_tied = time.perf_counter() - t_tied if self.tied is not None else 0.0
        if self.dp > 1:
            from npu_train.runtime.replicas import allreduce_grads

            # the buffers holding each parameter's step gradient: fp32 accumulators (bf16 compute) or .grad
            allreduce_grads({n: self.grad_buf(n) for n in self.params}, self.backend, self.stage_group)
        stop_req = 1.0 if self.ctrl.poll_stop() else 0.0
        if sq_terms is not None:  # the rest: the tied gradient, final now
            sq_terms.update(self.opt.grad_sq_terms(exclude, only=[self.tied_name]))
            sq = float(self.opt.sum_terms(sq_terms))
        else:
            sq = float(self.opt.grad_sq_sum(exclude=exclude)) if counts else 0.0
        flags = [0.0] * self.spec.world_size  # flags[r] = 1: rank r holds a non-finite loss or gradient
        flags[self.rank] = 0.0 if math.isfinite(sq) and math.isfinite(res["loss_sum"]) else 1.0
        stats = list(res.get("stats") or [0.0] * len(self.objective.stats))
        head = [sq, res["loss_sum"], float(res["n_tokens"]), stop_req, float(res.get("n_units", 0))] + stats
        red = torch.tensor(head + flags + [float(res.get("moe_aux_sum", 0.0))], dtype=torch.float64)
        dist.all_reduce(red)
        if self.tied is not None:  # the first stage's rows left without a wait (the last stage has them now)
            self.tied.settle()
        k = len(head)
        units = float(red[4])
        return StepTotals(grad_norm=float(red[0]) ** 0.5, loss=float(red[1] / max(units, 1.0)), tokens=int(red[2]),
                          interrupted=bool(red[3] > 0), bad_ranks=[r for r in range(len(flags)) if red[k + r] > 0],
                          tied_s=t_tied, tied_start=ta_tied, units=int(units),
                          aux_loss=self._mean_aux(float(red[-1])),
                          objective_metrics=self.objective.metrics([float(v) for v in red[5:k]], units) or None)

    def _mean_aux(self, aux_sum: float) -> Optional[float]:
        """The load-balancing loss of the step from its sum over every micro-batch of all replicas (None: off)."""
        return aux_sum / (self.tr.accum * self.dp) if self.tr.moe_aux_loss > 0 else None

    def _update(self, step: int, tot: "StepTotals", lr: float) -> dict:
        """AdamW with the clip coefficient (ZeRO-1: then broadcast), or :meth:`nonfinite` and the gradients
        dropped; returns the optimizer's seconds."""
        tr = self.tr
        if not tot.finite:
            self.nonfinite(step, tot.loss, tot.grad_norm, tot.bad_ranks)
            self.opt.discard_grads()
            return {"device_optimizer": 0.0, "host_optimizer": 0.0, "transfer": 0.0}
        self.enter(f"step {step + 1} optimizer")
        if self.fault is not None:
            self.fault("optimizer")
        clip_coef = min(1.0, tr.clip / (tot.grad_norm + 1e-6)) if tr.clip > 0 else 1.0
        ot = self.opt.step(lr, clip_coef, rows=self.next_rows(step) if self.opt.row_name else None)
        if self.zero:
            from npu_train.runtime.replicas import broadcast_weights

            ta = time.perf_counter()
            self.opt.wait_all()  # the owned weights are on the card before they are sent
            broadcast_weights(self.params, self.owners, self.replica, self.stage_ranks, self.backend,
                              self.stage_group)
            ot["transfer"] += time.perf_counter() - ta
        return ot

    def zero_embed_grad(self) -> None:
        """First-forward-sent hook: the embedding's zeroed gradient buffer (rows are added into it)."""
        emb = self.params["model.embed_tokens.weight"]
        emb.grad = torch.zeros_like(emb)

    def next_rows(self, step: int) -> Optional[torch.Tensor]:
        """The embedding rows 0-based step ``step + 1`` looks up (None after the last step)."""
        if step + 1 >= self.tr.steps:
            return None
        return looked_up_rows([self.micro_batch_tensors(self.data, i)[0]
                               for i in self.sampler.micro_batches_for_step(step + 1)])

    def nonfinite(self, step: int, loss: float, grad_norm: float, stages: list) -> None:
        """A non-finite value in ``step``: ``stop`` raises NonFiniteError on the ``stages`` holding it (all if
        none: an overflowed sum), ``skip`` returns and the update is skipped."""
        what = " and ".join(w for w, v in (("loss", loss), ("global grad norm", grad_norm)) if not math.isfinite(v))
        where = f"stage(s) {', '.join(map(str, stages))}" if stages else "no single stage (the global sum overflowed)"
        if self.tr.nonfinite == "skip":
            log.warning("step %d: non-finite %s (loss %s, grad norm %s) from %s: update skipped "
                        "(train.nonfinite=skip)", step + 1, what, loss, grad_norm, where)
            return
        if stages and self.rank not in stages:
            return  # the stage that holds the non-finite values reports it
        raise NonFiniteError(
            f"step {step + 1}: non-finite {what} (loss {loss}, grad norm {grad_norm}), first seen on {where}; "
            f"the update was not applied (masters, moments and checkpoints hold step {step}): lower train.lr, "
            "check the data and the model file, or set train.nonfinite=skip to skip such steps")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, after_step: int) -> Optional[float]:
        """Forward-only pass over the held-out batches; the mean loss per target token (nats) on every rank."""
        import torch.distributed as dist

        self.enter(f"evaluation after step {after_step}")
        self.opt.wait_all()
        obj = self.objective
        er = {"loss_sum": 0.0, "n_tokens": 0, "n_units": 0, "stats": [0.0] * len(obj.stats)}
        if self.replica == 0:  # the replicas hold the same weights: replica 0 evaluates, the others add zeros
            self.module.eval()
            er = self.runner.run_eval(after_step, self.n_eval,
                                      [x for x, _ in self.eval_batches] if self.first else None,
                                      self.eval_targets() if self.last or self.vocab else None,
                                      positions=self.eval_positions)
            self.module.train()
        red = torch.tensor([er["loss_sum"], float(er["n_tokens"]), float(er["n_units"])] + list(er["stats"]),
                           dtype=torch.float64)
        dist.all_reduce(red)
        val = float(red[0] / max(float(red[2]), 1.0))
        if self.last and self.replica == 0:
            extra = obj.metrics([float(v) for v in red[3:]], float(red[2]))
            self.ctrl.send("eval", step=after_step, val_loss=val, tokens=int(red[1]), objective=extra or None)
        return val

    def eval_targets(self) -> list:
        """The last stage's held-out targets: labels, or (DPO) labels with the reference log-probabilities."""
        if not self.pairs:
            return [y for _, y in self.eval_batches]
        mb = self.tr.micro_batch
        return [PairTargets(y, self.ref_val[m * mb:(m + 1) * mb]) for m, (_, y) in enumerate(self.eval_batches)]

    # ------------------------------------------------------------------ DPO reference
    def reference(self) -> None:
        """The DPO reference log-probabilities of the rows this run uses: read (the last stage) and, for the rows
        no file holds yet (``spec.reference.train_rows`` / ``val_rows``), computed by a forward pass of the whole
        pipeline (every stage; LoRA with the adapters disabled), then written by replica 0's last stage. With
        ``dp`` replicas each computes its share of those rows (micro-batch ``j`` of them, train then val, on
        replica ``j % dp``: :func:`~npu_train.runtime.reference.pass_shares`; none when there are fewer
        micro-batches than replicas), and the last stages exchange the values (:meth:`_gather_reference`), so every replica's last
        stage holds all the values it trains with: the pass takes about ``1/dp`` of one pipeline's time."""
        from npu_train.runtime.reference import load_reference, pass_shares, save_reference

        ref = self.spec.reference
        if self.last:
            self.ref_train, self.ref_val = load_reference(ref, self.data.n_train, self.data.n_val)
        if ref.compute:
            mb, dp = self.tr.micro_batch, self.dp
            train, val = pass_shares(ref, mb, dp)
            shares = [("train", train, self.ref_train), ("val", val, self.ref_val)]
            per = [sum(len(sh[k]) for _, sh, _ in shares) for k in range(dp)]  # sequences per replica
            self.enter(f"DPO reference pass over {ref.n_compute} sequences"
                       + (f" ({per[self.replica]} on replica {self.replica} of {dp})" if dp > 1 else ""))
            t0 = time.perf_counter()
            for split, sh, into in shares:
                vals = self._reference_rows(split, sh[self.replica])
                if self.last:
                    self._gather_reference(into, sh, vals)
            if self.last and self.replica == 0:
                save_reference(ref, self.ref_train, self.ref_val)
                spread = f"spread over {dp} replicas, at most {max(per)} each; " if dp > 1 else ""
                self.ctrl.send("note", text=f"DPO reference pass: {ref.n_compute} sequences in "
                                            f"{time.perf_counter() - t0:.1f} s ({spread}stored"
                                            + ("; a resume reads them)" if ref.run_file else " beside the data cache)"))
        elif self.last and self.replica == 0 and ref.run_file and ref.existing() != ref.run_file:
            save_reference(ref, self.ref_train, self.ref_val)  # read from the cache: the run keeps its own copy

    def _gather_reference(self, into: torch.Tensor, shares: list, vals: Optional[torch.Tensor]) -> None:
        """Last stage: write every replica's values into ``into`` (``[n]`` float64, at the rows of ``shares``, one
        list of rows per replica): this replica's ``vals`` (``[len(shares[replica])]`` float64, None when its share
        is empty) and, with ``dp > 1``, the other replicas' from a gloo all-gather over ``stage_group`` (the
        replicas' last stages; group rank = replica), each share padded to the longest (gloo needs equal sizes)."""
        import torch.distributed as dist

        n = max(len(sh) for sh in shares)
        if n == 0:
            return
        got = [vals]
        if self.dp > 1:
            buf = torch.zeros(n, dtype=torch.float64)
            if vals is not None:
                buf[:vals.numel()] = vals
            got = [torch.empty(n, dtype=torch.float64) for _ in range(self.dp)]
            dist.all_gather(got, buf, group=self.stage_group)
        for sh, g in zip(shares, got):
            if sh:
                into[torch.tensor(sh, dtype=torch.int64)] = g[:len(sh)]

    def _reference_rows(self, split: str, rows: list) -> Optional[torch.Tensor]:
        """The reference log-probabilities ``[len(rows)]`` float64 of ``rows`` of ``split`` (last stage; else
        None), in micro-batches of ``train.micro_batch`` rows."""
        from contextlib import nullcontext

        from npu_train.model.lora import adapters_disabled

        if not rows:
            return None
        mb = self.tr.micro_batch
        chunks = [torch.tensor(rows[a:a + mb], dtype=torch.int64) for a in range(0, len(rows), mb)]
        batches = [self.micro_batch_tensors(self.data, i, split=split) for i in chunks]
        pos = None if self.micro_batch_positions is None else [
            self.micro_batch_positions(self.data, i, split=split) for i in chunks]
        self.module.eval()
        with adapters_disabled(self.module) if self.tr.mode == "lora" else nullcontext():
            out = self.runner.run_reference(len(chunks), [x for x, _ in batches] if self.first else None,
                                            [y for _, y in batches] if self.last else None, positions=pos)
        self.module.train()
        return torch.cat(out) if out is not None else None

    # ------------------------------------------------------------------ checkpoints
    def save_due(self, done: int, interrupted: bool, stopping: bool) -> bool:
        """Whether to save after ``done`` steps: every ``save_every``, the last step, an interrupt, ``stop_after``."""
        tr = self.tr
        return bool(tr.save_checkpoints and ((tr.save_every and done % tr.save_every == 0) or done == tr.steps
                    or (interrupted and tr.save_on_interrupt) or (stopping and not interrupted)))

    def maybe_save(self, done: int, interrupted: bool = False, stopping: bool = False) -> Optional[str]:
        """Write and report this stage's shard when :meth:`save_due`; returns the staging directory or None.
        Replica 0 writes (the dp=1 format; ZeRO-1: receiving the other replicas' tensors one at a time,
        :func:`~npu_train.runtime.replicas.gathered_state_entries`); extra host memory: the largest fp32
        tensor (checked first)."""
        from npu_train.checkpoint.store import entries_of, save_shard, tmp_dir
        from npu_train.checkpoint.stream import check_memory

        if not self.save_due(done, interrupted, stopping):
            return None
        spec = self.spec
        self.enter(f"checkpoint save of step {done}")
        fix = "the previous checkpoint is intact; free host memory (other processes) and retry"
        if self.zero:  # replica 0 receives the others' optimizer state tensor by tensor while it writes
            from npu_train.runtime.replicas import gathered_state_entries

            check_memory(4 * max(p.numel() for p in self.params.values()), f"checkpoint save of step {done}", fix)
            tensors = gathered_state_entries(self.opt.state_entries(), {n: tuple(p.shape) for n, p in self.params.items()},
                                             self.owners, self.replica, self.stage_ranks)
        else:
            tensors = self.opt.state_entries() if self.replica == 0 else []
            if self.vocab and tensors:  # the head's rows of every card into one lm_head entry (the usual files)
                tensors = self._vocab_gathered(tensors)
            check_memory(max((e.nbytes for e in tensors), default=0), f"checkpoint save of step {done}", fix)
        staging = tmp_dir(spec.ckpt_root, done, spec.job_id, owner_pid=spec.parent_pid)
        if self.replica != 0:
            self.ctrl.send("ckpt", step=done, staging=staging)
            return staging
        tensors += entries_of({f"rng.{self.stage}": torch.get_rng_state()})
        card = {"kind": spec.card.kind, "index": spec.card.index, "name": spec.card.name}
        st = spec.stage
        stage = {"first": st.first, "last": st.last, "has_embed": st.has_embed, "has_head": st.has_head,
                 "label": st.label, **({"second": list(st.second)} if st.second else {})}
        save_shard(staging, self.stage, tensors, {"rank": self.stage, "card": card, "stage": stage,
                                                  "resident": sorted(spec.resident_names), "step": done,
                                                  "dp": self.dp, "zero": self.zero})
        if self.fault is not None:
            self.fault("checkpoint")
        self.ctrl.send("ckpt", step=done, staging=staging)
        return staging

    def _vocab_gathered(self, tensors: list) -> list:
        """Vocabulary parallelism's checkpoint: each card's rows of ``lm_head.weight`` (master, both moments) go to
        the head card, which writes them as the one ``[V, H]`` entry a run without it writes; the other cards send
        theirs (blocking, in that order) and write none. Returns the card's entries to write."""
        import torch.distributed as dist

        from npu_train.optim.entry import Entry
        from npu_train.pipeline.vocab import vocab_rows

        keys = [f"{k}.lm_head.weight" for k in ("master", "exp_avg", "exp_avg_sq")]
        mine = {e.name: e for e in tensors if e.name in keys}
        if not mine:  # LoRA: the frozen output layer has no state
            return tensors
        rest = [e for e in tensors if e.name not in keys]
        lay = self.spec.layout
        head = lay.rank(self.replica, self.head_card)
        if self.stage != self.head_card:
            for i, k in enumerate(keys):
                dist.send(mine[k].get().float().contiguous(), dst=head, tag=VOCAB_SAVE_TAG + i)
            return rest
        V, H = int(self.spec.model_cfg["vocab_size"]), int(mine[keys[0]].shape[1])

        def gather(i: int, k: str) -> torch.Tensor:
            parts = []
            for s in range(self.P):
                a, b = vocab_rows(V, self.P, s)
                if s == self.stage:
                    parts.append(mine[k].get().float())
                    continue
                t = torch.empty((b - a, H), dtype=torch.float32)
                dist.recv(t, src=lay.rank(self.replica, s), tag=VOCAB_SAVE_TAG + i)
                parts.append(t)
            return torch.cat(parts)

        return rest + [Entry(k, torch.float32, (V, H), lambda i=i, k=k: gather(i, k)) for i, k in enumerate(keys)]

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Train from ``start_step`` to ``train.steps`` (or until stopped), evaluating and saving as configured."""
        tr = self.tr
        if self.pairs:
            self.reference()
        if self.n_eval and self.start == 0:
            self.evaluate(0)
        stop_after = int(tr.stop_after or 0)
        for step in range(self.start, tr.steps):
            out = self.train_step(step)
            done = step + 1
            interrupted = out["interrupted"]
            # train.stop_after=K: stop after K steps of this launch (same on every rank, no vote needed)
            stop = interrupted or bool(stop_after and done - self.start >= stop_after)
            if self.n_eval and not interrupted and ((tr.eval_every and done % tr.eval_every == 0) or done == tr.steps):
                self.evaluate(done)
            self.maybe_save(done, interrupted, stop)
            if stop:
                self.ctrl.send("stopped", step=done)
                break

    def close(self) -> None:
        """Barrier with every stage, close the boundary links, leave the gloo group."""
        import torch.distributed as dist

        self.enter("shutdown")
        if self.heap_guard is not None:
            for line in self.heap_guard.summary().splitlines():
                log.debug(line)  # diagnostics: a console line would cut the live progress bar
        self.opt.close()
        dist.barrier()
        if self.comm is not None:
            self.comm.close()
        close = getattr(self.vocab_ex, "close", None)  # the shared-memory exchange: its segments
        if close is not None:
            close()
        dist.destroy_process_group()
