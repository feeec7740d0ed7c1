"""Cost model: predicted seconds per optimizer step of ``M`` micro-batches on ``P`` stages.

:class:`CostModel` holds the per-plan constants and caches one :class:`StageCost` per (stage, layers,
resident layers); :meth:`CostModel.build` makes the :class:`~npu_train.planner.plan.Plan`. The model
(FLOPs, schedule timeline, optimizer and transfer times, overlap, data parallelism, shared cores) and
its sources: ``docs/planner.md``, section 2."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from npu_train.hardware import Card
from npu_train.model.config import LlamaConfig
from npu_train.pipeline.schedule import SPLIT_BACKWARD, card_of, copy_timeline, stage_timeline
from npu_train.planner.memory import MemoryModel
from npu_train.planner.plan import Plan, StagePlan
from npu_train.planner.rates import Rates
from npu_train.planner.spec import RunShape, copies_overlapped

__all__ = ["StageCost", "CostModel", "host_update_bytes", "capped_host_rate"]


def host_update_bytes(shape: RunShape) -> int:
    """Bytes of host memory traffic per parameter of the one-pass host update (``optim/host_adamw.c``): the
    downloaded gradient (:attr:`RunShape.grad_bytes`), fp32 master and both moments read and written (24),
    and the compute-dtype copy out (none in fp32: the master is the copy) - 30 for bf16 with fp32 gradients."""
    return int(shape.grad_bytes) + 24 + (0 if shape.dtype == "fp32" else int(shape.dtype_bytes))


def capped_host_rate(rt: Rates, card_processes: int, bytes_per_param: int) -> tuple[float, str]:
    """(params/s, source) of one accelerator card process's host AdamW: ``rt``'s (threads x the per-thread
    figure, already resolved) capped by the host memory bandwidth ``rt.host_bytes_per_s`` shared by
    ``card_processes`` processes each moving ``bytes_per_param``; the source names the bounding figure first
    (``capped: host memory ...`` or the per-thread figure's source) and the other after ``;``, each figure's own
    source in parentheses: one level of brackets inside the plan's ``[...]`` (the 8-card ``rates`` line nested
    ``[...]`` three deep, a fresh-clone review). Rates in M params/s with thousands separators."""
    own = float(rt.host_adamw_params_per_s)
    n = max(1, int(card_processes))
    cap = float(rt.host_bytes_per_s) / n / max(1, int(bytes_per_param))
    bw = (f"host memory {rt.host_bytes_per_s / 1e9:.3g} GB/s ({_flat(rt.source('host_bytes_per_s'))}) / {n} card "
          f"process{'es' if n != 1 else ''} / {int(bytes_per_param)} B/param = {cap / 1e6:,.0f} M")
    if cap < own:
        return cap, (f"capped: {bw}; {rt.threads or '?'} thread(s) alone: {own / 1e6:,.0f} M "
                     f"({_flat(rt.source('host_adamw_params_per_s'))})")
    return own, f"{_flat(rt.source('host_adamw_params_per_s'))}; cap: {bw}"


def _flat(source: str) -> str:
    """``source`` with its parenthesised asides as comma clauses (``assumed (profile)`` -> ``assumed, profile``;
    ``thread(s)`` stays), to go inside parentheses itself."""
    return re.sub(r" \(([^()]*)\)", r", \1", source)


@dataclass
class StageCost:
    """Memory (bytes) and compute (seconds per micro-batch) of one stage at one (layers, resident layers)
    choice; ``*_params`` count parameters per step, ``state_share`` is 1 or ``1/dp`` with ZeRO-1."""

    resident: int  # resident decoder layers
    nonlayer_resident: bool
    mem: dict  # memory terms, bytes (MemoryModel.stage)
    host_params: int  # optimizer on the host (offloaded)
    device_params: int  # optimizer on the card (resident)
    xfer_params: int  # moved card<->host each step, each direction
    t_mb: float  # t_f + t_b + t_w
    in_flight: int  # micro-batches whose activations the stage holds at peak
    host_state_on_card: bool = False  # a cpu card: the offloaded state is card memory
    params: int = 0  # every parameter the stage computes with (what the dp all-reduce moves)
    state_share: float = 1.0
    t_f: float = 0.0  # forward seconds per micro-batch
    t_b: float = 0.0  # input-gradient pass
    t_w: float = 0.0  # weight-gradient pass
    layers: int = 0  # decoder layers
    t_head: tuple = (0.0, 0.0, 0.0)  # the head's share of (t_f, t_b, t_w)
    recomputed: Optional[int] = None  # layers recomputed whole (RunShape.recompute_fewest; None: the shape's)
    heap_cap: Optional[int] = None  # bytes of holes the card's heap guard lets stand (MemoryModel.heap_cap)
    heap_slack: Optional[int] = None  # RSS growth between the guard's reads of its live bytes
    heap_reserve: int = 0  # bytes the guard's limit keeps free below the total (MemoryModel.heap_reserve)
    t_rc: float = 0.0  # seconds of t_b per micro-batch that recompute a forward (whole layers, attention cores)
    t_v: float = 0.0  # the card's share of a joint V(m) per micro-batch (vocabulary parallelism), part of t_mb
    t_vparts: tuple = (0.0, 0.0, 0.0)  # of which: logits slice, partial input gradient, weight gradient
    #: the card's stage-boundary copies per micro-batch in its F and its B (CostModel.card_copies), in t_f / t_b
    t_copy: tuple = (0.0, 0.0)

    @property
    def offloaded_state_bytes(self) -> int:
        """The offloaded layers' fp32 master + AdamW m, v: 12 B/param, wherever they are held."""
        return int(12 * self.host_params * self.state_share)

    @property
    def host_bytes(self) -> int:
        """Host RAM of the offloaded fp32 master + AdamW m, v: 12 B/param (0 on a cpu card)."""
        return 0 if self.host_state_on_card else self.offloaded_state_bytes


