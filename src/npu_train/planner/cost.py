"""Cost model: predicted seconds per optimizer step of ``M`` micro-batches on ``P`` stages.

- ``t_i`` = compute time of stage i per micro-batch = FLOPs / ``Rates.device_flops``, FLOPs =
  ``6 * tokens * (params of the stage's layers + lm_head)`` + attention scores
  ``12 * s * (heads*head_dim) * tokens`` per layer, times 8/6 with recompute (one extra forward).
  The embedding lookup and norms count no FLOPs. ``device_flops`` is the *sustained training*
  rate (``calibrate`` measures it on a decoder layer's forward + backward, so element-wise work
  and framework overhead are in it); ``Rates.flops_by_dtype`` may give it per compute dtype. The
  ``lm_head`` + loss runs at ``device_flops * Rates.head_flops_ratio`` (measured: its GEMMs have
  one small dimension and the log-softmax spans the vocabulary).
- Per micro-batch, ``t_i`` splits into the forward ``t_F``, the input-gradient pass ``t_B`` and the
  weight-gradient pass ``t_W``; in a split-backward schedule (``zb*``) every stage but the first
  (which runs the full backward) has its layers' ``t_B`` and ``t_W`` stretched so that
  ``t_F + t_B + t_W`` is ``Rates.split_backward_ratio`` times the layer's forward + backward (the
  split's extra autograd passes cost seconds the FLOP count does not show) (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1):
  a decoder layer's linear layers cost 2 FLOPs/param/token in each (LoRA: the frozen base has no
  W; the adapters 2 each), attention's two matmuls ``4 s tokens q`` in F and ``8 s tokens q`` in B
  (it has no weights); recompute adds one forward to B. The last stage's ``lm_head`` + loss
  likewise (2/2/2 per param per token, at ``head_flops_ratio``); the first stage's embedding is a
  lookup (no FLOPs; its gradient is a scatter of ``tokens x h`` elements, ignored).
- Pipeline phase: the configured schedule's own timeline
  (:func:`npu_train.pipeline.schedule.stage_timeline` with every stage's ``t_F, t_B, t_W``: the
  schedule that runs, with unequal stages), the latest stage's end. Stage ``i`` is busy
  ``compute = M * t_i`` and idle ``bubble = phase - compute``; for equal stages under 1F1B that is
  the classical ``(M + P - 1) * t`` and bubble fraction ``(P-1)/(M+P-1)``.
- ``host_optimizer`` = offloaded params / ``Rates.host_adamw_params_per_s`` (each stage's process
  runs its own host AdamW, concurrently with the other stages').
- ``device_optimizer`` = resident params / ``Rates.device_adamw_params_per_s`` (the card's AdamW
  over its resident masters; on a ``cpu`` card that is the same fused CPU AdamW as the host's).
- ``transfer`` = offloaded params * ``e`` / ``h2d_bytes_per_s`` (updated weights back to the card)
  + offloaded params * ``e`` / ``d2h_bytes_per_s`` (accumulated gradients to the host), plus, with
  tied embeddings on more than one stage, the tied gradient's download and upload on the first and
  last stage. Stage-boundary activations (``s*b*h*e`` bytes per micro-batch and boundary, ~4 MB
  for 8B at S=512), the tied gradient's gloo transfers (the dense one runs during the first
  stage's drain, the sparse one is ``k*H*4`` bytes: the runtime's tied gradient exchange) and the
  gradient-norm pass are ignored.
- The device optimizer, the gradient downloads and the data-parallel communication are *not*
  overlapped with the pipeline (conservative). The offloaded layers' host AdamW + upload is, in part
  (``RunShape.offload``, :func:`exposed_host_time`): ``host_hidden`` = the part of
  ``host_optimizer + upload`` hidden behind the next step's forward (or, delayed, its whole step):
  stage total = pipeline phase + host_optimizer + device_optimizer + transfer - host_hidden; step
  time = max over stages.
- Data parallelism (``dp`` replicas of the pipeline, each card of a replica planned like replica
  0's): the per-card memory is unchanged, except that with ZeRO-1 (``zero=1``) each card keeps
  ``1/dp`` of its stage's fp32 master + AdamW moments (``optimizer`` and ``host_bytes`` divided by
  ``dp``, the workspace fraction of the removed bytes with them) and runs ``1/dp`` of the stage's
  AdamW (``host_optimizer``, ``device_optimizer``; the card<->host transfers of offloaded layers
  are kept whole, conservatively; so is the optimizer phase's ``transient``, which still counts
  fp32 gradient copies for all of the stage's resident masters, not only the card's 1/dp: with
  bf16 and many resident layers ZeRO-1's total is over-estimated). ``dp_comm`` = the gloo ring all-reduce of the stage's gradient
  in fp32 on the host, ``2 (dp-1)/dp * 4 B * params / Rates.dp_bytes_per_s`` (each process sends and
  receives that much; Patarasuk & Yuan 2009), plus on an accelerator the gradient's download and
  upload (``e * params`` each way at ``d2h``/``h2d``), plus with ZeRO-1 the broadcast of the updated
  compute-dtype weights, ``(dp-1)/dp * e * params / dp_bytes_per_s`` received per card. Not
  overlapped with anything (added to the stage total). Tokens per step are ``dp`` times one
  pipeline's.
- Threads: every card process runs ``threads`` torch threads (one number for the job,
  :func:`npu_train.planner.threads.threads_per_card`, which the launcher also gives the card
  processes); each card's :class:`~npu_train.planner.rates.Rates` are resolved for that count
  (:meth:`Rates.resolve <npu_train.planner.rates.Rates.resolve>`: the profile's figures measured
  at that count, else the nearest measured count scaled linearly). ``cpu`` cards share the
  host's ``host_cores``: when the cpu cards together run more threads than there are cores (3
  cpu cards on 2 cores), the pipeline phase counts its ``M + P - 1`` slots by occupancy: in slot
  j only the stages holding a micro-batch compute, and a slot whose computing cpu stages run
  ``a * threads > cores`` threads takes ``a * threads / cores`` times longer (so the
  sum of the slots' stretch factors, ``slots``, divided by ``M + P - 1`` is the average stretch
  that multiplies the schedule's timeline); the optimizers, which all run at the same time, get
  ``cores / (cpu cards * threads)`` of their rate. ``compute`` then includes the phase's average
  slowdown (``M * t_i * slots / (M + P - 1)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from npu_train.hardware import Card
from npu_train.model.config import LlamaConfig
from npu_train.pipeline.schedule import SPLIT_BACKWARD, stage_timeline
from npu_train.planner.memory import WORKSPACE, MemoryModel
from npu_train.planner.plan import Plan, StagePlan
from npu_train.planner.rates import Rates
from npu_train.planner.spec import RunShape

__all__ = ["StageCost", "CostModel"]


@dataclass
class StageCost:
    """Memory and compute of one stage at one (layers, resident layers) choice.

    Attributes:
        resident: resident decoder layers.
        nonlayer_resident: where the non-layer parameters' optimizer state lives.
        mem: memory terms, bytes (:mod:`npu_train.planner.memory`).
        host_params: params whose optimizer runs on the host (offloaded).
        device_params: params whose optimizer runs on the card (resident).
        xfer_params: params moved card<->host each step (each direction).
        t_mb: compute seconds per micro-batch (``t_f + t_b + t_w``).
        t_f, t_b, t_w: seconds per micro-batch of the forward, the input-gradient and the
            weight-gradient pass (module docstring).
        in_flight: micro-batches whose activations the stage holds at peak.
        host_state_on_card: cpu card: the offloaded state is in the card's memory.
        params: every parameter the stage computes with (what the data-parallel all-reduce moves).
        state_share: the fraction of the stage's optimizer state (and host bytes) this card holds:
            1, or ``1/dp`` with ZeRO-1.
    """

    resident: int
    nonlayer_resident: bool
    mem: dict
    host_params: int
    device_params: int
    xfer_params: int
    t_mb: float
    in_flight: int
    host_state_on_card: bool = False
    params: int = 0
    state_share: float = 1.0
    t_f: float = 0.0
    t_b: float = 0.0
    t_w: float = 0.0

    @property
    def host_bytes(self) -> int:
        """Host RAM for the offloaded fp32 master + AdamW m, v: 12 B/param (0 on a cpu card)."""
        return 0 if self.host_state_on_card else int(12 * self.host_params * self.state_share)


def exposed_host_time(mode: str, host_s: float, *, offloaded_layers: int, resident_layers: int,
                      fwd_layer_s: float, first_input_s: float, idle_s: float, cpu_card: bool) -> float:
    """Seconds of one stage's host update (``host_s`` = host AdamW + upload of its offloaded layers,
    per step) that the step still waits for, by ``RunShape.offload`` mode:

    - ``serial``: ``host_s`` (the update runs between the backward and the next forward).
    - ``overlap``: the update runs layer by layer in forward order from the moment the clip
      coefficient is known, ``h = host_s / o`` per offloaded layer (``o = max(1, offloaded_layers)``;
      the plan places the ``r = resident_layers`` resident layers first on the stage). The next
      step's forward reaches the stage after ``A = first_input_s`` (the upstream stages' forwards
      of the first micro-batch) and the k-th offloaded layer after ``A + (r + k) f``
      (``f = fwd_layer_s``, one layer's forward of one micro-batch); layer k is ready at
      ``(k + 1) h``. The forward's delay is ``D = max(0, max_k((k + 1) h - A - (r + k) f))``; the
      term is linear in k, so ``D = max(0, h - A - r f, o h - A - (r + o - 1) f)``. On a ``cpu``
      card the forward and the host AdamW share the card's cores, so only the idle wait hides host
      work: ``D = max(0, host_s - A)``.
    - ``delayed``: step t's update runs during step t+1's forward/backward (ZeRO-Offload's DPU):
      ``D = max(0, host_s - idle_s)`` with ``idle_s`` the time the host is free during the step (the
      pipeline phase on an accelerator card, the stage's bubble on a ``cpu`` card).

    Returns D in seconds (``0 <= D <= host_s``).
    """
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
    """Per-plan constants of the memory and time model, so the split search evaluates stages
    cheaply (results are cached per (stage, layers, resident layers)).

    Args:
        model, shape, cards: what is planned.
        rates: one :class:`Rates` per card (unresolved profiles or flat rates).
        nonlayer_resident: see :func:`~npu_train.planner.search.make_plan`.
        threads: torch threads per card process (>= 1).
        host_cores: cores the cpu cards share (>= 1).
        terms: one :class:`~npu_train.planner.memterms.MemoryTerms` per card (``None``: defaults).
        headroom: fraction of each card's capacity that :meth:`max_resident` (the ``auto``
            choice) keeps free, 0 <= headroom < 1.
        dp, zero: data-parallel replicas of the pipeline and the ZeRO stage (0 or 1); ``cards`` are
            one replica's.
    """

    def __init__(self, model: LlamaConfig, shape: RunShape, cards: Sequence[Card],
                 rates: Sequence[Rates], nonlayer_resident: Optional[bool], threads: int,
                 host_cores: int, terms: Optional[Sequence] = None, headroom: float = 0.0,
                 dp: int = 1, zero: int = 0):
        self.model, self.shape, self.cards = model, shape, list(cards)
        self.P = len(self.cards)
        self.dp, self.zero = int(dp), int(zero)
        self.memory = MemoryModel(model, shape, self.cards, nonlayer_resident, terms)
        self.headroom = float(headroom)
        self.threads, self.host_cores = int(threads), int(host_cores)
        cores = self.host_cores
        # every replica's cpu cards share the host (one node)
        n_cpu = self.dp * sum(1 for c in self.cards if c.kind == "cpu")
        # all cpu cards run their optimizers at the same time: each gets its share of the cores
        self.cpu_share = min(1.0, cores / (n_cpu * self.threads)) if n_cpu else 1.0
        self.rates = []
        for card, rt in zip(self.cards, rates):
            r = rt.resolve(shape.dtype, self.threads)
            if card.kind == "cpu":
                r.host_adamw_params_per_s *= self.cpu_share
                r.device_adamw_params_per_s *= self.cpu_share
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
        rc = 8.0 / 6.0 if shape.recompute else 1.0
        # 6 FLOPs/param/token: forward 2 + input gradient 2 + weight gradient 2 (Kaplan et al. 2020);
        # LoRA computes no weight gradient of the frozen base: 4 (+ 6 per adapter parameter)
        La = shape.lora_params_per_layer
        Pl = model.params_per_layer()
        attn = shape.seq_len * tok * model.num_heads * model.head_dim
        lin = 2.0 * (Pl + La) * tok  # one pass over the linear layers (base + adapters)
        f = lin + 4.0 * attn
        #: FLOPs per micro-batch of one decoder layer: (forward, input gradient, weight gradient)
        self.layer_fbw = (f, lin + 8.0 * attn + (f if shape.recompute else 0.0),
                          2.0 * (La if La else Pl) * tok)
        self.layer_flops = sum(self.layer_fbw)
        E2 = 2.0 * tok * model.embedding_params()
        #: FLOPs per micro-batch of the lm_head (+ loss): (forward, input gradient, weight gradient)
        self.head_fbw = (E2, E2 + (E2 if shape.recompute else 0.0), 0.0 if La else E2)
        self.head_flops = sum(self.head_fbw)
        self._cache: dict = {}

    def cost(self, i: int, n: int, r: int) -> StageCost:
        """Memory and per-micro-batch compute of stage ``i`` with ``n`` layers, ``r`` resident."""
        key = (i, n, r)
        c = self._cache.get(key)
        if c is not None:
            return c
        mm = self.memory
        rt = self.rates[i]
        sm = mm.stage(i, n, r, rt.process_baseline_bytes)
        first, last = i == 0, i == self.P - 1
        lora = self.shape.lora_params_per_layer > 0
        tied_copies = mm.tied and self.P > 1 and (first or last) and not lora  # the tied gradient down and up
        xfer = sm.offloaded_params + (mm.embedding_params if tied_copies else 0)
        fbw = [n * x / rt.device_flops for x in self.layer_fbw]
        if self.shape.schedule in SPLIT_BACKWARD and not first and n:
            # B + W of the zero-bubble split cost split_backward_ratio x (forward + backward) in
            # seconds, not FLOPs (measured per layer: Rates.split_backward_ratio); the first stage
            # runs the full backward
            f, b, w = fbw
            # (a ratio below f / (f + b + w) would mean a negative backward: k floored at 0)
            k = max(0.0, (rt.split_backward_ratio * (f + b + w) - f) / (b + w)) if b + w > 0 else 1.0
            fbw = [f, b * k, w * k]
        if last:
            fbw = [t + x / (rt.device_flops * rt.head_flops_ratio) for t, x in zip(fbw, self.head_fbw)]
        t_mb = sum(fbw)
        mem = dict(sm.mem)
        share = 1.0
        if self.zero and self.dp > 1:  # ZeRO-1: this card keeps 1/dp of the stage's optimizer state
            share = 1.0 / self.dp
            cut = mem["optimizer"] - int(mem["optimizer"] * share)
            ws_cut = int(cut * WORKSPACE[self.cards[i].kind][1])
            mem["optimizer"] -= cut
            mem["workspace"] -= ws_cut
            mem["total"] -= cut + ws_cut
        c = StageCost(r, sm.nonlayer_resident, mem, sm.offloaded_params, sm.resident_params,
                      xfer, t_mb, sm.in_flight, host_state_on_card=self.cards[i].kind == "cpu",
                      params=sm.params, state_share=share, t_f=fbw[0], t_b=fbw[1], t_w=fbw[2])
        self._cache[key] = c
        return c

    def side_time(self, i: int, c: StageCost) -> tuple[float, float, float]:
        """(host optimizer, device optimizer, transfer + data-parallel communication) seconds per
        step of stage ``i`` (the last term splits as :meth:`dp_time` + the card<->host transfer)."""
        rt = self.rates[i]
        host = c.host_params * c.state_share / rt.host_adamw_params_per_s
        dev = c.device_params * c.state_share / rt.device_adamw
        xfer = self.memory.dtype_bytes * c.xfer_params * (1.0 / rt.h2d_bytes_per_s + 1.0 / rt.d2h_bytes_per_s)
        return host, dev, xfer + self.dp_time(i, c)

    def hideable(self, i: int, c: StageCost, host: Optional[float] = None) -> float:
        """Seconds of stage ``i``'s step that the host-optimizer overlap can hide at most: its host
        AdamW (``host``, default from :meth:`side_time`) + the upload of the offloaded layers'
        weights; 0 with ``train.offload_overlap=false`` (``RunShape.offload == "serial"``)."""
        if self.shape.offload == "serial" or not c.host_params:
            return 0.0
        if host is None:
            host = self.side_time(i, c)[0]
        return host + self.memory.dtype_bytes * c.xfer_params / self.rates[i].h2d_bytes_per_s

    def host_hidden(self, i: int, n: int, c: StageCost, host: float, first_input: float, phase: float,
                    bubble: float) -> float:
        """Seconds of stage ``i``'s host AdamW + upload hidden behind other work
        (:func:`exposed_host_time`; ``n`` layers, ``host`` its host-AdamW seconds, ``first_input``
        the seconds until its first input arrives: the earlier stages' forward of one micro-batch). The forward is taken as 2 of the 6 FLOPs per
        parameter and token of a micro-batch's forward + backward (2 of 8 with recompute)."""
        work = self.hideable(i, c, host)
        fwd = 1.0 / (4.0 if self.shape.recompute else 3.0)
        cpu = self.cards[i].kind == "cpu"
        exposed = exposed_host_time(self.shape.offload, work, offloaded_layers=n - c.resident,
                                    resident_layers=c.resident, fwd_layer_s=fwd * c.t_mb / max(1, n),
                                    first_input_s=first_input, idle_s=bubble if cpu else phase, cpu_card=cpu)
        return work - exposed

    def dp_time(self, i: int, c: StageCost) -> float:
        """Seconds per step of stage ``i``'s data-parallel communication (module docstring): fp32
        ring all-reduce of the gradient, its card<->host copies on an accelerator, and with ZeRO-1
        the broadcast of the updated weights. 0 for ``dp == 1``."""
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
        """Bytes card ``i`` may be filled to: ``capacity * (1 - headroom)`` (``headroom=False``:
        the capacity)."""
        cap = self.cards[i].capacity_bytes
        return int(cap * (1.0 - self.headroom)) if headroom else cap

    def max_resident(self, i: int, n: int, headroom: bool = True) -> int:
        """Most resident layers (0..n) whose predicted total stays within :meth:`limit` of card
        ``i`` with ``n`` layers, or -1 if no count does. Memory may grow or fall with the resident
        count (a cpu card at fp32: 8 B/param of moments resident against 12 B of master + moments
        offloaded), so every count is checked, from ``n`` down."""
        cap = self.limit(i, headroom)
        for r in range(n, -1, -1):
            if self.cost(i, n, r).mem["total"] <= cap:
                return r
        return -1

    def phase(self, costs: Sequence[StageCost]) -> float:
        """Seconds of the pipeline phase (all forwards and backwards of a step) for one
        :class:`StageCost` per stage: the end of the configured schedule's
        :func:`~npu_train.pipeline.schedule.stage_timeline` with the stages' ``t_f, t_b, t_w``,
        times the average slot stretch of oversubscribed cpu cores (``slots / (M + P - 1)``, 1
        without oversubscription)."""
        M = self.shape.micro_batches
        end, _ = stage_timeline(self.shape.schedule, self.P, M, [c.t_f for c in costs],
                                [c.t_b for c in costs], [c.t_w for c in costs])
        return max(end) * self.slots / (M + self.P - 1)

    def step_time(self, split: Sequence[int], resident: Sequence[int]) -> float:
        """Predicted seconds per optimizer step of ``split`` with ``resident`` layers per card:
        :meth:`phase` + the largest per-stage optimizer, transfer and data-parallel time (what
        :meth:`build` reports as ``Plan.step_time_s``)."""
        costs = [self.cost(i, n, r) for i, (n, r) in enumerate(zip(split, resident))]
        return max(t["total"] for t in self.stage_times(split, costs))

    def stage_times(self, split: Sequence[int], costs: Sequence[StageCost]) -> list[dict]:
        """Per stage, seconds per step: ``compute``, ``bubble``, ``host_optimizer``,
        ``device_optimizer``, ``transfer``, ``dp_comm``, ``host_hidden`` and their ``total``
        (phase + optimizers + transfers - the host time hidden by the overlap); the step is the
        largest ``total``. One formula for :meth:`step_time` (the split search) and :meth:`build`."""
        M = self.shape.micro_batches
        phase = self.phase(costs)
        out = []
        for i, (n, c) in enumerate(zip(split, costs)):
            host, dev, xfer = self.side_time(i, c)
            dpt = self.dp_time(i, c)
            # with cpu cards sharing cores: including the phase's average slowdown
            compute = M * c.t_mb * self.slots / (M + self.P - 1)
            first_input = sum(costs[j].t_f for j in range(i))  # the earlier stages' forward of micro-batch 0
            hidden = self.host_hidden(i, n, c, host, first_input, phase, phase - compute)
            out.append({"compute": compute, "bubble": phase - compute, "host_optimizer": host,
                        "device_optimizer": dev, "transfer": xfer - dpt, "dp_comm": dpt, "host_hidden": hidden,
                        "total": phase + host + dev + xfer - hidden})
        return out

    def build(self, split: list[int], resident: list[int]) -> Plan:
        """The :class:`Plan` of ``split`` (layers per card) with ``resident`` layers per card."""
        costs = [self.cost(i, n, r) for i, (n, r) in enumerate(zip(split, resident))]
        stages, first = [], 0
        for i, (n, c, time) in enumerate(zip(split, costs, self.stage_times(split, costs))):
            stages.append(StagePlan(
                card=self.cards[i], first_layer=first, last_layer=first + n,
                has_embed=(i == 0), has_head=(i == self.P - 1),
                resident=list(range(first, first + c.resident)),
                offloaded=list(range(first + c.resident, first + n)),
                mem=dict(c.mem), time=time, host_bytes=c.host_bytes, in_flight=c.in_flight,
                nonlayer_resident=c.nonlayer_resident,
            ))
            first += n
        step = max(st.time["total"] for st in stages)
        fits = all(st.fits for st in stages)
        return Plan(self.model, self.shape, stages, step, self.shape.tokens_per_step * self.dp, fits,
                    rates=list(self.rates), threads=self.threads, host_cores=self.host_cores,
                    headroom=self.headroom, memory_terms=list(self.memory.terms), dp=self.dp, zero=self.zero)
