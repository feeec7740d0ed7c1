"""Memory model: what one card (= pipeline stage) holds, term by term.

Pure arithmetic, no tensors. It follows what the trainer's code allocates (the card process,
``optim/adamw.py``, ``model/llama.py``). ``e`` = bytes of the compute dtype (2 for bf16, 4 for
fp32); every term is a separate key of ``StagePlan.mem`` (bytes):

- ``baseline``: ``Rates.process_baseline_bytes``. For ``cpu`` cards the "device memory" is the
  card process's resident set size (RSS), so everything the process holds before it allocates
  model state counts: interpreter, torch and other libraries, gloo/ZeroMQ, the model-file reader
  (a GGUF reader stays cached with its parsed metadata and mapped file pages). ``calibrate``
  measures it in a fresh subprocess; the default is 0.35 GiB. For ``cuda``/``furiosa`` it is 0:
  their memory figures exclude the host process.
- ``weights``: ``e`` B/param for every parameter the stage computes with: its decoder layers,
  the input embedding on the first stage, the final norm and ``lm_head`` on the last stage. With
  tied embeddings and more than one stage the last stage holds a *copy* of the embedding matrix as
  its ``lm_head`` (the first stage owns it).
- ``grads``: gradient accumulators, ``RunShape.grad_bytes`` B/param for the same parameters as
  ``weights`` (gradients are accumulated on the card over the M micro-batches, then handed to
  the optimizer once per step): 4 B with fp32 accumulators (``grad_accum="fp32"``, default),
  ``e`` B when the ``.grad`` of the compute-dtype parameters accumulates (``"compute"``).
- ``optimizer``: fp32 master + AdamW m + v = 12 B/param for the parameters whose optimizer state
  lives on the card. The master is a separate fp32 copy (``StageOptimizer`` clones the loaded
  weights), except for *resident* parameters with fp32 compute on a ``cpu`` or ``cuda`` card, which
  are their own masters (``StageOptimizer.shared``): 8 B/param for those. The tied ``lm_head``
  copy has its own master and moments (the last stage's optimizer updates it with the all-reduced tied gradient), resident
  or offloaded like the stage's other non-layer parameters. On the card: the *resident*
  parameters; on a ``cpu`` card *all* of them, since the host RAM that holds "offloaded" state is
  the same RAM the card process's RSS counts.
- ``activations``: tensors autograd saves for the micro-batches in flight (see
  :func:`activation_bytes_per_layer`; :func:`in_flight_micro_batches` takes the count from the
  schedule's action list, :mod:`npu_train.pipeline.schedule`), plus on the last stage
  the fp32 log-probabilities that ``cross_entropy`` saves, ``b*s*V*4`` bytes per micro-batch in
  flight (:func:`saved_logits_bytes`). With a split backward (``zb``, ``zb-h1``, ``zb-h2``) a
  micro-batch between its ``B`` and ``W`` also keeps the gradients w.r.t. the outputs of the
  stage's linear layers until ``W`` (:func:`pending_grad_bytes_per_layer`), for the schedule's
  peak count of such micro-batches (``peak_pending_weight_grads`` of the action list; ZB-H2:
  ``2s+1`` on stage ``s``). ``ATTENTION[kind]`` selects the attention term: ``"sdpa"``
  (cpu, cuda: ``scaled_dot_product_attention``'s fused kernels save only the log-sum-exp) or
  ``"eager"`` (furiosa, conservative: the attention probabilities are saved).
- ``transient``: what the peak phase of a step adds on top, ``max(fwd/bwd, optimizer) + held``:

  * fwd/bwd phase, last stage: ``max(2*b*s*V*4, acc)``: the log-softmax backward holds its
    incoming and outgoing gradient (two fp32 logits-sized tensors), the ``lm_head`` backward
    the weight-gradient temporary ``acc``. With the fused head (``FUSED_HEAD_KINDS``,
    :mod:`npu_train.model.headops`) the cross-entropy's backward works in place on the saved
    log-probabilities (no logits-sized term) and, with fp32 gradients on a stage without the
    embedding, the head's weight gradient is added into ``.grad`` inside the matmul (``acc`` is then
    the largest layer parameter's). Other stages: ``max(0, acc - A)``, where ``acc = e *``
    (largest parameter of the stage) is the temporary of gradient accumulation (from the second
    micro-batch on, autograd computes a fresh gradient and adds it to ``.grad``); for the first
    stage that is the embedding, whose gradient appears at the end of a micro-batch's backward,
    when that micro-batch's activations ``A`` are already freed.
  * optimizer phase (activations freed, gradients alive): the larger of the gradient-norm
    temporary (``4 B`` or, for bf16 gradients, ``8 B`` x largest parameter) and the fp32
    master-gradient copies: with bf16 gradients 4 B/param for resident parameters
    (``grad.float()``; fp32 accumulators are used in place), the offloaded parameters' host copies
    ``host_copy`` when the host update runs serially (``RunShape.offload="serial"``, see below),
    plus, on a ``cpu`` card with offloaded parameters, one upload temporary (``e`` x largest
    parameter). With fp32 accumulators and bf16 compute the fwd/bwd phase's accumulation temporary
    ``acc`` is ``(e + 4)`` B x largest parameter (the micro-batch's compute-dtype gradient and its
    fp32 cast).
  * offloaded gradients' host copies, ``host_copy`` (``cpu`` cards only: elsewhere they are host
    RAM, not card memory): ``4 * offloaded params`` when the gradient is not fp32 (bf16 ``.grad``,
    ``grad_accum="compute"``) or the update is delayed; 0 otherwise, since the host update of a
    ``cpu`` card takes the final fp32 gradient itself (:class:`~npu_train.optim.offload.HostUpdater`
    ``in_place``). With the overlap (``"overlap"``, ``"delayed"``) the copies are made in the last
    micro-batch's backward and live until the layer's update, i.e. through the fwd/bwd peak: they
    are *held*; serially they appear after the backward (optimizer phase). Measured before the
    in-place update (SmolLM2-135M, fp32, card 0 of ``cpu,cpu`` with layers 10-19 and the embedding
    offloaded, 63.7 M params): the copies were 0.24 GiB that the model counted only in the
    optimizer phase, and the card's peak RSS was 3.35 GiB against a plan of 3.02 GiB; with the
    in-place update 3.09-3.20 GiB over nine steps of two runs against plans of 2.99-3.02 GiB
    (experiments/2026-12-01-offload-memory.md).
  * held: with tied embeddings on more than one stage, the tied gradient exchange
    (runtime/tied.py), on a ``cpu`` card (host RAM is card memory): ``4 * V*H``
    bytes, the first stage's fp32 receive buffer (allocated once, held through the step) or the
    last stage's fp32 copy of its dense gradient (none for an fp32 gradient: sent as is), plus
    ``(g + 4) * V*H`` when the gradient buffer
    is not fp32 (``g`` bytes per element; it is summed through an fp32 host copy and uploaded back;
    an fp32 buffer is summed in place); elsewhere the ``g * V*H`` device temporary.
    With the overlap, ``host_copy`` (above); on a ``cpu`` card with a delayed update and a
    compute dtype other than fp32 also the staged compute-dtype weights of the offloaded
    parameters, ``e`` B/param (made by the update during the next step, uploaded after its
    backward).
- ``workspace``: :class:`~npu_train.planner.memterms.MemoryTerms` of the card's kind
  (``DEFAULT_MEMORY_TERMS``, or a calibration profile's measured ``"memory"``): a constant for
  runtime / compiler / library buffers (CUDA context + cuBLAS workspace, RNGD runtime buffers),
  a fraction of the five terms above for allocator slack and temporaries not modelled, and the
  loaded-module cache of compiled execution (furiosa: ``loaded_modules * module_bytes``, also
  reported alone as ``mem["modules"]``, which is part of ``workspace``, not added again). For
  ``cpu`` the constant is 0 (the process baseline replaces it) and the fraction is glibc's
  allocator slack: freed heap blocks stay resident and autograd's churn of activation-sized
  blocks fragments the heap; measured with ``mallinfo2`` on SmolLM2-135M stages (fp32, 1-2
  threads): free-but-resident heap at the RSS peak = 6-17 % of the live bytes, 12 % used. The
  furiosa figures are fitted to the field record and named in the plan
  (:mod:`npu_train.planner.memterms`).

Non-layer parameters (embedding, final norm, ``lm_head`` and its tied copy) follow the
``nonlayer_resident`` flag of :func:`~npu_train.planner.search.make_plan`; the default (``None``)
makes them resident exactly when *all* the card's decoder layers are resident, i.e. offloading
starts with them (they are the largest single tensors and a card that offloads anything already
pays the host-optimizer path).

Within a card the resident layers are the *first* ones of the card's range and the offloaded ones
the last: backward runs last-to-first, so the offloaded layers' gradients are complete earliest,
which lets a trainer start their host optimizer soonest.

Host memory: ``host_bytes`` = 12 B/param (fp32 master + m + v) for the stage's offloaded params
(0 for ``cpu`` cards, whose offloaded state is already in the card's ``optimizer`` term).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from npu_train.hardware import FUSED_HEAD_KINDS, HOST_MEMORY_KINDS, SHARED_MASTER_KINDS, Card
from npu_train.model.config import LlamaConfig
from npu_train.pipeline.schedule import peak_in_flight, peak_pending_weight_grads
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS, MemoryTerms
from npu_train.planner.spec import RunShape

__all__ = ["ATTENTION", "WORKSPACE", "MEMORY_TERMS", "activation_bytes_per_layer", "logits_bytes",
           "saved_logits_bytes", "in_flight_micro_batches", "pending_grad_bytes_per_layer", "StageParams",
           "StageMemory", "MemoryModel"]

#: the memory terms of one card, in the order the plan prints them; ``total`` is their sum
MEMORY_TERMS = ("baseline", "weights", "grads", "optimizer", "activations", "transient", "workspace")
#: the terms the workspace fraction applies to
BODY_TERMS = ("weights", "grads", "optimizer", "activations", "transient")

#: Per-kind workspace defaults: (constant bytes, fraction of
#: weights+grads+optimizer+activations+transient), from
#: :data:`~npu_train.planner.memterms.DEFAULT_MEMORY_TERMS` (which also holds the furiosa
#: loaded-module cache and the source of every figure).
WORKSPACE: dict[str, tuple[int, float]] = {
    k: (int(t.workspace_bytes), t.workspace_fraction) for k, t in DEFAULT_MEMORY_TERMS.items()}

#: Attention implementation assumed for the activation memory of each kind (see
#: :func:`activation_bytes_per_layer`): the model calls ``scaled_dot_product_attention``, whose CPU
#: and CUDA kernels are fused (flash / memory-efficient: only the log-sum-exp is saved); for
#: furiosa the compiled kernel is not known, so the eager (probabilities saved) figure is kept.
ATTENTION: dict[str, str] = {"cpu": "sdpa", "cuda": "sdpa", "furiosa": "eager"}


def in_flight_micro_batches(stage: int, num_stages: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at peak.

    Taken from the schedule itself: the peak of (forwards run - backwards run) over the stage's
    action list (:func:`npu_train.pipeline.schedule.build_schedule` and ``peak_in_flight``), i.e.
    1F1B ``min(M, P - stage)``, GPipe ``M``.

    Raises:
        ValueError: unknown schedule or out-of-range arguments.
    """
    return peak_in_flight(schedule, stage, num_stages, micro_batches)