def exposed_host_time(mode: str, host_s: float, *, offloaded_layers: int, resident_layers: int,
                      fwd_layer_s: float, first_input_s: float, idle_s: float, cpu_card: bool) -> float:
    """Seconds of one stage's host update (``host_s`` = host AdamW + upload per step) the step still waits
    for, by ``RunShape.offload`` mode: ``serial`` all of it; ``overlap`` the delay of the next forward
    reaching an offloaded layer before its update is done (cpu card: ``host_s - first_input_s``);
    ``delayed`` ``host_s - idle_s``. Returns ``0 <= D <= host_s`` (formulas: ``docs/planner.md``)."""
    if host_s <= 0.0 or mode == "serial":
        return max(0.0, host_s)
    if mode == "delayed":
        return max(0.0, host_s - idle_s)
    a = first_input_s
    if cpu_card:
        return max(0.0, host_s - a)
    o, r, f = max(1, int(offloaded_layers)), int(resident_layers), fwd_layer_s
    h = host_s / o
    return min(host_s, max(0.0, h - a - r * f, o * h - a - (r + o - 1) * f))


class CostModel:
    """Per-plan constants of the memory and time model, so the split search evaluates stages cheaply.

    ``rates``: one :class:`Rates` per card (resolved here for ``threads`` and the dtype; cpu cards' AdamW
    scaled by their share of ``host_cores``; accelerator cards' host AdamW capped by the host memory bandwidth
    shared by ``cards_per_host`` card processes, 0: every card of the job, :func:`capped_host_rate`);
    ``headroom``: the fraction of capacity :meth:`max_resident` keeps free; ``cards`` are one of ``dp``
    replicas."""

    def __init__(self, model: LlamaConfig, shape: RunShape, cards: Sequence[Card],
                 rates: Sequence[Rates], nonlayer_resident: Optional[bool], threads: int,
                 host_cores: int, terms: Optional[Sequence] = None, headroom: float = 0.0,
                 dp: int = 1, zero: int = 0, cards_per_host: int = 0):
        self.model, self.shape, self.cards = model, shape, list(cards)
        self.P = len(self.cards)
        self.dp, self.zero = int(dp), int(zero)
        self.memory = MemoryModel(model, shape, self.cards, nonlayer_resident, terms, threads=int(threads))
        self.headroom = float(headroom)
        self.threads, self.host_cores = int(threads), int(host_cores)
        cores = self.host_cores
        # every replica's cpu cards share the host (one node)
        n_cpu = self.dp * sum(1 for c in self.cards if c.kind == "cpu")
        # all cpu cards run their optimizers at the same time: each gets its share of the cores
        self.cpu_share = min(1.0, cores / (n_cpu * self.threads)) if n_cpu else 1.0
        self.cards_per_host = int(cards_per_host) or self.dp * self.P
        self.rates = []
        for card, rt in zip(self.cards, rates):
            r = rt.resolve(shape.dtype, self.threads)
            if card.kind == "cpu":
                r.host_adamw_params_per_s *= self.cpu_share
                r.device_adamw_params_per_s *= self.cpu_share
            else:
                r.host_adamw_params_per_s, r.sources["host_adamw_params_per_s"] = capped_host_rate(
                    r, self.cards_per_host, host_update_bytes(shape))
            self.rates.append(r)
        # stretch of the pipeline phase = slots / (M + P - 1). Slot j (0 .. M+P-2) of a wave has the stages
        # max(0, j-M+1) .. min(j, P-1) computing; when the cpu ones among them run more threads
        # than there are cores, the slot stretches by (cpu stages * threads / cores).
        M, P = shape.micro_batches, self.P
        cpu_stage = [c.kind == "cpu" for c in self.cards]
        self.slots = 0.0
        for j in range(M + P - 1):
            active = sum(1 for st in range(max(0, j - M + 1), min(j, P - 1) + 1) if cpu_stage[st])
            self.slots += max(1.0, self.dp * active * self.threads / cores)  # dp replicas at once
        tok = shape.tokens_per_micro_batch
        # 6 FLOPs/param/token: forward 2 + input gradient 2 + weight gradient 2 (Kaplan et al. 2020);
        # LoRA computes no weight gradient of the frozen base: 4 (+ 6 per adapter parameter). The parameters a
        # token passes through: a mixture-of-experts layer's active ones (its top-k experts, planner/moe.py)
        adapter_params = shape.active_adapter_params
        layer_params = model.active_params_per_layer()
        attn = shape.seq_len * tok * model.num_heads * model.head_dim
        lin = 2.0 * (layer_params + adapter_params) * tok  # one pass over the linear layers (base + adapters)
        f = lin + 4.0 * attn
        #: FLOPs per micro-batch of one decoder layer: (forward, input gradient, weight gradient)
        # selective recompute (recompute_attention): the attention core's forward, 4 attn, again in B
        core = 4.0 * attn if shape.recompute_attention and not shape.recompute else 0.0
        w = 2.0 * (adapter_params if adapter_params else layer_params) * tok
        self.layer_fbw = (f, lin + 8.0 * attn + (f if shape.recompute else core), w)
        self.layer_flops = sum(self.layer_fbw)
        # recompute_fewest: a layer recomputed whole runs its forward again in B (and its core once more: the
        # core's checkpoint nests in the layer's); a kept layer recomputes only its core (recompute_attention)
        core_k = 4.0 * attn if shape.recompute_attention else 0.0
        #: per-layer (forward, input gradient, weight gradient) FLOPs: (recomputed whole, kept) under recompute_fewest
        self.layer_fbw_parts = ((f, lin + 8.0 * attn + f + core_k, w), (f, lin + 8.0 * attn + core_k, w))
        #: recomputed FLOPs per micro-batch and layer: (a layer recomputed whole, a kept layer) - the parts of B
        #: above that run a forward again (for the time table's recompute column)
        self.layer_recompute = ((f + core_k, core_k) if shape.recompute_fewest else (f, 0.0) if shape.recompute
                                else (0.0, core))
        head_pass = 2.0 * tok * model.embedding_params()  # one pass of the lm_head (V x H) over the tokens
        #: FLOPs per micro-batch of the lm_head (+ loss): (forward, input gradient, weight gradient)
        # (recompute_fewest: no head recompute, as the card runs it: StageModule checkpoints decoder layers only)
        self.head_fbw = (head_pass, head_pass + (head_pass if shape.recompute and not shape.recompute_fewest else 0.0),
                         0.0 if adapter_params else head_pass)
        self.head_flops = sum(self.head_fbw)
        #: per card: its stage-boundary copies in a copy thread (RunShape.overlap_copies), priced by
        #: copy_timeline instead of inside t_f / t_b
        self.overlapped = [copies_overlapped(shape, c.kind) and self.P > 1 for c in self.cards]
        self._cache: dict = {}

    def cost(self, i: int, n: int, r: int) -> StageCost:
        """Memory and per-micro-batch compute of stage ``i`` with ``n`` layers, ``r`` resident (cached)."""
        key = (i, n, r)
        c = self._cache.get(key)
        if c is not None:
            return c
        mm = self.memory
        rt = self.rates[i]
        # layers recomputed whole (None: the shape's all or none); not `k`, which the split backward uses below
        whole, sm = self._fewest_recomputed(i, n, r) if self.shape.recompute_fewest else (None, None)
        if sm is None:
            sm = mm.stage(i, n, r, rt.process_baseline_bytes, whole)
        first, last = i == 0, i == mm.head_stage
        lora = self.shape.lora_params_per_layer > 0
        # the tied gradient down and up (not when one card holds embedding and head)
        tied_copies = mm.tied and mm.head_stage != 0 and (first or last) and not lora
        xfer = sm.offloaded_params + (mm.embedding_params if tied_copies else 0)
        if whole is None:
            fbw = [n * x / rt.device_flops for x in self.layer_fbw]
        else:
            redo, kept = self.layer_fbw_parts
            fbw = [(whole * a + (n - whole) * b) / rt.device_flops for a, b in zip(redo, kept)]
        if self.shape.schedule in SPLIT_BACKWARD and (not first or mm.chunks > 1) and n:
            # B + W of the zero-bubble split cost split_backward_ratio x (forward + backward) in
            # seconds, not FLOPs (measured per layer: Rates.split_backward_ratio); the first stage
            # runs the full backward
            f, b, w = fbw
            # (a ratio below f / (f + b + w) would mean a negative backward: k floored at 0)
            k = max(0.0, (rt.split_backward_ratio * (f + b + w) - f) / (b + w)) if b + w > 0 else 1.0
            fbw = [f, b * k, w * k]
        on_card = last and not self.shape.vocab_parallel  # vocabulary-parallel: the head runs in V(m)
        head = tuple(x / (rt.device_flops * rt.head_flops_ratio) for x in self.head_fbw) if on_card else (0.0,) * 3
        fbw = [t + x for t, x in zip(fbw, head)]
        t_copy = self.card_copies(i)
        fbw = [fbw[0] + t_copy[0], fbw[1] + t_copy[1], fbw[2]]
        t_vparts = self.vocab_time(i)
        t_v = sum(t_vparts)
        t_mb = sum(fbw) + t_v
        rc = self._recompute_seconds(i, n, whole, last)
        mem, share = self._zero_cut(i, sm.mem)
        c = StageCost(r, sm.nonlayer_resident, mem, sm.offloaded_params, sm.resident_params,
                      xfer, t_mb, sm.in_flight, host_state_on_card=self.cards[i].kind == "cpu",
                      params=sm.params, state_share=share, t_f=fbw[0], t_b=fbw[1], t_w=fbw[2], layers=n, t_head=head,
                      recomputed=whole, t_rc=rc, t_v=t_v, t_vparts=t_vparts, t_copy=t_copy, heap_cap=sm.heap_cap,
                      heap_slack=sm.heap_slack, heap_reserve=sm.heap_reserve)
        self._cache[key] = c
        return c

    def vocab_time(self, i: int) -> tuple[float, float, float]:
        """Seconds of card ``i``'s work in one joint ``V(m)`` (vocabulary parallelism; zeros without it), in
        pipeline/vocab.py's order: its logits slice, its partial input gradient, its weight gradient: its slice
        (:meth:`~npu_train.planner.memory.MemoryModel.vocab_rows` of the vocabulary) of the head's forward,
        input-gradient and weight-gradient FLOPs at the head's rate; on an accelerator the first two also copy
        ``[b S, H]`` in the compute dtype card<->host (the hidden state ``h2d``, the partial gradient ``d2h``; the
        head card the same bytes the other way). The exchange is not the card's work (:meth:`vocab_latency`)."""
        if not self.shape.vocab_parallel:
            return 0.0, 0.0, 0.0
        rt, mm = self.rates[i], self.memory
        rate = rt.device_flops * rt.head_flops_ratio
        share = mm.vocab_rows(i) / self.model.vocab_size / rate
        f, _b, w = self.head_fbw  # V(m) recomputes nothing: its input gradient is one pass
        parts = [share * f, share * f, share * w]
        if self.cards[i].kind != "cpu":
            xh = mm.dtype_bytes * self.shape.tokens_per_micro_batch * self.model.hidden_size
            parts[0] += xh / rt.h2d_bytes_per_s
            parts[1] += xh / rt.d2h_bytes_per_s
        return parts[0], parts[1], parts[2]

    @property
    def vocab_shm(self) -> bool:
        """Whether the vocabulary exchange's two ``[b S, H]`` tensors go through shared memory: the runtime's rule
        (:func:`~npu_train.pipeline.hosts.vocab_exchange_shm`: ``runtime.vocab_exchange=shm`` and every boundary of
        the job ``shm``, i.e. every card on one host and ``runtime.transport=shm``) on the boundaries of
        ``cards_per_host`` cards a host (:func:`~npu_train.pipeline.hosts.even_nodes`)."""
        from npu_train.pipeline.hosts import boundary_transports, even_nodes, vocab_exchange_shm

        world = self.dp * self.P
        return vocab_exchange_shm(self.shape.vocab_exchange,
                                  boundary_transports(even_nodes(world, self.cards_per_host), self.shape.transport))

    def vocab_latency(self) -> tuple[float, float, float]:
        """Seconds of the vocabulary exchange (pipeline/vocab.py: in the background where nothing waits for it):
        the final hidden state from the head card, the softmax statistics (every card's maximum, sum of
        exponentials and target logit in one all-reduce: ``12 P`` B per token, gloo at the slowest card's
        ``dp_bytes_per_s``), the partial input gradients summed onto the head card (``[b S, H]`` each in the
        compute dtype): gloo at ``dp_bytes_per_s``, or with :attr:`vocab_shm` the hidden state at
        ``VOCAB_SHM_X_BYTES_PER_S`` and the sum at ``VOCAB_SHM_SUM_BYTES_PER_S`` times ``P / 2`` (the head reads
        every card's partial; the rate is measured at P = 2: :mod:`npu_train.planner.rates`)."""
        from npu_train.planner.rates import VOCAB_SHM_SUM_BYTES_PER_S, VOCAB_SHM_X_BYTES_PER_S

        rate = min(rt.dp_bytes_per_s for rt in self.rates)
        tok = self.shape.tokens_per_micro_batch
        xh = self.memory.dtype_bytes * tok * self.model.hidden_size
        stats = 12 * self.P * tok / rate
        if self.vocab_shm:
            return xh / VOCAB_SHM_X_BYTES_PER_S, stats, xh * self.P / 2 / VOCAB_SHM_SUM_BYTES_PER_S
        return xh / rate, stats, xh / rate

    def _recompute_seconds(self, i: int, n: int, k: Optional[int], last: bool) -> float:
        """Seconds of stage ``i``'s B per micro-batch that run a forward again: ``k`` layers recomputed whole (None:
        all ``n`` under ``recompute``), the other layers' attention cores, the head's forward under full recompute."""
        rt = self.rates[i]
        whole = n if k is None and self.shape.recompute else (k or 0)
        rc = (whole * self.layer_recompute[0] + (n - whole) * self.layer_recompute[1]) / rt.device_flops
        if last and self.shape.recompute and not self.shape.recompute_fewest:
            rc += self.head_fbw[0] / (rt.device_flops * rt.head_flops_ratio)  # the head's forward again in B
        return rc

    def _zero_cut(self, i: int, terms: dict) -> tuple[dict, float]:
        """``(memory terms, optimizer-state share)`` of stage ``i``: with ZeRO-1 the card keeps ``1/dp`` of the
        optimizer state (and its workspace share)."""
        mem = dict(terms)
        share = 1.0
        if self.zero and self.dp > 1:  # ZeRO-1: this card keeps 1/dp of the stage's optimizer state
            share = 1.0 / self.dp
            cut = mem["optimizer"] - int(mem["optimizer"] * share)
            ws_cut = int(cut * self.memory.terms[i].workspace_fraction)  # the card's terms (profile or default)
            mem["optimizer"] -= cut
            mem["workspace"] -= ws_cut
            mem["total"] -= cut + ws_cut
        return mem, share

    def _fewest_recomputed(self, i: int, n: int, r: int) -> tuple:
        """``(k, StageMemory)``: the fewest layers ``k`` of stage ``i`` (``n`` layers, ``r`` resident) recomputed
        whole with which the card fits :meth:`limit` (``RunShape.recompute_fewest``); ``n`` when none does.

        By bisection over ``1..n``: from one recomputed layer on, each more replaces one layer's activations by its
        input in every held micro-batch, so the card's memory does not grow with ``k`` (``k = 0`` holds no recomputed
        layer's activations at a time, so it is tried first); should the count below the one found also fit, the
        counts are tried one by one from 0, as before."""
        mm, base = self.memory, self.rates[i].process_baseline_bytes
        if self.shape.recompute_counts:  # given per card (train.recompute_layers=[...])
            return mm.recomputed(n, self.shape.recompute_counts[i]), None
        cap = self.limit(i)

        def fit(k: int) -> tuple:
            sm = mm.stage(i, n, r, base, k)
            return self._zero_cut(i, sm.mem)[0]["total"] <= cap, sm

        ok, sm = fit(0)
        if ok or n == 0:
            return (0, sm) if ok else (n, sm)
        ok, sm = fit(n)
        if not ok:
            return n, sm
        lo, hi, found = 1, n, sm
        while lo < hi:
            mid = (lo + hi) // 2
            ok, got = fit(mid)
            if ok:
                hi, found = mid, got
            else:
                lo = mid + 1
        if hi > 1 and fit(hi - 1)[0]:  # not monotone here: the first count that fits
            return next((k, got) for k in range(1, hi) for ok, got in [fit(k)] if ok)
        return hi, found

    def side_time(self, i: int, c: StageCost) -> tuple[float, float, float]:
        """(host optimizer, device optimizer, transfer + data-parallel communication) seconds per step."""
        rt = self.rates[i]
        host = c.host_params * c.state_share / rt.host_adamw_params_per_s
        dev = c.device_params * c.state_share / rt.device_adamw
        xfer = self.memory.dtype_bytes * c.xfer_params * (1.0 / rt.h2d_bytes_per_s + 1.0 / rt.d2h_bytes_per_s)
        return host, dev, xfer + self.dp_time(i, c)

    def hideable(self, i: int, c: StageCost, host: Optional[float] = None) -> float:
        """Seconds the host-optimizer overlap can hide at most: host AdamW + upload (0 when serial)."""
        if self.shape.offload == "serial" or not c.host_params:
            return 0.0
        if host is None:
            host = self.side_time(i, c)[0]
        return host + self.memory.dtype_bytes * c.xfer_params / self.rates[i].h2d_bytes_per_s

    def host_hidden(self, i: int, n: int, c: StageCost, host: float, first_input: float, phase: float,
                    bubble: float) -> float:
        """Seconds of stage ``i``'s host AdamW + upload hidden behind other work (:func:`exposed_host_time`);
        a layer's forward is taken as 2 of the 6 (recompute: 8) FLOPs per parameter and token."""
        work = self.hideable(i, c, host)
        fwd = 1.0 / (4.0 if self.shape.recompute else 3.0)
        cpu = self.cards[i].kind == "cpu"
        layers_s = c.t_mb - c.t_v - sum(c.t_copy)  # the card's layer work per micro-batch
        exposed = exposed_host_time(self.shape.offload, work, offloaded_layers=n - c.resident,
                                    resident_layers=c.resident, fwd_layer_s=fwd * layers_s / max(1, n),
                                    first_input_s=first_input, idle_s=bubble if cpu else phase, cpu_card=cpu)
        return work - exposed

    def exposed_floor(self, i: int, n: int, c: StageCost, first_input: float) -> float:
        """A lower bound of stage ``i``'s exposed host seconds (:meth:`hideable` less :meth:`host_hidden`) that
        needs only the earlier stages' forwards (``first_input`` seconds), not the pipeline phase: exact for
        ``serial`` and ``overlap`` (no idle time in their formula), 0 for ``delayed`` (it hides behind idle
        time, which the phase bounds only from above)."""
        if self.shape.offload == "delayed":
            return 0.0
        host = self.side_time(i, c)[0]
        return self.hideable(i, c, host) - self.host_hidden(i, n, c, host, first_input, 0.0, 0.0)

    def dp_time(self, i: int, c: StageCost) -> float:
        """Seconds per step of the data-parallel communication: fp32 ring all-reduce, the card<->host copies
        on an accelerator, the ZeRO-1 weight broadcast; 0 for ``dp == 1``."""
        dp = self.dp
        if dp <= 1:
            return 0.0
        rt, e, n = self.rates[i], self.memory.dtype_bytes, c.params
        t = 2.0 * (dp - 1) / dp * 4.0 * n / rt.dp_bytes_per_s
        if self.cards[i].kind != "cpu":
            t += e * n * (1.0 / rt.d2h_bytes_per_s + 1.0 / rt.h2d_bytes_per_s)
        if self.zero:
            t += (dp - 1) / dp * e * n / rt.dp_bytes_per_s
        return t

    def limit(self, i: int, headroom: bool = True) -> int:
        """Bytes card ``i`` may be filled to: ``capacity * (1 - headroom)`` (``headroom=False``: the capacity)."""
        cap = self.cards[i].capacity_bytes
        return int(cap * (1.0 - self.headroom)) if headroom else cap

    def max_resident(self, i: int, n: int, headroom: bool = True) -> int:
        """Most resident layers (0..n) within :meth:`limit`, or -1 if none; every count is checked, since
        memory may grow or fall with it (cpu at fp32: 8 B/param resident against 12 B offloaded)."""
        cap = self.limit(i, headroom)
        for r in range(n, -1, -1):
            if self.cost(i, n, r).mem["total"] <= cap:
                return r
        return -1

    def phase(self, costs: Sequence[StageCost]) -> float:
        """Seconds of the pipeline phase: the end of the schedule's timeline with the stages' ``t_f, t_b, t_w``,
        times the average slot stretch of oversubscribed cpu cores."""
        return self.timeline(costs)[0]

    def timeline(self, costs: Sequence[StageCost]) -> tuple[float, list[float]]:
        """``(phase seconds, per card the boundary-copy seconds its own thread spends)``: the schedule's timeline with
        the stages' ``t_f, t_b, t_w``, the copies of cards in :attr:`overlapped` in their copy threads
        (:func:`~npu_train.pipeline.schedule.copy_timeline`), the others' inside ``t_f, t_b`` (all of
        :meth:`card_copies` in the card's thread); times the average slot stretch of oversubscribed cpu cores."""
        M = self.shape.micro_batches
        t_v = [c.t_vparts for c in costs] if self.shape.vocab_parallel else None
        lat = self.vocab_latency() if self.shape.vocab_parallel else (0.0, 0.0, 0.0)
        stretch = self.slots / (M + self.P - 1)
        dur = self.stage_durations(costs)
        if not any(self.overlapped):
            end, _ = stage_timeline(self.shape.schedule, self.P, M, *dur, t_v=t_v, lat=lat)
            exposed = [M * sum(c.t_copy) for c in costs]
        else:
            end, _, exposed = copy_timeline(self.shape.schedule, self.P, M, *dur, self.copy_parts(), t_v=t_v, lat=lat)
            exposed = [e + M * sum(c.t_copy) for e, c in zip(exposed, costs)]
        return max(end) * stretch, [e * stretch for e in exposed]

    def phase_floor(self, costs: Sequence[StageCost]) -> float:
        """A lower bound of :meth:`timeline`'s phase (seconds), cheaper where the cards copy in copy threads
        (:attr:`overlapped`; the timeline itself otherwise): the schedule's timeline with the same durations and
        no copies (:func:`~npu_train.pipeline.schedule.stage_timeline`). In
        :func:`~npu_train.pipeline.schedule.copy_timeline` every action is placed in the same order, starts no
        earlier than its card's previous action ends and its inputs' actions end, and lasts as long, so each
        ends no earlier there (each sum and max rounds monotonically, so in floating point too)."""
        M = self.shape.micro_batches
        t_v = [c.t_vparts for c in costs] if self.shape.vocab_parallel else None
        lat = self.vocab_latency() if self.shape.vocab_parallel else (0.0, 0.0, 0.0)
        end, _ = stage_timeline(self.shape.schedule, self.P, M, *self.stage_durations(costs), t_v=t_v, lat=lat)
        return max(end) * (self.slots / (M + self.P - 1))

    def copy_parts(self) -> list[tuple]:
        """Per virtual stage ``(F in, F out, B in, B out)`` seconds of its boundary copies (:meth:`boundary_parts`)
        where its card runs them in a copy thread (:attr:`overlapped`), zeros elsewhere (there they are in
        ``t_f, t_b``). The same for every split: made once (the split search's timelines each need it)."""
        parts = self._cache.get("copy_parts")
        if parts is None:
            V = self.memory.chunks * self.P
            parts = [self.boundary_parts(v) if self.overlapped[card_of(self.shape.schedule, self.P, v)[0]]
                     else (0.0, 0.0, 0.0, 0.0) for v in range(V)]
            self._cache["copy_parts"] = parts
        return list(parts)

    def boundary_parts(self, v: int) -> tuple[float, float, float, float]:
        """:meth:`boundary_copies` of virtual stage ``v`` by direction: ``(F receives, F sends, B receives,
        B sends)`` seconds per micro-batch."""
        sched, P = self.shape.schedule, self.P
        i, _ = card_of(sched, P, v)
        if self.cards[i].kind == "cpu":
            return 0.0, 0.0, 0.0, 0.0
        rt = self.rates[i]
        x = self.shape.boundary_bytes(self.model.hidden_size)
        V = self.memory.chunks * P
        prev = v > 0 and card_of(sched, P, v - 1)[0] != i
        nxt = v < V - 1 and card_of(sched, P, v + 1)[0] != i
        down, up = x / rt.d2h_bytes_per_s, x / rt.h2d_bytes_per_s
        return (up if prev else 0.0), (down if nxt else 0.0), (up if nxt else 0.0), (down if prev else 0.0)

    def boundary_copies(self, v: int) -> tuple[float, float]:
        """Seconds of virtual stage ``v``'s stage-boundary copies per micro-batch, ``(in its F, in its B)``: a
        neighbour on another card sends or receives one ``[b, S, H]`` tensor in the compute dtype (activation in
        F, its gradient in B) through the host: the sender copies it card -> host (``d2h``, into the shared-memory
        slot: ``TensorLink.send``), the receiver host -> card (``h2d``, out of the slot: ``TensorLink.recv``), both
        in the card process's own thread between its actions (``runtime/links.py``), so on its critical path. F
        receives the activation from ``v - 1`` and sends its own to ``v + 1``; B receives the gradient from
        ``v + 1`` and sends it to ``v - 1``; ZB-V's turn on the last card is an in-process hand-over (no copy).
        0 on a cpu card, whose copies are memory copies inside its fitted compute rate. With a copy thread
        (:attr:`overlapped`) the same seconds run there instead: :meth:`timeline`."""
        f_in, f_out, b_in, b_out = self.boundary_parts(v)
        return f_in + f_out, b_in + b_out

    def card_copies(self, i: int) -> tuple[float, float]:
        """Seconds of card ``i``'s stage-boundary copies per micro-batch, ``(in its F passes, in its B passes)``: the
        :meth:`boundary_copies` of its chunks (part of :attr:`StageCost.t_f` / ``t_b``); zeros on a card of
        :attr:`overlapped` (its copy thread's, priced by :meth:`timeline`)."""
        if self.overlapped[i]:
            return 0.0, 0.0
        V = self.memory.chunks * self.P
        mine = [self.boundary_copies(v) for v in range(V) if card_of(self.shape.schedule, self.P, v)[0] == i]
        return sum(f for f, _ in mine), sum(b for _, b in mine)

    def path_copies(self, i: int) -> tuple[float, float]:
        """Seconds of card ``i``'s boundary copies per micro-batch ``(F, B)`` that are on a micro-batch's path but not
        in its ``t_f, t_b``: its :meth:`boundary_copies` (chunk 0) on a card of :attr:`overlapped`, else zeros."""
        return self.boundary_copies(i) if self.overlapped[i] else (0.0, 0.0)

    def stage_durations(self, costs: Sequence[StageCost]) -> tuple[list, list, list]:
        """``(t_f, t_b, t_w)`` per stage for :func:`~npu_train.pipeline.schedule.stage_timeline`; with two chunks
        per card, per virtual stage: a card's layer time shared by its chunks (:meth:`chunk_fractions`: by their
        layers, the backward by where the layers recomputed whole are),
        the head's on the last virtual stage; each virtual stage with its own :meth:`boundary_copies`."""
        if self.memory.chunks == 1:  # the stage's copies are in its t_f, t_b
            return [c.t_f for c in costs], [c.t_b for c in costs], [c.t_w for c in costs]
        V = self.memory.chunks * self.P
        out: tuple = ([], [], [])
        for v in range(V):
            i, ch = card_of(self.shape.schedule, self.P, v)
            c = costs[i]
            fracs = self.chunk_fractions(c, ch)
            own = (*self.boundary_copies(v), 0.0) if not self.overlapped[i] else (0.0, 0.0, 0.0)  # copy thread's
            for k, (t, cp) in enumerate(zip((c.t_f, c.t_b, c.t_w), (*c.t_copy, 0.0))):
                out[k].append((t - cp - c.t_head[k]) * fracs[k] + (c.t_head[k] if v == V - 1 else 0.0) + own[k])
        return out

    def chunk_fractions(self, c: StageCost, ch: int) -> tuple[float, float, float]:
        """Shares of a two-chunk card's layer time ``(F, B, W)`` that its chunk ``ch`` runs: its layers' share
        (:func:`chunk_sizes`), except B under ``recompute_fewest``, whose layers recomputed whole are the card's first
        in execution order, chunk 0's first (``model/llama.py``'s ``recompute_layers``, as
        :meth:`~npu_train.planner.memory.MemoryModel.activations` holds them): chunk ``ch``'s
        ``k_c = min(k left, m_c)`` of them run the forward again, so its share of B is its layers' B FLOPs
        (:attr:`layer_fbw_parts`) over the card's."""
        n = c.layers
        if not n:
            return 0.5, 0.5, 0.5
        sizes = chunk_sizes(n)
        frac = sizes[ch] / n
        k = c.recomputed
        if k is None or not 0 < k < n:
            return frac, frac, frac
        (_, redo, _), (_, kept, _) = self.layer_fbw_parts
        kc = [min(k, sizes[0]), k - min(k, sizes[0])]
        b = [kc[j] * redo + (sizes[j] - kc[j]) * kept for j in range(2)]
        return frac, b[ch] / (b[0] + b[1]), frac

    def first_chunk_forward(self, c: StageCost, i: int) -> float:
        """Seconds of a micro-batch's forward through card ``i``'s first virtual stage (its chunk 0, never the
        head), with that virtual stage's own boundary copies: ``c.t_f`` with one chunk per card; the forwards of
        micro-batch 0 through the earlier cards' first chunks all come before a card's first action
        (:meth:`stage_durations`). With a copy thread (:attr:`overlapped`) the copies are not in ``c.t_f`` but still
        on micro-batch 0's path (a crossing adds its send and its receive, whichever thread makes them:
        :func:`~npu_train.pipeline.schedule.copy_timeline`)."""
        own = self.boundary_copies(i)[0]  # chunk 0 is virtual stage i on both two-chunk schedules
        if self.memory.chunks == 1:
            return c.t_f - c.t_copy[0] + own
        frac = chunk_sizes(c.layers)[0] / c.layers if c.layers else 0.5
        return (c.t_f - c.t_copy[0] - c.t_head[0]) * frac + own

    def step_time(self, split: Sequence[int], resident: Sequence[int]) -> float:
        """Predicted seconds per step of ``split`` with ``resident`` layers per card."""
        costs = [self.cost(i, n, r) for i, (n, r) in enumerate(zip(split, resident))]
        return max(t["total"] for t in self.stage_times(split, costs))

    def stage_times(self, split: Sequence[int], costs: Sequence[StageCost]) -> list[dict]:
        """Per stage, seconds per step: ``compute`` (with ``recompute`` and ``vocab``, its parts that run a forward
        again and the card's share of the joint vocabulary actions), ``boundary`` (its :meth:`card_copies`, inside
        the phase), ``bubble`` (the rest of the phase), ``host_optimizer``, ``device_optimizer``,
        ``transfer``, ``dp_comm``, ``host_hidden`` and ``total``; the step is the largest ``total``."""
        M = self.shape.micro_batches
        phase, copies = self.timeline(costs)
        out = []
        for i, (n, c) in enumerate(zip(split, costs)):
            host, dev, xfer = self.side_time(i, c)
            dpt = self.dp_time(i, c)
            # with cpu cards sharing cores: including the phase's average slowdown; the copies the card's own
            # thread makes (with a copy thread: only the inputs not fetched ahead)
            boundary = copies[i]
            compute = M * (c.t_mb - sum(c.t_copy)) * self.slots / (M + self.P - 1)
            first_input = sum(costs[j].t_f for j in range(i))  # the earlier stages' forward of micro-batch 0
            hidden = self.host_hidden(i, n, c, host, first_input, phase, phase - compute - boundary)
            out.append({"compute": compute, "recompute": M * c.t_rc * self.slots / (M + self.P - 1),
                        "vocab": M * c.t_v * self.slots / (M + self.P - 1),
                        "boundary": boundary, "bubble": phase - compute - boundary, "host_optimizer": host,
                        "device_optimizer": dev, "transfer": xfer - dpt, "dp_comm": dpt, "host_hidden": hidden,
                        "total": phase + host + dev + xfer - hidden})
        return out

    def build(self, split: list[int], resident: list[int]) -> Plan:
        """The :class:`Plan` of ``split`` (layers per card) with ``resident`` layers per card."""
        costs = [self.cost(i, n, r) for i, (n, r) in enumerate(zip(split, resident))]
        ranges = layer_ranges(self.shape.schedule, split)
        stages = []
        for i, (n, c, time) in enumerate(zip(split, costs, self.stage_times(split, costs))):
            layers = [x for a, b in ranges[i] for x in range(a, b)]
            stages.append(StagePlan(
                card=self.cards[i], first_layer=ranges[i][0][0], last_layer=ranges[i][0][1],
                has_embed=(i == 0), has_head=(i == self.memory.head_stage),
                resident=layers[:c.resident], offloaded=layers[c.resident:],
                mem=dict(c.mem), time=time, host_bytes=c.host_bytes, in_flight=c.in_flight,
                offloaded_state_bytes=c.offloaded_state_bytes,
                nonlayer_resident=c.nonlayer_resident, second=ranges[i][1] if len(ranges[i]) > 1 else None,
                recompute_layers=c.recomputed, heap_cap=c.heap_cap, heap_slack=c.heap_slack,
                heap_reserve=c.heap_reserve,
                head_shards=self.P if self.shape.vocab_parallel else 0,
            ))
        step = max(st.time["total"] for st in stages)
        fits = all(st.fits for st in stages)
        return Plan(self.model, self.shape, stages, step, self.shape.tokens_per_step * self.dp, fits,
                    rates=list(self.rates), threads=self.threads, host_cores=self.host_cores,
                    headroom=self.headroom, memory_terms=list(self.memory.terms), dp=self.dp, zero=self.zero)


def chunk_sizes(n: int) -> tuple[int, int]:
    """Layers of a card's two chunks when it holds ``n``: the first chunk takes the odd one (on ZB-V's card 0
    the second chunk also carries the head)."""
    return n - n // 2, n // 2


def layer_ranges(schedule: str, split: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Per card, its global layer ranges ``[(first, last)]`` (two for a two-chunk schedule: chunk 0, chunk 1),
    the layers laid out in virtual-stage order (:func:`~npu_train.pipeline.schedule.card_of`)."""
    from npu_train.pipeline.schedule import chunks_per_card

    P = len(split)
    C = chunks_per_card(schedule)
    if C == 1:
        starts = [sum(split[:i]) for i in range(P)]
        return [[(a, a + n)] for a, n in zip(starts, split)]
    out: list = [[None, None] for _ in range(P)]
    first = 0
    for v in range(C * P):
        i, ch = card_of(schedule, P, v)
        n = chunk_sizes(split[i])[ch]
        out[i][ch] = (first, first + n)
        first += n
    return out
