"""Memory model: what one card (= pipeline stage) holds, term by term, in bytes.

:class:`MemoryModel` has one method per term (weights, gradients, optimizer state, activations,
transients, workspace, process baseline); :meth:`MemoryModel.stage` sums them. The formulas and the
sources of their figures: ``docs/planner.md``, section 1."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from npu_train.hostmem import heap_guard_available
from npu_train.hardware import FUSED_HEAD_KINDS, HOST_MEMORY_KINDS, SHARED_MASTER_KINDS, Card, host_bf16_matmul
from npu_train.model.config import LlamaConfig
from npu_train.pipeline.schedule import (SPLIT_BACKWARD, card_of, chunks_per_card, held_profile, peak_held_bytes,
                                         peak_in_flight, peak_pending_weight_grads, virtual_stage)
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS, MemoryTerms
from npu_train.planner.moe import (expert_kernel_bytes, largest_layer_tensor, mlp_pending_bytes_per_token,
                                  mlp_saved_bytes_per_token)
from npu_train.planner.spec import RunShape, copies_overlapped

__all__ = ["ATTENTION", "WORKSPACE", "MEMORY_TERMS", "activation_bytes_per_layer", "attention_transient_bytes",
           "logits_bytes",
           "saved_logits_bytes", "in_flight_micro_batches", "pending_grad_bytes_per_layer", "StageParams",
           "StageMemory", "MemoryModel", "LAYER_FREED_FACTOR", "HEAP_RESIDUE"]

#: the memory terms of one card, in the order the plan prints them; ``total`` is their sum
MEMORY_TERMS = ("baseline", "weights", "grads", "optimizer", "activations", "transient", "workspace")
#: the terms the workspace fraction applies to
BODY_TERMS = ("weights", "grads", "optimizer", "activations", "transient")

#: Bytes one decoder layer frees between two heap-guard checks (its forward's temporaries; its backward's
#: allocations), in units of the layer's saved activations of one micro-batch (:func:`activation_bytes_per_layer`,
#: ``sdpa``), plus one fresh gradient of its largest trained tensor (full fine-tuning) and :data:`HEAP_RESIDUE`
#: bytes: what a card's RSS can pass live + the guard's cap + slack by before the next check
#: (:meth:`MemoryModel.hole_churn`; measured with ``experiments/bench/heap_holes.py --guard-cap 0``: at most 1.3
#: layers' activations beyond the other two parts, in ``experiments/2026-12-06-plan-bound.md``)
LAYER_FREED_FACTOR = 2.0
#: Bytes a trim leaves resident regardless of the layer size (the first page of every free chunk, the small-block
#: bins ``malloc_trim`` does not touch)
HEAP_RESIDUE = 32 * 2**20

#: Bytes the attention core's checkpoint (``recompute_attention``) keeps of the CPU generator's state while it
#: recomputes (``torch.utils.checkpoint`` preserves the RNG state: ``torch.get_rng_state()``, a 5056-byte uint8
#: tensor), a part of :func:`attention_transient_bytes`
CHECKPOINT_RNG_STATE = 5056

#: Per-kind workspace defaults: (constant bytes, fraction of
#: weights+grads+optimizer+activations+transient), from
#: :data:`~npu_train.planner.memterms.DEFAULT_MEMORY_TERMS` (which also holds the furiosa
#: loaded-module cache and the source of every figure).
WORKSPACE: dict[str, tuple[int, float]] = {
    k: (int(t.workspace_bytes), t.workspace_fraction) for k, t in DEFAULT_MEMORY_TERMS.items()}

#: Attention implementation assumed for the activation memory of each kind (see
#: :func:`activation_bytes_per_layer`): the model calls ``scaled_dot_product_attention``, whose CPU
#: and CUDA kernels are fused (flash / memory-efficient: only the log-sum-exp is saved; on CPU checked for the
#: causal, packed-row and GQA cases, fp32 and bf16); furiosa-torch runs it as ATen's math kernel
#: (``_scaled_dot_product_attention_math``, op by op), which keeps the probabilities: the ``eager`` figure.
ATTENTION: dict[str, str] = {"cpu": "sdpa", "cuda": "sdpa", "furiosa": "eager"}


def in_flight_micro_batches(stage: int, num_stages: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations stage ``stage`` (0-based) of ``num_stages`` holds at peak, from
    the schedule's action list (1F1B ``min(M, P - stage)``, GPipe ``M``). Raises ``ValueError`` for an
    unknown schedule or out-of-range arguments."""
    return peak_in_flight(schedule, stage, num_stages, micro_batches)