def activation_bytes_per_layer(model: LlamaConfig, shape: RunShape, attention: str = "eager") -> int:
    """Saved activations of one decoder layer for one micro-batch *without* recompute, bytes.

    ``attention="eager"`` (default; the figure used for furiosa): adapted from Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models"), whose
    ``s*b*h*(34 + 5*a*s/h)`` is for 16-bit GPT layers with dropout and a 4h GeLU MLP. For a Llama
    layer (no dropout, RMSNorm, grouped-query attention, SwiGLU) with ``e`` bytes per
    compute-dtype element, q = heads*head_dim, kv = kv_heads*head_dim, i = intermediate size:

    - two RMSNorms, input + output each: ``4*s*b*h*e``
    - rotated Q and the attention output (input of o_proj): ``2*s*b*q*e``
    - K and V at kv width (GQA-aware attention; an eager ``repeat_kv`` would save them at q width):
      ``2*s*b*kv*e``
    - attention probabilities, fp32 softmax output plus its compute-dtype copy for P@V
      (eager attention; a flash kernel would save only O(s) statistics): ``a*b*s*s*(4 + e)``
      (``4*a*b*s*s`` for fp32 compute, where the copy is the same tensor)
    - SwiGLU: gate output, up output, silu(gate), product (input of down_proj): ``4*s*b*i*e``

    For Llama-3.1-8B in bf16 that is ``s*b*h*(41 + 6*a*s/h)`` (Korthikanti: 34 + 5*a*s/h),
    136.3 MB at S=512, b=1.

    ``attention="sdpa"`` (cpu, cuda): exactly what autograd saves for
    :class:`npu_train.model.llama.DecoderLayer` when ``scaled_dot_product_attention`` runs a fused
    kernel (checked tensor by tensor with ``torch.autograd.graph.saved_tensors_hooks``, fp32 and
    bf16, excluding parameters and the shared RoPE tables), per token:

    - each RMSNorm: its fp32 input (the upcast; the input itself for fp32), the normalized value
      cast to the compute dtype and the output (input of the next projections): ``(4 + 2e)*h``,
      plus the fp32 ``rsqrt`` statistic, 4 B
    - attention: rotated Q, K and V as fed to the kernel (the model's ``repeat_kv`` expands K and
      V to q width) and the output (input of o_proj): ``4*e*q``, plus the fp32 log-sum-exp per
      head, ``4*a``
    - SwiGLU as above: ``4*e*i``

    i.e. ``s*b*(2*(4 + 2e)*h + 8 + 4*e*q + 4*a + 4*e*i)``: 12.20 MB for SmolLM2-135M at fp32,
    S=128, b=2 (the eager figure is 11.40 MB there: no s*s term, but wider norms and K/V).

    Raises:
        ValueError: ``attention`` is neither ``"eager"`` nor ``"sdpa"``.
    """
    s, b, e = shape.seq_len, shape.micro_batch, shape.dtype_bytes
    h, i = model.hidden_size, model.intermediate_size
    a = model.num_heads
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    if attention == "sdpa":
        return s * b * (2 * (4 + 2 * e) * h + 8 + 4 * e * q + 4 * a + 4 * e * i)
    if attention != "eager":
        raise ValueError(f"attention must be 'eager' or 'sdpa', got {attention!r}")
    linear = e * s * b * (4 * h + 2 * q + 2 * kv + 4 * i)
    scores = a * b * s * s * (4 + (e if e != 4 else 0))
    return linear + scores


def pending_grad_bytes_per_layer(model: LlamaConfig, shape: RunShape) -> int:
    """Bytes one micro-batch keeps per decoder layer between its input-gradient pass ``B`` and its
    weight-gradient pass ``W`` (:mod:`npu_train.pipeline.backward`: the gradient w.r.t. the output
    of every linear layer, recorded in ``B`` for ``dW = dY^T X`` in ``W``), in the compute dtype:
    ``s*b*e*(q + 2*kv + 2*h + 2*i)`` (q, k, v, o, gate, up, down projections); Qi et al. 2024,
    "Zero Bubble Pipeline Parallelism", section 3.1 keeps the same tensors for W. The last stage
    adds the ``lm_head``'s, ``s*b*e*V`` (:class:`MemoryModel`). With LoRA the recorded tensors are
    the adapters' outputs, smaller: the figure is then an upper estimate."""
    s, b, e = shape.seq_len, shape.micro_batch, shape.dtype_bytes
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    return s * b * e * (q + 2 * kv + 2 * model.hidden_size + 2 * model.intermediate_size)


def logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch: fp32 logits and their gradient, ``b*s*V*4*2`` bytes (the
    log-softmax backward's two logits-sized fp32 tensors, see the ``transient`` term)."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4 * 2


def saved_logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch in flight: the fp32 log-probabilities ``cross_entropy`` saves
    for its backward, ``b*s*V*4`` bytes (also with bf16 compute: the logits are cast to fp32)."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4


@dataclass(frozen=True)
class StageParams:
    """Parameter counts of one stage at one (layers, resident layers) choice.

    Attributes:
        computed: every parameter the stage computes with: its layers, the owned non-layer parameters
            (embedding on the first stage, final norm + ``lm_head`` on the last) and the tied ``lm_head`` copy.
        trainable: those with a gradient and AdamW state (all of them; LoRA: the adapters only).
        resident: trainable parameters whose fp32 master + moments live on the card (the first
            ``r`` layers of the stage; the non-layer ones when ``nonlayer_resident``).
        offloaded: trainable parameters whose master + moments live on the host.
        nonlayer_resident: where the non-layer parameters' optimizer state lives.
    """

    computed: int
    trainable: int
    resident: int
    offloaded: int
    nonlayer_resident: bool


@dataclass
class StageMemory:
    """Memory terms of one stage at one (layers, resident layers) choice.

    Attributes:
        mem: bytes per term (:data:`MEMORY_TERMS`) plus ``"total"`` and ``"modules"`` (the part of
            ``workspace`` that is the loaded-module cache).
        params: parameters the stage computes with (:attr:`StageParams.computed`).
        resident_params: trainable parameters whose master + moments live on the card.
        offloaded_params: those whose master + moments live on the host.
        nonlayer_resident: where the non-layer parameters' optimizer state lives.
        in_flight: micro-batches whose activations the stage holds at peak.
    """

    mem: dict
    params: int
    resident_params: int
    offloaded_params: int
    nonlayer_resident: bool
    in_flight: int


class MemoryModel:
    """Per-plan constants of the memory model and one method per memory term (bytes of one card);
    :meth:`stage` sums them.

    Args:
        model: architecture.
        shape: the run shape.
        cards: one card per stage, pipeline order.
        nonlayer_resident: see :class:`~npu_train.planner.request.PlanRequest`.
        terms: one :class:`~npu_train.planner.memterms.MemoryTerms` per card (``None``: the
            kind's defaults).
    """

    def __init__(self, model: LlamaConfig, shape: RunShape, cards: Sequence[Card],
                 nonlayer_resident: Optional[bool],
                 terms: Optional[Sequence[MemoryTerms]] = None):
        self.model, self.shape, self.cards = model, shape, list(cards)
        self.terms = list(terms) if terms is not None else [DEFAULT_MEMORY_TERMS[c.kind]
                                                           for c in self.cards]
        self.num_stages = len(self.cards)
        self.layer_params = model.params_per_layer()
        self.adapter_params = shape.lora_params_per_layer  # per layer; 0 = full fine-tuning
        self.embedding_params = model.embedding_params()
        self.dtype_bytes = shape.dtype_bytes
        self.grad_bytes = shape.grad_bytes
        self.tied = bool(model.tie_word_embeddings)
        self.nonlayer_flag = nonlayer_resident
        self.activations_per_layer = {a: activation_bytes_per_layer(model, shape, a) for a in ("eager", "sdpa")}
        self.layer_input_bytes = shape.seq_len * shape.micro_batch * model.hidden_size * self.dtype_bytes
        self.saved_logits = saved_logits_bytes(model, shape)
        # largest single tensor of a decoder layer (gate/up/down or q/o projection)
        q = model.num_heads * model.head_dim
        self.largest_layer_param = max(model.hidden_size * model.intermediate_size, model.hidden_size * q)
        self.in_flight = [in_flight_micro_batches(i, self.num_stages, shape.micro_batches, shape.schedule)
                          for i in range(self.num_stages)]
        #: micro-batches between B and W at peak, per stage (0 without a split backward)
        self.pending = [peak_pending_weight_grads(shape.schedule, i, self.num_stages, shape.micro_batches)
                        for i in range(self.num_stages)]
        self.pending_layer_bytes = pending_grad_bytes_per_layer(model, shape)
        self.pending_head_bytes = shape.seq_len * shape.micro_batch * self.dtype_bytes * model.vocab_size

    # ------------------------------------------------------------------ the sum
    def stage(self, i: int, n: int, r: int, baseline_bytes: float) -> StageMemory:
        """Memory terms of stage ``i`` holding ``n`` decoder layers of which ``r`` are resident, and their
        ``total``; ``baseline_bytes`` is the card process's ``Rates.process_baseline_bytes``."""
        p = self.parameters(i, n, r)
        activations = self.activations(i, n)
        mem = {"baseline": self.process_baseline(baseline_bytes), "weights": self.weights(p),
               "grads": self.gradients(p), "optimizer": self.optimizer_state(i, p), "activations": activations,
               "transient": self.transients(i, n, p, activations)}
        body = sum(mem[k] for k in BODY_TERMS)
        mem["workspace"] = self.workspace(i, body)
        mem["total"] = mem["baseline"] + body + mem["workspace"]
        mem["modules"] = self.terms[i].modules_bytes  # part of workspace
        return StageMemory(mem, p.computed, p.resident, p.offloaded, p.nonlayer_resident, self.in_flight[i])

    # ------------------------------------------------------------------ parameters
    def nonlayer(self, i: int) -> tuple[int, int]:
        """(owned non-layer params, tied-copy params) of stage ``i``: the embedding on the first stage; the
        final norm and the untied ``lm_head`` on the last, or with tied embeddings and more than one stage a
        copy of the embedding matrix as its ``lm_head`` (the first stage owns it)."""
        owned, copy = 0, 0
        if i == 0:
            owned += self.embedding_params
        if i == self.num_stages - 1:
            owned += self.model.hidden_size
            if not self.tied:
                owned += self.embedding_params
            elif self.num_stages > 1:
                copy += self.embedding_params
        return owned, copy

    def parameters(self, i: int, n: int, r: int) -> StageParams:
        """:class:`StageParams` of stage ``i`` with ``n`` layers, the first ``r`` resident. Non-layer
        parameters are resident as ``nonlayer_resident`` says (``None``: exactly when ``r == n``).
        LoRA: the frozen base is computed with but not trained; the adapters are."""
        owned, copy = self.nonlayer(i)
        nonlayer_resident = (r == n) if self.nonlayer_flag is None else bool(self.nonlayer_flag)
        if self.adapter_params:
            computed = n * (self.layer_params + self.adapter_params) + owned + copy
            trainable = n * self.adapter_params
            resident = r * self.adapter_params
        else:
            computed = n * self.layer_params + owned + copy
            trainable = computed
            resident = r * self.layer_params + (owned + copy if nonlayer_resident else 0)
        return StageParams(computed, trainable, resident, trainable - resident, nonlayer_resident)

    # ------------------------------------------------------------------ the terms (bytes)
    def process_baseline(self, baseline_bytes: float) -> int:
        """What the card process holds before any model state (``Rates.process_baseline_bytes``): cpu the
        RSS of interpreter, libraries and model-file reader; 0 for cuda/furiosa, whose figures exclude it."""
        return int(baseline_bytes)

    def weights(self, p: StageParams) -> int:
        """The compute-dtype copy of every parameter the stage computes with: ``dtype_bytes`` B/param."""
        return self.dtype_bytes * p.computed

    def gradients(self, p: StageParams) -> int:
        """Gradient accumulators of the trainable parameters, kept on the card over the M micro-batches:
        ``RunShape.grad_bytes`` B/param (4 with fp32 accumulators, the compute dtype's with ``grad_accum=compute``)."""
        return self.grad_bytes * p.trainable

    def optimizer_state(self, i: int, p: StageParams) -> int:
        """fp32 master + AdamW m + v on the card: 12 B/param for the resident parameters (a ``cpu`` card: all
        trainable ones, its host RAM is its memory), less 4 B/param where resident fp32 parameters are their
        own masters (``SHARED_MASTER_KINDS`` at fp32: ``optim.adamw.StageOptimizer.shared``)."""
        kind = self.cards[i].kind
        on_card = p.trainable if kind in HOST_MEMORY_KINDS else p.resident
        shared_masters = p.resident if self.dtype_bytes == 4 and kind in SHARED_MASTER_KINDS else 0
        return 12 * on_card - 4 * shared_masters

    def activations(self, i: int, n: int) -> int:
        """Tensors autograd saves for the micro-batches in flight (:func:`in_flight_micro_batches`): per layer
        :func:`activation_bytes_per_layer` (recompute: the layer inputs plus one layer's); on the last stage the
        saved fp32 log-probabilities (:func:`saved_logits_bytes`); with a split backward the output gradients
        kept from B to W for the schedule's peak count of such micro-batches
        (:func:`pending_grad_bytes_per_layer`, plus the ``lm_head``'s ``s*b*e*V`` on the last stage)."""
        k, last = self.in_flight[i], i == self.num_stages - 1
        if self.shape.recompute:
            total = k * n * self.layer_input_bytes + (self._activations_per_layer(i) if n else 0)
        else:
            total = k * n * self._activations_per_layer(i)
        if last:
            total += k * self.saved_logits
        if self.pending[i]:
            total += self.pending[i] * (n * self.pending_layer_bytes + (self.pending_head_bytes if last else 0))
        return total

    def transients(self, i: int, n: int, p: StageParams, activations: int) -> int:
        """What the peak phase of a step adds on top of the saved activations:
        ``max(forward/backward peak, optimizer-phase peak) - activations`` plus the buffers held through the
        whole step (:meth:`_held_through_the_step`)."""
        peak = max(self._forward_backward_peak(i, n, activations), self._optimizer_phase_peak(i, n, p))
        return peak - activations + self._held_through_the_step(i, p)

    def workspace(self, i: int, body: int) -> int:
        """Runtime / library buffers, allocator slack and the loaded-module cache of card ``i``'s kind
        (:meth:`MemoryTerms.workspace <npu_train.planner.memterms.MemoryTerms.workspace>` of ``body`` =
        weights + gradients + optimizer state + activations + transients)."""
        return self.terms[i].workspace(body)

    # ------------------------------------------------------------------ pieces of the transients
    def _activations_per_layer(self, i: int) -> int:
        return self.activations_per_layer[ATTENTION[self.cards[i].kind]]

    def _largest_trained_param(self, i: int, n: int) -> int:
        """Elements of the stage's largest trainable tensor: a layer's largest projection, the embedding /
        ``lm_head`` on the first and last stage; LoRA: one layer's adapters."""
        if self.adapter_params:
            return self.adapter_params if n else 0
        ends = i == 0 or i == self.num_stages - 1
        return max(self.largest_layer_param if n else 0, self.embedding_params if ends else 0)

    def _fused_head(self, i: int) -> bool:
        """The last stage runs the fused head (``FUSED_HEAD_KINDS``, :mod:`npu_train.model.headops`): the
        cross-entropy backward works in place, no logits-sized temporaries."""
        return i == self.num_stages - 1 and self.cards[i].kind in FUSED_HEAD_KINDS and not self.adapter_params

    def _accumulation_temporary(self, i: int, n: int) -> int:
        """From the second micro-batch on autograd computes a fresh gradient and adds it to ``.grad``: the
        largest trainable tensor in the compute dtype (+ its fp32 cast with fp32 accumulators and bf16
        compute). With the fused head at fp32 on a stage without the embedding the head's weight gradient is
        added inside the matmul, so only a layer's temporary is left. 0 without accumulation."""
        shape, e, g = self.shape, self.dtype_bytes, self.grad_bytes
        if not (shape.micro_batches > 1 or (self.num_stages == 1 and self.tied)):
            return 0
        if self._fused_head(i) and g == e == 4 and i != 0:
            elements = self.largest_layer_param if n else 0
        else:
            elements = self._largest_trained_param(i, n)
        return (e if g == e else e + 4) * elements

    def _forward_backward_peak(self, i: int, n: int, activations: int) -> int:
        """Peak of the forward/backward phase: on the last stage the log-softmax backward's two fp32
        logits-sized tensors (none with the fused head) or the accumulation temporary; elsewhere the
        accumulation temporary beyond one micro-batch's activations (freed when it appears: the first stage's
        embedding gradient comes at the end of a micro-batch's backward)."""
        acc = self._accumulation_temporary(i, n)
        if i == self.num_stages - 1:
            return activations + max(0 if self._fused_head(i) else 2 * self.saved_logits, acc)
        one_micro_batch = n * (self.layer_input_bytes if self.shape.recompute else self._activations_per_layer(i))
        return activations + max(0, acc - one_micro_batch)

    def _host_gradient_copies(self, i: int, p: StageParams) -> int:
        """fp32 host copies of the offloaded gradients on a host-memory card: ``4 B`` per offloaded param
        when the gradient is not fp32 or the update is delayed; 0 otherwise (the host update takes the final
        fp32 gradient itself, ``optim.offload.HostUpdater`` ``in_place``). Elsewhere they are host RAM."""
        host_memory = self.cards[i].kind in HOST_MEMORY_KINDS
        return 4 * p.offloaded if host_memory and (self.grad_bytes != 4 or self.shape.offload == "delayed") else 0

    def _optimizer_phase_peak(self, i: int, n: int, p: StageParams) -> int:
        """Peak of the optimizer phase (activations freed, gradients alive): the larger of the gradient-norm
        temporary (4 B, or 8 B for non-fp32 gradients, x the largest trainable tensor) and the fp32 master
        gradients: 4 B/param for resident parameters with non-fp32 gradients, the host copies when the host
        update runs serially, and on a host-memory card with offloaded parameters one upload temporary."""
        largest, e, g = self._largest_trained_param(i, n), self.dtype_bytes, self.grad_bytes
        norm_temporary = (4 if g == 4 else 8) * largest
        master_gradients = (self._host_gradient_copies(i, p) if self.shape.offload == "serial" else 0) \
            + (4 * p.resident if g != 4 else 0)
        if self.cards[i].kind in HOST_MEMORY_KINDS and p.offloaded:
            master_gradients += e * largest
        return max(norm_temporary, master_gradients)

    def _tied_gradient_buffers(self, i: int) -> int:
        """The tied-embedding gradient exchange (``runtime/tied.py``) on the first and last of several stages:
        on a host-memory card the first stage's fp32 receive buffer or the last stage's fp32 copy of a
        non-fp32 gradient (``4 V*H``), plus ``(g + 4) V*H`` for the host round trip of a non-fp32 buffer;
        elsewhere the ``g V*H`` device temporary. 0 with LoRA (the embedding is frozen)."""
        first, last = i == 0, i == self.num_stages - 1
        if not (self.tied and self.num_stages > 1 and (first or last)) or self.adapter_params:
            return 0
        g, vh = self.grad_bytes, self.embedding_params
        if self.cards[i].kind not in HOST_MEMORY_KINDS:
            return g * vh
        return (4 * vh if first or g != 4 else 0) + ((g + 4) * vh if g != 4 else 0)

    def _held_through_the_step(self, i: int, p: StageParams) -> int:
        """Buffers alive through the peak of both phases: the tied gradient buffers; with the overlap the host
        gradient copies (made in the last micro-batch's backward, alive until the layer's update); on a
        host-memory card with a delayed update and a compute dtype other than fp32 the staged compute-dtype
        weights of the offloaded parameters."""
        held = self._tied_gradient_buffers(i)
        if self.shape.offload != "serial":
            held += self._host_gradient_copies(i, p)
        if self.cards[i].kind in HOST_MEMORY_KINDS and self.shape.offload == "delayed" and self.dtype_bytes != 4:
            held += self.dtype_bytes * p.offloaded
        return held