def activation_bytes_per_layer(model: LlamaConfig, shape: RunShape, attention: str = "eager") -> int:
    """Saved activations of one decoder layer for one micro-batch without recompute, bytes.

    ``e`` bytes of the compute dtype, ``h`` the hidden size, ``q``/``kv`` the query/key widths (heads x head_dim),
    ``a`` query heads, ``i`` the intermediate size; per token ``mlp`` = ``4*e*i`` for a dense SwiGLU MLP, a
    mixture-of-experts layer's :func:`~npu_train.planner.moe.mlp_saved_bytes_per_token` (routed experts bounded by
    ``k`` x tokens, router, shared expert); ``docs/planner.md``, "Activations per layer".

    ``attention="sdpa"`` (fused kernel, as checked with ``saved_tensors_hooks``):
    ``s*b*(2*(4 + 2e)*h + 8 + 4*e*q + 4*a + mlp)``: each RMSNorm its fp32 input, normalized value and output plus
    a 4 B statistic; q, k, v as fed to the kernel (:class:`~npu_train.model.llama.Attention` expands k and v to
    ``q`` width, HF ``repeat_kv``) and its output; the fp32 log-sum-exp per head.

    ``attention="eager"`` (the kernel keeps the probabilities: RNGD, where furiosa-torch runs
    ``scaled_dot_product_attention`` as ATen's composite ``_scaled_dot_product_attention_math``; a cpu/cuda run
    forced onto that kernel): ``s*b*(2*(4 + 2e)*h + 8 + (12 + e)*q + mlp) + 4*a*b*s*s``. From the math kernel
    (``aten/src/ATen/native/transformers/attention.cpp``, checked on torch 2.13; furiosa-torch pins 2.10, not checked
    here): it takes bf16/fp16 q, k, v ``.to(float)`` ("keep query, key, value in high precision"), scales q and
    ``k^T`` by ``sqrt(scale)`` each (new tensors), ``matmul`` saves both (fp32, ``4*q`` each per token, k at q width),
    ``_safe_softmax`` saves its fp32 output, the probabilities ``[b, a, s, s]``, 4 B each, the second ``matmul``
    saves them again by reference and the fp32 v (``4*q``); its output goes back ``.to`` the compute dtype and
    ``o_proj`` saves it (``e*q``). Nothing of it is kept in the compute dtype beside that output: the
    probabilities' ``.to(origin_dtype)`` copy is a returned output SDPA drops. So ``(12 + e)*q`` per token where
    the fused kernel keeps ``4*e*q + 4*a``: equal at fp32, ``6*q`` more at bf16, plus the probabilities; GQA or
    not, the kernel sees k and v at ``q`` width. Checked tensor by tensor with ``saved_tensors_hooks`` under
    ``sdpa_kernel(SDPBackend.MATH)``, fp32/bf16, with and without GQA (``tests/unit/test_eager_activations.py``);
    RSS from outside: ``experiments/2026-12-06-eight-cards.md`` §12.4.1. (transformers' ``eager_attention_forward``
    would keep a compute-dtype copy of the probabilities as well, ``e*a*b*s*s`` more at bf16; the project's model
    never calls it.)

    Qwen3's per-head q/k norms (``model.qk_norm``) also save their fp32 input (the projection's output ``.float()``:
    a copy at bf16, the same tensor at fp32), the normalized value in the compute dtype and a 4 B statistic per
    head, ``+ s*b*((4 + e)*(q + kv) + 4*(a + a_kv))`` (``a_kv`` key/value heads; their output goes to RoPE, which
    keeps only its tables; ``2*e`` a value at fp32 as before, ``6`` at bf16 where ``2*e`` under-counted by
    ``2*(q + kv)``: ``tests/unit/test_model_families.py``). Qwen2's q/k/v biases save nothing more.
    ``attention="core"``: the attention core recomputed (``RunShape.recompute_attention``,
    :class:`~npu_train.model.llama.Attention`), whatever the kernel: the checkpoint keeps the core's inputs q, k, v
    and ``o_proj`` the output, nothing of the kernel's own: the ``sdpa`` figure less its log-sum-exp ``4*a*s*b``
    (checked with ``saved_tensors_hooks``). Raises ``ValueError`` for another ``attention``."""
    s, b, e = shape.seq_len, shape.micro_batch, shape.dtype_bytes
    h = model.hidden_size
    mlp = mlp_saved_bytes_per_token(model, e)  # 4*e*i for a dense MLP
    a = model.num_heads
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    qk_norm = s * b * ((4 + e) * (q + kv) + 4 * (a + model.num_kv_heads)) if model.qk_norm else 0
    norms = 2 * (4 + 2 * e) * h + 8  # two RMSNorms, per token
    if attention in ("sdpa", "core"):
        lse = 4 * a if attention == "sdpa" else 0
        return s * b * (norms + 4 * e * q + lse + mlp) + qk_norm
    if attention != "eager":
        raise ValueError(f"attention must be 'eager', 'sdpa' or 'core', got {attention!r}")
    probabilities = 4 * a * b * s * s  # fp32 softmax output, whatever the compute dtype
    return s * b * (norms + (12 + e) * q + mlp) + probabilities + qk_norm


def attention_transient_bytes(model: LlamaConfig, shape: RunShape, core: bool) -> int:
    """Bytes one decoder layer's backward allocates on top of its held graph (as :func:`activation_bytes_per_layer`
    counts it) on a card whose attention runs the math kernel (``eager``, :data:`ATTENTION`), one micro-batch;
    weight gradients not included (the ``grads`` term and the accumulation temporary count them); ``core``: the
    attention core recomputed in that backward (``RunShape.recompute_attention``). An upper bound at every
    sequence length: the larger of the layer's two backward phases.

    ``t = s*b`` tokens, ``P = 4*a*b*s*s`` (one layer's fp32 probabilities ``[b, a, s, s]``, 4 B whatever the
    compute dtype), ``q`` the query width (heads x head_dim), ``e`` bytes of the compute dtype, ``h`` the hidden
    size, ``i`` the dense MLP's width. From autograd's formulas for the ops (``tools/autograd/derivatives.yaml``;
    ``_scaled_dot_product_attention_math`` in ``aten/src/ATen/native/transformers/attention.cpp``, torch 2.13), in
    the order the engine runs them, checked allocation by allocation with ``torch.profiler(profile_memory=True)``
    (fp32/bf16, GQA or not, head_dim 64/128, s 16-1024: ``tests/unit/test_attention_transient.py``):

    1. the MLP's backward, nothing of the layer freed yet: ``down_proj``'s input gradient ``[t, i]`` (``e*i`` per
       token; its node then frees the SwiGLU product it saved, ``e*i``), then the product's two gradients
       (``grad * silu(gate)``, ``grad * up``) beside it: ``2*e*i*t``. The peak of the layer up to about
       ``s = 3*e*i / (4*a)`` tokens, where phase 2's ``2*P`` passes it and the credit below (Llama-3.1-8B bf16
       ~ 670, fp32 ~ 1340; Llama-3.2-1B bf16 ~ 380). (With ``down_proj`` frozen and no adapter on it, it saves
       no product: the layer holds ``e*i`` less than the figure and this phase is ``3*e*i*t``, the same sum. A
       sparse layer's MLP is :func:`~npu_train.planner.moe.expert_kernel_bytes`, its own candidate of the
       stage's transient; counted here for the model's dense layers.)
    2. the attention's backward, after the MLP and the second norm freed what the activation figure counts for
       them (the dense MLP's ``4*e*i``, the norm's ``(4 + 2e)*h + 4``) less the residual stream's gradient
       ``e*h`` they leave, and ``o_proj``'s backward freed its saved input (``e*q``): a credit
       ``c = (4*e*i + (4 + e)*h + 4 + e*q)*t`` (no MLP part for a model with sparse layers, whose figure is an
       upper estimate). On top of the layer's start, ``A - c``, ``A`` the largest of:

       - ``o_proj``'s gradient in fp32 (``4*q``: the ``.to`` backward's cast; the compute-dtype one freed), then
         the second matmul's (``attn @ v``, a ``bmm``) ``grad_v = attn^T @ grad`` (fp32, ``4*q``) and
         ``grad_attn = grad @ v^T`` (``P``): ``P + 8*q*t``, the attention's peak at ``s < head_dim``;
       - ``_safe_softmax``'s ``_softmax_backward_data(grad_attn, attn)``, a new ``P`` beside ``grad_attn`` and
         ``grad_v``, the fp32 v the matmul saved (``4*q``) and the fp32 ``o`` gradient freed by then: ``2*P``;
       - the first matmul's ``grad_q``, ``grad_k^T`` and ``grad_v`` (fp32, ``12*q*t``), then the casts back,
         ``repeat_kv``'s sum over the group (k and v at ``q`` width, GQA or not), RoPE's and the projections'
         backward, the probabilities and their gradients freed (measured 8-10 ``q*t``).

       With ``core`` the checkpoint first runs the kernel again beside the fp32 ``o`` gradient (``4*q``): its
       forward's peak holds fp32 copies of q, k, v at a 2-byte dtype (``12*q``; the inputs themselves at fp32),
       the scaled q and ``k^T`` (``8*q``), the causal mask (fp32 ``where``, ``4*s*s``), the scores and the
       softmax output (``2*P``), the softmax's ``-inf`` test (``P/4``, bool), its row test (``a*b*s``, bool) and
       0-d zero (4 B), and the checkpoint's saved CPU RNG state (5056 B, ``torch.get_rng_state()``):
       ``2.25*P + (12 + 12*[e < 4])*q*t + 4*s*s + a*b*s + 4 + 5056``; then it keeps ``P``, the scaled q and ``k^T``
       and the fp32 v (``12*q*t``) through the backward above: ``P + 12*q*t`` more than each candidate.

    Not counted: Qwen3's per-head q/k norms' backward (``q``- and ``kv``-wide fp32 temporaries after the kernel's;
    not measured); a packed-row mask's conversion; the host's bf16 matmul scratch (oneDNN packs the weight of a
    small bf16 ``mm`` in fp32-sized buffers: ~34 ``P`` at hidden 256, s = 16; none at hidden 2048), a cpu card's,
    not the math kernel's. Measured from outside: ``experiments/2026-12-06-plan-bound.md`` (2026-12-07) and
    ``experiments/2026-12-06-eight-cards.md`` §12.4.2.
    """
    s, b, e, h = shape.seq_len, shape.micro_batch, shape.dtype_bytes, model.hidden_size
    t = s * b
    probabilities = 4 * model.num_heads * b * s * s
    q = model.num_heads * model.head_dim * t
    dense = any(not model.is_moe_layer(j) for j in range(model.num_layers))
    mlp = 2 * e * model.intermediate_size * t if dense else 0
    credit = ((4 * e * model.intermediate_size if not model.is_moe else 0) + (4 + e) * h + 4) * t + e * q
    backward = max(probabilities + 8 * q, 2 * probabilities, 12 * q)
    if core:
        recompute = (9 * probabilities // 4 + (24 if e < 4 else 12) * q + 4 * s * s + model.num_heads * b * s + 4
                     + CHECKPOINT_RNG_STATE)
        backward = max(recompute, probabilities + 12 * q + backward)
    return max(mlp, backward - credit)


def pending_grad_bytes_per_layer(model: LlamaConfig, shape: RunShape) -> int:
    """Bytes one micro-batch keeps per decoder layer between its ``B`` and ``W`` passes (the output
    gradients of the q, k, v, o, gate, up, down projections): ``s*b*e*(q + 2*kv + 2*h + 2*i)`` (Qi et al. 2024,
    section 3.1); a mixture-of-experts layer's MLP part ``e*(h + 2i)`` is
    :func:`~npu_train.planner.moe.mlp_pending_bytes_per_token`. An upper estimate with LoRA."""
    s, b, e = shape.seq_len, shape.micro_batch, shape.dtype_bytes
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    return s * b * (e * (q + 2 * kv + model.hidden_size) + mlp_pending_bytes_per_token(model, e))


def logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch: fp32 logits and their gradient, ``b*s*V*4*2`` bytes."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4 * 2


def saved_logits_bytes(model: LlamaConfig, shape: RunShape) -> int:
    """Last stage, per micro-batch in flight: the fp32 log-probabilities ``cross_entropy`` saves,
    ``b*s*V*4`` bytes (also with bf16 compute)."""
    return shape.micro_batch * shape.seq_len * model.vocab_size * 4


@dataclass(frozen=True)
class StageParams:
    """Parameter counts of one stage at one (layers, resident layers) choice; ``trainable`` is
    ``computed`` (LoRA: the adapters only) and splits into ``resident`` + ``offloaded``."""

    computed: int  # layers + owned non-layer params + the tied lm_head copy
    trainable: int  # with a gradient and AdamW state
    resident: int  # master + moments on the card (the first r layers; non-layer ones when nonlayer_resident)
    offloaded: int  # master + moments on the host
    nonlayer_resident: bool


@dataclass
class StageMemory:
    """Memory of one stage at one choice: ``mem`` bytes per :data:`MEMORY_TERMS` key plus ``total``,
    ``modules`` (the loaded-module part of ``workspace``) and ``heap`` (its heap-hole part), the parameter
    counts, micro-batches in flight."""

    mem: dict
    params: int  # StageParams.computed
    resident_params: int
    offloaded_params: int
    nonlayer_resident: bool
    in_flight: int
    #: bytes of holes the card's heap guard lets stand (:meth:`MemoryModel.heap_cap`); None: no guard
    heap_cap: Optional[int] = None
    #: RSS growth past which the guard reads its live bytes again (:meth:`MemoryModel.heap_slack`); None: no guard
    heap_slack: Optional[int] = None
    #: bytes the guard's limit keeps free below the total for fresh pages the holes cannot serve
    #: (:meth:`MemoryModel.heap_reserve`); 0 without a guard
    heap_reserve: int = 0


class MemoryModel:
    """Per-plan constants of the memory model and one method per term (bytes of one card);
    ``terms``: one :class:`~npu_train.planner.memterms.MemoryTerms` per card (``None``: the kinds' defaults);
    ``threads``: torch threads of each card process (the experts' kernel widens per thread: :meth:`expert_kernel`)."""

    def __init__(self, model: LlamaConfig, shape: RunShape, cards: Sequence[Card],
                 nonlayer_resident: Optional[bool],
                 terms: Optional[Sequence[MemoryTerms]] = None, threads: int = 1):
        self.model, self.shape, self.cards = model, shape, list(cards)
        self.threads = max(1, int(threads))
        self.terms = list(terms) if terms is not None else [DEFAULT_MEMORY_TERMS[c.kind]
                                                           for c in self.cards]
        self.num_stages = len(self.cards)
        #: chunks per card (2: ZB-V, interleaved; in-flight counts are then chunk micro-batches) and the card
        #: holding the head (ZB-V: card 0, with the embedding)
        self.chunks = chunks_per_card(shape.schedule)
        self.head_stage = card_of(shape.schedule, self.num_stages, self.chunks * self.num_stages - 1)[0]
        self.layer_params = model.params_per_layer()
        self.adapter_params = shape.lora_params_per_layer  # per layer; 0 = full fine-tuning
        self.embedding_params = model.embedding_params()
        self.dtype_bytes = shape.dtype_bytes
        self.grad_bytes = shape.grad_bytes
        self.tied = bool(model.tie_word_embeddings)
        #: vocabulary parallelism (RunShape.vocab_parallel): every card holds a slice of the head's rows
        self.vocab = bool(getattr(shape, "vocab_parallel", False))
        if self.vocab and self.tied:
            from npu_train.planner.spec import PlacementError

            raise PlacementError("parallel.vocab=true shards an untied output layer over the cards; this model ties "
                                 "its embedding and head (tie_word_embeddings): use parallel.vocab=false")
        self.nonlayer_flag = nonlayer_resident
        #: a cpu card keeping freed memory can guard its heap here (:class:`~npu_train.hostmem.HeapGuard`)
        self.heap_guard = heap_guard_available()
        self.activations_per_layer = {a: activation_bytes_per_layer(model, shape, a) for a in ("eager", "sdpa", "core")}
        #: what the math attention kernel (``eager``) allocates in one layer's backward on top of the held graph,
        #: with the core recomputed there (``recompute_attention``) or not: :func:`attention_transient_bytes`
        self.attention_transient = {core: attention_transient_bytes(model, shape, core) for core in (False, True)}
        self.layer_input_bytes = shape.seq_len * shape.micro_batch * model.hidden_size * self.dtype_bytes
        self.saved_logits = saved_logits_bytes(model, shape)
        # packed rows: one [b, 1, S, S] additive mask in the compute dtype per micro-batch in flight
        # (shared by the stage's layers, npu_train.model.masks.additive_mask); 32 MiB per row at S = 4096, bf16
        self.mask_bytes = (shape.micro_batch * shape.seq_len ** 2 * self.dtype_bytes
                           if getattr(shape, "packed", False) else 0)
        # largest single tensor of a decoder layer (gate/up/down, one expert's, a router or q/o projection)
        self.largest_layer_param = largest_layer_tensor(model)
        self.in_flight = [in_flight_micro_batches(i, self.num_stages, shape.micro_batches, shape.schedule)
                          for i in range(self.num_stages)]
        #: micro-batches between B and W at peak, per stage (0 without a split backward)
        self.pending = [peak_pending_weight_grads(shape.schedule, i, self.num_stages, shape.micro_batches)
                        for i in range(self.num_stages)]
        self.pending_layer_bytes = pending_grad_bytes_per_layer(model, shape)
        self.pending_head_bytes = shape.seq_len * shape.micro_batch * self.dtype_bytes * model.vocab_size

    # ------------------------------------------------------------------ the sum
    def stage(self, i: int, n: int, r: int, baseline_bytes: float, k: Optional[int] = None) -> StageMemory:
        """Memory terms and ``total`` of stage ``i`` with ``n`` decoder layers, the first ``r`` resident;
        ``baseline_bytes``: ``Rates.process_baseline_bytes``; ``k``: layers recomputed whole
        (:meth:`recomputed`; None: the shape's all or none)."""
        p = self.parameters(i, n, r)
        activations = self.activations(i, n, k=k)
        mem = {"baseline": self.process_baseline(baseline_bytes), "weights": self.weights(p),
               "grads": self.gradients(p), "optimizer": self.optimizer_state(i, p), "activations": activations,
               "transient": self.transients(i, n, p, activations, k)}
        body = sum(mem[t] for t in BODY_TERMS)
        churn = self.hole_churn(i, n, k)
        load = self._load_excess(i, n, p, mem["weights"], body)  # the model load, where it is the peak
        mem["transient"] += load + self.overlap_bytes(i)
        body += load + self.overlap_bytes(i)
        mem["workspace"] = self.workspace(i, body, churn)
        mem["total"] = mem["baseline"] + body + mem["workspace"]
        mem["modules"] = self.terms[i].modules_bytes  # part of workspace
        mem["heap"] = int(self.terms[i].heap_fraction * churn)  # part of workspace
        return StageMemory(mem, p.computed, p.resident, p.offloaded, p.nonlayer_resident, self.in_flight[i],
                           self.heap_cap(i, n), self.heap_slack(i) if self.guarded(i) else None,
                           self.heap_reserve(i, n))

    def overlap_bytes(self, i: int) -> int:
        """Card bytes the copy thread of overlapped boundary copies holds beyond the synchronous path (part of
        ``transient``): two ``[b, S, H]`` boundary tensors in the compute dtype (:meth:`RunShape.boundary_bytes`), the
        next action's input fetched onto the card one action early and a gradient kept alive by its send in flight
        (``runtime/copies.py`` allows one of each); 0 without a neighbour on another card or with the copies in
        the card's own thread (:func:`~npu_train.planner.spec.copies_overlapped`)."""
        if self.num_stages < 2 or not copies_overlapped(self.shape, self.cards[i].kind):
            return 0
        return 2 * self.shape.boundary_bytes(self.model.hidden_size)

    # ------------------------------------------------------------------ parameters
    def nonlayer(self, i: int) -> tuple[int, int]:
        """(owned non-layer params, tied ``lm_head`` copy params) of stage ``i`` (vocabulary-parallel: every card
        owns its slice of the head's rows, :meth:`vocab_rows`)."""
        owned, copy = 0, 0
        if i == 0:
            owned += self.embedding_params
        if i == self.head_stage:
            owned += self.model.hidden_size
            if self.vocab:
                pass
            elif not self.tied:
                owned += self.embedding_params
            elif self.head_stage != 0:
                copy += self.embedding_params
        if self.vocab:
            owned += self.vocab_rows(i) * self.model.hidden_size
        return owned, copy

    def vocab_rows(self, i: int) -> int:
        """Vocabulary rows of the head card ``i`` holds under vocabulary parallelism: ``V // P``, one more on the
        first ``V % P`` cards (``torch.tensor_split``'s cut, as the cards load it); 0 without it."""
        if not self.vocab:
            return 0
        V, P = self.model.vocab_size, self.num_stages
        return V // P + (1 if i < V % P else 0)

    def vocab_transient(self, i: int) -> int:
        """Bytes card ``i``'s ``V(m)`` holds while it runs (vocabulary parallelism): its fp32 logits slice
        ``[b S, rows]`` and their softmax / gradient (2 x 4 B), the received final hidden state ``[b S, H]`` (compute
        dtype) and its fp32 copy, the fp32 partial input gradient, and (full fine-tuning) the slice's fresh fp32 weight gradient
        before it is added to ``.grad``."""
        if not self.vocab:
            return 0
        tok, h, rows = self.shape.tokens_per_micro_batch, self.model.hidden_size, self.vocab_rows(i)
        fresh = 0 if self.adapter_params else 4 * rows * h
        return 8 * tok * rows + (self.dtype_bytes + 8) * tok * h + fresh

    def parameters(self, i: int, n: int, r: int) -> StageParams:
        """:class:`StageParams` of stage ``i`` with ``n`` layers, the first ``r`` resident; non-layer parameters
        are resident as ``nonlayer_resident`` says (``None``: when ``r == n``)."""
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
        """The card process before any model state (cpu: its RSS; 0 on cuda/furiosa)."""
        return int(baseline_bytes)

    def weights(self, p: StageParams) -> int:
        """``e`` B/param for every parameter the stage computes with."""
        return self.dtype_bytes * p.computed

    def gradients(self, p: StageParams) -> int:
        """``RunShape.grad_bytes`` B/param for the trainable parameters."""
        return self.grad_bytes * p.trainable

    def optimizer_state(self, i: int, p: StageParams) -> int:
        """fp32 master + AdamW m, v: 12 B/param on the card (cpu: every trainable param), 8 B for resident
        fp32 params that are their own masters (``SHARED_MASTER_KINDS``)."""
        kind = self.cards[i].kind
        on_card = p.trainable if kind in HOST_MEMORY_KINDS else p.resident
        shared_masters = p.resident if self.dtype_bytes == 4 and kind in SHARED_MASTER_KINDS else 0
        return 12 * on_card - 4 * shared_masters

    def recomputed(self, n: int, k: Optional[int] = None) -> int:
        """Layers of a stage of ``n`` that are recomputed whole: ``k`` (``RunShape.recompute_fewest``: the card's
        first ``k`` in execution order, clamped to ``0..n``), else ``n`` under ``recompute`` and 0 without."""
        if k is not None:
            return max(0, min(int(n), int(k)))
        return n if self.shape.recompute else 0

    def held_per_micro_batch(self, i: int, n: int, k: Optional[int]) -> int:
        """Bytes one micro-batch leaves saved in ``n`` layers of stage ``i``, ``k`` of them recomputed whole
        (:meth:`recomputed`): ``k`` layer inputs ``[b, S, H]`` + ``(n - k)`` layers' activations."""
        kk = self.recomputed(n, k)
        return kk * self.layer_input_bytes + (n - kk) * self._activations_per_layer(i)

    def activations(self, i: int, n: int, head: bool = True, k: Optional[int] = None) -> int:
        """Saved tensors of the micro-batches in flight (packed rows: with their attention mask), the last
        stage's log-probabilities and, with a split backward, the output gradients kept from B to W;
        ``head=False``: without the head's ``[tokens, vocab]`` tensors (the decoder layers' part); ``k``:
        layers recomputed whole (:meth:`recomputed`), each holding its input and, one at a time in the
        backward, its recomputed activations."""
        head = head and not self.vocab  # vocabulary-parallel: the logits live only inside V(m)
        if k is not None:
            return self._partial_activations(i, n, head, k)
        k, last = self.in_flight[i], i == self.head_stage and head
        if self.chunks > 1:
            return self._chunked_activations(i, n, head)
        if self.shape.recompute:
            total = k * n * self.layer_input_bytes + (self._activations_per_layer(i) if n else 0)
        else:
            total = k * n * self._activations_per_layer(i)
        if n:
            total += k * self.mask_bytes
        if last:
            total += k * self.saved_logits
        if self.pending[i]:
            total += self.pending[i] * (n * self.pending_layer_bytes + (self.pending_head(i) if last else 0))
        return total

    def _partial_activations(self, i: int, n: int, head: bool, k: int) -> int:
        """:meth:`activations` with ``k`` of the ``n`` layers recomputed whole: the card's first ``k`` in execution
        order (a two-chunk card: chunk 0's layers first, the chunk holding more micro-batches)."""
        kk = self.recomputed(n, k)
        held, pend = self._held_per_chunk(i, n, head, kk)
        if self.chunks > 1:
            total = peak_held_bytes(self.shape.schedule, i, self.num_stages, self.shape.micro_batches, held, pend)
        else:
            total = self.in_flight[i] * held[0] + self.pending[i] * pend[0]
        if kk:
            total += self._activations_per_layer(i)  # one layer's recomputed activations at a time
        return int(total)

    def _chunked_activations(self, i: int, n: int, with_head: bool = True) -> int:
        """:meth:`activations` of a card holding two chunks (``n`` layers, shared as
        :func:`~npu_train.planner.cost.chunk_sizes`): the peak over its actions of what each chunk's micro-batches
        hold (:func:`~npu_train.pipeline.schedule.peak_held_bytes`; the head's saved log-probabilities on the last
        virtual stage's chunk)."""
        held, pend = self._held_per_chunk(i, n, with_head)
        total = peak_held_bytes(self.shape.schedule, i, self.num_stages, self.shape.micro_batches, held, pend)
        if self.shape.recompute and n:
            total += self._activations_per_layer(i)  # one layer's recomputed activations at a time
        return int(total)

    def _chunk_sizes(self, n: int) -> tuple:
        """Layers of each chunk of a card holding ``n`` (:func:`~npu_train.planner.cost.chunk_sizes`)."""
        return (n - n // 2, n // 2) if self.chunks > 1 else (n,)

    def _held_per_chunk(self, i: int, n: int, with_head: bool = True,
                        recomputed: Optional[int] = None) -> tuple[list, list]:
        """(bytes one micro-batch holds from its ``F`` to its last backward action, bytes it keeps from ``B`` to
        ``W``) per chunk of card ``i`` with ``n`` layers: the layers' saved tensors (a layer recomputed whole: its
        input), the packed rows' mask, and on the head's chunk the saved log-probabilities and the pending logits
        gradient. ``recomputed``: how many layers are recomputed whole, the card's first in execution order
        (chunk 0's first); None: all of them under ``train.recompute``, else none."""
        V = self.chunks * self.num_stages
        with_head = with_head and not self.vocab
        left = (n if self.shape.recompute else 0) if recomputed is None else recomputed
        act = self._activations_per_layer(i)
        held, pend = [], []
        for c, m in enumerate(self._chunk_sizes(n)):
            kc = min(left, m)
            left -= kc
            head = with_head and card_of(self.shape.schedule, self.num_stages, V - 1) == (i, c)
            saved = kc * self.layer_input_bytes + (m - kc) * act
            held.append(float(saved + (self.mask_bytes if m else 0) + (self.saved_logits if head else 0)))
            pend.append(float(m * self.pending_layer_bytes + (self.pending_head(i) if head else 0)))
        return held, pend

    def nonlayer_accumulation_peak(self, i: int, n: int) -> int:
        """Bytes stage ``i`` holds besides the parameters' state while a gradient of the embedding or of the
        head's weight (full fine-tuning) is added to an existing ``.grad``: the fresh ``[V, H]`` gradient (+ its
        fp32 cast where the gradients are kept in another dtype) on top of what the schedule holds at that action
        (:func:`~npu_train.pipeline.schedule.held_profile`), not on top of the activations' peak. 0 where no such
        addition happens.

        - the embedding: its gradient is the last thing the first virtual stage's ``B`` computes (a fresh
          ``[V, H]`` tensor from ``embedding_dense_backward``), after that micro-batch's layers freed their saved
          tensors: what the schedule holds *after* the action (+ one recomputed layer under ``train.recompute``).
          Every ``B`` but the step's first adds it, every one where the head's tied weight (same tensor, same
          card: ZB-V) may have made ``.grad`` first.
        - the head's weight (untied, or the tied copy on a later card): computed at the start of the head
          chunk's backward (``W`` when split: + the held bytes before and after, the larger; unsplit ``B``: before,
          + the fp32 logits' gradient). None on a card whose head adds ``dW`` into an fp32 ``.grad`` in place
          (``model/headops.py``, cpu and cuda, fp32 gradients and weights).

        A 0.63 B full fine-tuning card holding the tied embedding, the head and one layer (ZB-V, fp32) peaked 0.99
        GiB over its weights, gradients, optimizer state and baseline, the 0.98 GiB gradient with nothing held
        (``experiments/2026-12-06-plan-bound.md``)."""
        if self.adapter_params or self.cards[i].kind not in HOST_MEMORY_KINDS:
            return 0
        sched, P, M = self.shape.schedule, self.num_stages, self.shape.micro_batches
        e, g = self.dtype_bytes, self.grad_bytes
        fresh = (e if g == e else e + 4) * self.embedding_params
        held, pend = self._held_per_chunk(i, n)
        extra = self._activations_per_layer(i) if self.shape.recompute and n else 0
        V = self.chunks * P
        head_chunk = card_of(sched, P, V - 1)[1] if i == self.head_stage and not self.vocab else None
        head_in_place = self.cards[i].kind in FUSED_HEAD_KINDS and g == e == 4
        same_tensor = self.tied and head_chunk is not None and i == 0
        seen, peak = set(), 0
        for a, before, after in held_profile(sched, i, P, M, held, pend):
            vs = virtual_stage(sched, P, i, a.chunk)
            split = sched in SPLIT_BACKWARD and vs > 0
            events = []  # (tensor, bytes held when its fresh gradient exists; None: added in place)
            if a.chunk == head_chunk and a.kind == ("W" if split else "B"):  # first in the backward
                at = None if head_in_place else max(before, after) if split else before + self.saved_logits
                events.append(("embedding" if same_tensor else "head", at))
            if vs == 0 and a.kind == "B":  # the embedding's gradient, last; a split schedule's W of the first
                # virtual stage follows with nothing to do: its B freed the saved tensors, the output stays
                own = held[a.chunk] - self.layer_input_bytes if sched in SPLIT_BACKWARD else 0
                events.append(("embedding", after - own + extra))
            for key, at in events:
                if key in seen and at is not None:
                    peak = max(peak, int(at) + fresh)
                seen.add(key)
        return peak

    def pending_head(self, i: int) -> int:
        """Bytes the head's chunk keeps per micro-batch from its ``B`` to its ``W`` besides its saved tensors (which
        :meth:`activations` holds until the ``W``): the logits' gradient ``s*b*e*V`` for the head's weight gradient.
        0 with LoRA (the head is frozen: no ``W`` uses it) and on a card whose loss's backward works in place
        (``FUSED_HEAD_KINDS``, :func:`~npu_train.model.headops.cross_entropy_sum`) with fp32 compute: the gradient
        is then the saved log-probabilities' own storage (bf16 compute keeps its bf16 cast)."""
        in_place = self.cards[i].kind in FUSED_HEAD_KINDS and self.dtype_bytes == 4
        return 0 if self.adapter_params or in_place else self.pending_head_bytes

    def transients(self, i: int, n: int, p: StageParams, activations: int, k: Optional[int] = None) -> int:
        """``max(forward/backward peak, optimizer-phase peak) - activations`` + buffers held through the step
        (``k``: :meth:`recomputed`)."""
        peak = max(self._forward_backward_peak(i, n, activations, k), self._optimizer_phase_peak(i, n, p))
        return peak - activations + self._held_through_the_step(i, p)

    def guarded(self, i: int) -> bool:
        """Whether card ``i`` runs a heap guard (:class:`~npu_train.hostmem.HeapGuard`): a cpu card that keeps freed
        memory (``heap_fraction > 0``: ``runtime.keep_host_memory=true``) without ``train.recompute`` (which returns
        freed memory, ``hostmem.card_mmap_threshold``), where glibc offers ``mallinfo2`` and ``malloc_trim``."""
        return (self.cards[i].kind == "cpu" and self.terms[i].heap_fraction > 0 and not self.shape.recompute
                and self.heap_guard)

    def layer_freed(self, i: int) -> int:
        """Bytes the RSS of card ``i`` can pass live + the guard's cap + slack by between two checks (one layer's
        frees): :data:`LAYER_FREED_FACTOR` x one layer's saved activations of one micro-batch, + with full
        fine-tuning one fresh gradient of the largest layer tensor (each parameter's accumulation is checked after
        it, ``register_post_accumulate_grad_hook``; the ones before it in the layer's backward are freed), +
        :data:`HEAP_RESIDUE`."""
        fresh = 0 if self.adapter_params else max(self.dtype_bytes, self.grad_bytes) * self.largest_layer_param
        return int(LAYER_FREED_FACTOR * self._activations_per_layer(i)) + fresh + HEAP_RESIDUE

    def heap_slack(self, i: int) -> int:
        """RSS growth (bytes) past which card ``i``'s guard reads its live bytes again (``mallinfo2``, 0.3 ms with a
        few thousand free chunks; the RSS alone costs 0.02 ms): half a layer's saved activations of one
        micro-batch."""
        return int(self._activations_per_layer(i) // 2)

    def heap_cap(self, i: int, n: int) -> Optional[int]:
        """Bytes of heap holes the guard of card ``i`` (``n`` decoder layers) lets stand before it returns them
        (``StagePlan.heap_cap``): ``max(0, heap_fraction x churn - slack - d)`` with churn = :meth:`hole_churn`,
        slack = :meth:`heap_slack` and ``d`` = :meth:`layer_freed`; so ``mem["heap"]`` = cap + slack + d. At
        ``heap_fraction`` 1 the cap is one micro-batch's saved activations of the ``n`` layers (+ a packed row's
        mask): what one backward frees. None where the card runs no guard (:meth:`guarded`)."""
        if not self.guarded(i):
            return None
        f = self.terms[i].heap_fraction
        return max(0, int(f * self._guarded_churn(i, n)) - self.heap_slack(i) - self.layer_freed(i))

    def heap_reserve(self, i: int, n: int) -> int:
        """Bytes the heap guard's limit of card ``i`` (``n`` decoder layers) keeps free below the plan's total
        (``StagePlan.heap_limit``): the experts' kernel's term (:meth:`expert_kernel`), whose fp32 workspaces are
        made afresh in every sparse layer's forward and backward and need not come from the heap's holes (a worker
        thread's come from its own arena or are mapped on their own; the calling thread's ``2*I*h`` block is larger
        than the pieces freed activations leave); 0 for a dense model and where the card runs no guard.

        Why: the guard trims only while the RSS is above its limit, so holes may fill the heap up to it, the
        transient term's share included; a check before the layer then sees the RSS at the limit and trims
        nothing, and the kernel's workspaces land on top. With the limit at the other terms + cap (no reserve) a
        Mixtral-8x7B-shaped LoRA card at 2 threads, bf16 widened, peaked at 1.11-1.15 of its plan, the main heap
        holding the excess (``experiments/2026-12-06-moe.md``, h37mem and h37guard)."""
        if not self.guarded(i):
            return 0
        return self.expert_kernel(i, n)

    def _guarded_churn(self, i: int, n: int) -> int:
        """One micro-batch's saved activations of ``n`` layers (+ a packed row's mask) + :meth:`heap_slack` +
        :meth:`layer_freed`."""
        return (n * self._activations_per_layer(i) + (self.mask_bytes if n else 0) + self.heap_slack(i)
                + self.layer_freed(i))

    def hole_churn(self, i: int, n: int, k: Optional[int] = None) -> int:
        """Bytes of stage ``i`` that can stand as holes in a cpu card's heap (``MemoryTerms.heap_fraction`` x this
        is ``mem["heap"]``): freed memory the heap keeps resident. 0 under ``train.recompute`` (the card returns
        freed memory, ``hostmem.card_mmap_threshold``).

        What glibc does with the card's settings (``hostmem``: blocks < 1 GiB from the heap, trimmed only past
        2 GiB free at its top, so without a guard the card's RSS is the heap's high-water mark; ``man 3 mallopt``;
        best fit from the free chunks, else the top grows): a backward frees a micro-batch's saved activations while
        blocks it allocates stay live among them (fresh ``.grad``, the input gradient, LoRA's adapter gradients), and
        a forward frees its own temporaries (RoPE, the repeated key/value heads, the norms) among the tensors it
        saves; the next forward's large tensors do not fit the pieces and the top grows. How much stays depends on
        the order of every allocation: measured (``experiments/bench/heap_holes.py``, ``mallinfo2``) 0.2-0.89 of the
        layers' activations in flight, falling as more micro-batches are in flight; no formula here bounds it.

        **Guarded** (:meth:`guarded`, the default on Linux): the card's :class:`~npu_train.hostmem.HeapGuard` checks
        before each decoder layer's forward, after each layer's backward and each trained parameter's gradient
        accumulation, at each action and before the update.
        A check reads the RSS (anonymous pages); where it grew by :meth:`heap_slack` or more since the last full
        check, it reads the live bytes too (``mallinfo2``) and returns the free pages (``malloc_trim``) when the
        holes (RSS - live) exceed :meth:`heap_cap` while the RSS is above the card's limit, the plan's other terms +
        cap - :meth:`heap_reserve` (so the trims, and the page faults after them, come only near the plan; the
        reserve keeps room for the experts' kernel's fresh workspaces). So at each check the RSS is at
        most the larger of that limit and live + cap, + slack, the live bytes of a moment the other terms hold. Between two checks the holes grow by at most the bytes
        freed in between (a freed block is resident only if written; an allocation from a free chunk shrinks the
        holes or faults live pages in): one layer's forward temporaries, or in its backward its saved tensors and
        temporaries, whose freeing lowers the live bytes as much, so the RSS passes live + cap + slack by at most
        the layer's backward allocations; both bounded by :meth:`layer_freed` (measured). So the holes are at
        most cap + slack + :meth:`layer_freed`: one micro-batch's activations of the stage + 2.5 layers' (+ one
        gradient of the largest layer tensor with full fine-tuning) + 32 MiB, whatever the schedule keeps in
        flight. Not counted: the head's ``[tokens, vocab]`` blocks (logits,
        log-probabilities, their gradients) and the gradient-accumulation temporary, each freed and requested
        again at its own size, larger than every layer tensor (best fit returns them whole; from 1 GiB mapped on
        its own), and held in the transient term.

        **Unguarded** (no ``mallinfo2``/``malloc_trim``): one copy of the decoder layers' activations in flight
        (:meth:`activations` with ``head=False``), the largest the measurements reached (0.89 of it).

        Runs: ``experiments/2026-12-06-plan-bound.md``."""
        if self.shape.recompute:  # recompute_fewest too (``k``): train.recompute is on
            return 0
        if self.guarded(i):
            return self._guarded_churn(i, n)
        return self.activations(i, n, head=False, k=k)

    def workspace(self, i: int, body: int, churn: int = 0) -> int:
        """:meth:`MemoryTerms.workspace <npu_train.planner.memterms.MemoryTerms.workspace>` of ``body`` (the
        five terms between baseline and workspace) and ``churn`` (bytes that can stand as heap holes,
        :meth:`hole_churn`)."""
        return self.terms[i].workspace(body, churn)

    # ------------------------------------------------------------------ pieces of the transients
    def _activations_per_layer(self, i: int) -> int:
        if self.shape.recompute_attention:
            return self.activations_per_layer["core"]
        return self.activations_per_layer[ATTENTION[self.cards[i].kind]]

    def _attention_transient(self, i: int) -> int:
        """Bytes one layer's backward allocates on top of the held graph on card ``i``: on a card whose attention
        kernel keeps the probabilities (``eager``) :func:`attention_transient_bytes` (its MLP's or its attention's
        phase), with the core recomputed
        under ``recompute_attention`` (whole-layer recompute, ``train.recompute`` or some layers of it, then runs
        the core checkpoint again inside the layer's) or not (a layer recomputed whole holds its activations as
        :meth:`activations` counts them, then runs the same backward); 0 with a fused kernel, whose backward
        allocates no ``[s, s]`` tensor (its MLP phase is not planned: ``docs/planner.md``)."""
        if ATTENTION[self.cards[i].kind] != "eager":
            return 0
        return self.attention_transient[bool(self.shape.recompute_attention)]

    def _largest_param(self, i: int, n: int) -> int:
        """Elements of the stage's largest parameter tensor, trained or frozen (a layer's or the embedding's)."""
        ends = i == 0 or (i == self.head_stage and not self.vocab)
        return max(self.largest_layer_param if n else 0, self.embedding_params if ends else 0,
                   self.vocab_rows(i) * self.model.hidden_size)

    def _largest_trained_param(self, i: int, n: int) -> int:
        """Elements of the stage's largest trainable tensor (LoRA: one layer's adapters)."""
        if self.adapter_params:
            return self.adapter_params if n else 0
        return self._largest_param(i, n)

    def _load_excess(self, i: int, n: int, p: StageParams, weights: int, body: int) -> int:
        """Bytes by which the model load's peak (:meth:`load_peak`) exceeds ``body`` on a host-memory card (0
        elsewhere, and where the steady terms hold more)."""
        if self.cards[i].kind not in HOST_MEMORY_KINDS:
            return 0
        return max(0, self.load_peak(i, n, p, weights) - body)

    def load_peak(self, i: int, n: int, p: StageParams, weights: int) -> int:
        """Bytes the card holds at the end of its load phase besides the baseline (``runtime/trainer.py``
        ``Trainer.setup``: the stage built a chunk of rows at a time, ``runtime/stagebuild.py``, LoRA applied, then
        the optimizer made, all before ``del masters``), an upper bound:

        - the ``weights``;
        - the optimizer's state as :meth:`optimizer_state` counts it: ``StageOptimizer`` makes its masters and
          both AdamW moments at construction (``eager_state``), so they exist from the load on;
        - the initial fp32 values the optimizer is made from, alive until the load ends: LoRA's
          ``apply_lora`` returns a fresh fp32 copy of every adapter (4 B per trainable parameter, whatever the
          compute dtype); full fine-tuning reads fresh fp32 masters (4 B per parameter) unless the parameters are
          fp32 in host memory, their own masters (``load_stage_weights``: 0);
        - the transients, each counted in full (freed blocks stay resident in a cpu card's heap): one chunk's for
          the checkpoint's dtype (``RunShape.checkpoint_dtype``: the slice read and its finite check; a cpu card
          casts inside ``copy_`` and makes no upload copy, ``chunk_transient_bytes(..., 0)``) and, where the optimizer's masters are not the parameters the load filled, the upload copy
          of the largest trained tensor as it places them (4 B/element: ``StageOptimizer._place_masters`` uploads
          each initial value, a cpu upload a clone, then keeps a clone of it or copies it into the parameter).
          Full fine-tuning of fp32 parameters in host memory has none: the load filled the parameters, which are
          their own masters (``load_stage_weights`` hands them back as the masters, no copy is made).

        Measured from outside (``experiments/2026-12-06-plan-bound.md``, "The load term"): the LoRA cards peaked
        0.18 / 0.35 GiB above the term without the optimizer's state and the initial copies."""
        from npu_train.model.chunks import chunk_transient_bytes

        own_masters = not self.adapter_params and self.dtype_bytes == 4 and self.cards[i].kind in HOST_MEMORY_KINDS
        initial = 0 if own_masters else 4 * p.trainable
        transients = chunk_transient_bytes(self.shape.checkpoint_dtype, 0) \
            + (0 if own_masters else 4 * self._largest_trained_param(i, n))
        return weights + self.optimizer_state(i, p) + initial + transients

    def _fused_head(self, i: int) -> bool:
        return i == self.head_stage and not self.vocab and self.cards[i].kind in FUSED_HEAD_KINDS and not self.adapter_params

    def _accumulation_temporary(self, i: int, n: int) -> int:
        """The fresh gradient autograd adds to ``.grad`` from the second micro-batch on (+ its fp32 cast): of the
        stage's largest trained tensor; on a host-memory card of its largest layer tensor (LoRA: one layer's
        adapters), the embedding's and the head's counted where the schedule adds them
        (:meth:`nonlayer_accumulation_peak`)."""
        shape, e, g = self.shape, self.dtype_bytes, self.grad_bytes
        if not (shape.micro_batches > 1 or (self.head_stage == 0 and self.tied)):
            return 0
        if self.cards[i].kind in HOST_MEMORY_KINDS:
            elements = (self.adapter_params or self.largest_layer_param) if n and shape.micro_batches > 1 else 0
        elif self._fused_head(i) and g == e == 4 and i != 0:
            elements = self.largest_layer_param if n else 0
        else:
            elements = self._largest_trained_param(i, n)
        return (e if g == e else e + 4) * elements

    def _forward_backward_peak(self, i: int, n: int, activations: int, k: Optional[int] = None) -> int:
        acc = self._accumulation_temporary(i, n)
        core = self._attention_transient(i) if n else 0
        kernel = self.expert_kernel(i, n)
        if i == self.head_stage and not self.vocab:
            peak = activations + max(0 if self._fused_head(i) else 2 * self.saved_logits, acc, core, kernel)
        else:
            one_micro_batch = (self.held_per_micro_batch(i, n, k) if k is not None else
                               n * (self.layer_input_bytes if self.shape.recompute else self._activations_per_layer(i)))
            peak = activations + max(0, acc - one_micro_batch, core, kernel)
        peak = max(peak, activations + self.vocab_transient(i))  # an upper bound: V(m) at the activations' peak
        return max(peak, self.nonlayer_accumulation_peak(i, n))

    def expert_kernel(self, i: int, n: int) -> int:
        """Bytes the experts' kernel of one sparse layer of stage ``i`` (``n`` layers) allocates and frees while it
        runs (:func:`~npu_train.planner.moe.expert_kernel_bytes`, one layer at a time): its matmuls in fp32 for
        the 2-byte dtype on a cpu card whose host multiplies no bf16 in hardware
        (:func:`~npu_train.hardware.host_bf16_matmul`), the experts' weights trained unless LoRA, their adapters'
        temporaries at ``RunShape.lora_expert_rank``, the widening buffers once per torch thread of the card
        process (:attr:`threads`: its concurrent blocks); 0 for a dense model or a stage without layers."""
        if not n or not self.model.is_moe:
            return 0
        e = self.dtype_bytes
        wide = e == 2 and self.cards[i].kind in HOST_MEMORY_KINDS and not host_bf16_matmul()
        rows = self.model.num_experts_per_tok * self.shape.seq_len * self.shape.micro_batch
        return expert_kernel_bytes(self.model, rows, e, 4 if wide else e, trained=not self.adapter_params,
                                   rank=self.shape.lora_expert_rank if self.adapter_params else 0,
                                   threads=self.threads)

    def _host_gradient_copies(self, i: int, p: StageParams) -> int:
        """fp32 host copies of offloaded gradients on a host-memory card (none when the update takes the
        fp32 gradient itself)."""
        host_memory = self.cards[i].kind in HOST_MEMORY_KINDS
        return 4 * p.offloaded if host_memory and (self.grad_bytes != 4 or self.shape.offload == "delayed") else 0

    def _optimizer_phase_peak(self, i: int, n: int, p: StageParams) -> int:
        """The larger of the gradient-norm temporary and the fp32 master gradients."""
        largest, e, g = self._largest_trained_param(i, n), self.dtype_bytes, self.grad_bytes
        norm_temporary = (4 if g == 4 else 8) * largest
        master_gradients = (self._host_gradient_copies(i, p) if self.shape.offload == "serial" else 0) \
            + (4 * p.resident if g != 4 else 0)
        if self.cards[i].kind in HOST_MEMORY_KINDS and p.offloaded:
            master_gradients += e * largest
        return max(norm_temporary, master_gradients)

    def _tied_gradient_buffers(self, i: int) -> int:
        """The tied-embedding gradient exchange's buffers (``runtime/tied.py``) on the first and last stage."""
        first, last = i == 0, i == self.head_stage
        if not (self.tied and self.head_stage != 0 and (first or last)) or self.adapter_params:
            return 0
        g, vh = self.grad_bytes, self.embedding_params
        if self.cards[i].kind not in HOST_MEMORY_KINDS:
            return g * vh
        return (4 * vh if first or g != 4 else 0) + ((g + 4) * vh if g != 4 else 0)

    def _held_through_the_step(self, i: int, p: StageParams) -> int:
        """Tied gradient buffers, overlapped host gradient copies, staged weights of a delayed update."""
        held = self._tied_gradient_buffers(i)
        if self.shape.offload != "serial":
            held += self._host_gradient_copies(i, p)
        if self.cards[i].kind in HOST_MEMORY_KINDS and self.shape.offload == "delayed" and self.dtype_bytes != 4:
            held += self.dtype_bytes * p.offloaded
        return held
