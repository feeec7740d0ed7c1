"""The planner's terms of a mixture-of-experts decoder layer (Qwen3-MoE, Qwen2-MoE, Mixtral), torch-free.

Memory counts *all* parameters of a layer (every expert: :meth:`LlamaConfig.layer_params
<npu_train.model.config.LlamaConfig.layer_params>`), compute the *active* ones (the top-k experts a token is
sent to: :meth:`~npu_train.model.config.LlamaConfig.active_layer_params`). The routed activations are bounded
whatever the balance: each token goes to exactly ``k`` experts, so the experts' saved tensors together hold
``k * tokens`` rows however the tokens spread over them. A model with dense and sparse layers
(``mlp_only_layers``, ``decoder_sparse_step``) is planned with the larger of the two kinds per layer, an
upper bound, as the parameters are (:meth:`~npu_train.model.config.LlamaConfig.params_per_layer`). For a
dense model every function here returns the dense figure exactly. Formulas and sources: ``docs/planner.md``
("Mixture-of-experts layers")."""
from __future__ import annotations

from typing import Iterable, NamedTuple

from npu_train.model.config import LlamaConfig

__all__ = ["LoraCounts", "expert_kernel_bytes", "lora_expert_rank", "mlp_saved_bytes_per_token", "routed_saved_bytes_per_token", "router_saved_bytes_per_token",
           "shared_saved_bytes_per_token", "mlp_pending_bytes_per_token", "largest_layer_tensor",
           "lora_layer_params", "lora_params_per_layer", "EXPERT_TARGETS"]

#: LoRA target names (``lora.targets``, PEFT's) of the three projections of an MLP (dense, one expert or the shared
#: expert) -> which one; they name Mixtral's experts' w1 (gate), w3 (up), w2 (down) too, as ``model/lora.py`` does
EXPERT_TARGETS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _kinds(model: LlamaConfig) -> list[int]:
    """One global layer index per distinct layer kind (sparse, dense) present in ``model``."""
    moe = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    dense = [i for i in range(model.num_layers) if not model.is_moe_layer(i)]
    return ([moe[0]] if moe else []) + ([dense[0]] if dense else [])


def routed_saved_bytes_per_token(model: LlamaConfig, e: int) -> int:
    """Bytes the routed experts of one sparse layer save per token of the micro-batch, an upper bound whatever
    the balance: ``k * (e*(2h + 4*I_e) + 4 + 24)``. Per routed copy of a token (``k`` per token, however they
    spread over the experts), what ``model/moe.py::SparseMoe.experts_forward`` saves: the gathered input
    ``[h]`` (the expert's gate/up matmuls), the SwiGLU gate and up outputs, ``silu(gate)`` and their product
    ``[I_e]`` each (as a dense MLP's ``4*e*i``), the expert's output ``[h]`` (the weighting product), in the
    compute dtype of ``e`` bytes; the routing weight, 4 B (fp32 in Mixtral, the compute dtype in Qwen); three
    int64 indices (the gather's token index, the sort order, its inverse). Checked with ``saved_tensors_hooks``
    (``tests/unit/test_moe_plan.py``). transformers 5's eager ``Qwen3MoeExperts`` also keeps the weighted
    output, ``e*h`` more per copy."""
    if not model.is_moe:
        return 0
    h, ie, k = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok
    return k * (e * (2 * h + 4 * ie) + 4 + 24)


def expert_kernel_bytes(model: LlamaConfig, rows: int, e: int, m: int, trained: bool, rank: int = 0,
                        threads: int = 1) -> int:
    """Peak bytes the experts' kernel of one sparse layer (``model/moe.py::GroupedSwiGlu``) allocates and frees
    while it runs, for ``rows`` routed rows (``k`` x the micro-batch's tokens, whatever the balance), ``e`` bytes
    of the compute dtype, ``m`` of the matmul dtype (``e``, or 4 where bf16 matmuls run in fp32 on a CPU without
    bf16 hardware), the experts' weights ``trained`` (full fine-tuning) or frozen (LoRA) and ``rank`` the LoRA
    rank of adapters on all three expert projections (which the kernel runs; 0: none). Not counted: what
    outlives the kernel (the tensors it saves, its output, the input and weight gradients it returns). The
    largest of its phases, ``w = I*h`` elements per weight, ``n = rows / k`` the most rows one expert can get
    (one per token):

    - same dtype (``m == e``): nothing forward (the products are the saved tensors); backward the gate/up output
      gradient ``[dg | du]`` ``[2I]`` (``dh`` is written into its ``du`` half, both halves made in place):
      ``2*e*I`` per row; with adapters the backward loops also hold ``dy B`` ``[n, r]`` of one projection;
    - wider matmuls (``m > e``), per row, and one workspace of ``2w`` elements for the widened weights (one
      expert's at a time: gate/up ``[2I, h]``, down ``[h, I]`` in its first ``w``), made at the start of the
      forward and of the backward and kept through every phase of the call, so no phase leaves a hole a later
      phase's buffer does not fit; with trained weights, in the backward, a second one for their gradients:
      forward gate/up: ``x`` widened ``[h]``, the products ``[2I]``;
      forward down: ``h`` widened ``[I]``, the products ``[h]``;
      backward down: ``[dg | du]`` ``[2I]`` (``dh`` ``[I]`` is written into its ``du`` half), ``dy`` and ``h`` widened;
      ``silu``'s backward: ``[dg | du]``, ``dh`` rounded and one temporary ``[I]`` in the compute dtype;
      backward gate/up: ``[dg | du]``, ``x`` widened, ``dx`` ``[h]``. Adapters (one projection's at a time,
      ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``, ``in + out = h + I`` for each projection): widened,
      ``m*r*(h + I)``, in each of the four matmul phases; backward also ``dy B`` ``[n, r]`` and one adapter
      gradient's wide product before its rounding, at most ``[r, max(h, I)]``.

    ``threads``: the card process's torch threads. Wider matmuls without adapters run the experts' blocks
    concurrently, one per thread (``model/moe.py::_parallel_blocks``), each thread widening into its own weight
    (and weight-gradient) workspace, so the workspace terms count once per thread there (an upper bound: with
    fewer than ``BLOCKS_PER_THREAD`` blocks per thread they run one after another, one workspace set); the per-row
    tensors are shared. Qwen3-30B-A3B (below), bf16 widened, 2 threads: 25.2 MB more than 1 thread trained (a
    second ``[2I, h]`` weight and gradient buffer pair, ``16 * w``), 12.6 MB frozen.

    Qwen3-30B-A3B (h 2048, I 768), 256 tokens x top-8, bf16 widened, trained: 71.3 MB; frozen with rank-8
    adapters: 58.9 MB; fp32: 12.6 MB. Checked against the kernel's allocations
    (``tests/unit/test_moe_kernel_memory.py``)."""
    if not model.is_moe or rows <= 0:
        return 0
    h, i = model.hidden_size, model.moe_intermediate_size
    w = i * h
    n = -(-rows // model.num_experts_per_tok)
    if m == e:
        return 2 * e * i * rows + e * n * rank
    grad = 2 if trained else 1
    ws = 2 * m * w * (max(1, int(threads)) if rank == 0 else 1)  # one workspace per concurrent block's thread
    fwd = m * rank * (h + i)                                 # one projection's adapters, widened
    bwd = fwd + m * rank * n + m * rank * max(h, i)          # + dy B, + one adapter gradient before rounding
    return max(rows * (m * h + 2 * m * i) + ws + fwd,            # forward gate/up
               rows * (m * i + m * h) + ws + fwd,                # forward down
               rows * (3 * m * i + m * h) + grad * ws + bwd,     # backward down
               rows * (2 * m * i + 2 * e * i) + grad * ws,       # silu's backward
               rows * (2 * m * i + 2 * m * h) + grad * ws + bwd)  # backward gate/up


def lora_expert_rank(model: LlamaConfig, r: int, targets: Iterable[str], dropout: float = 0.0) -> int:
    """``RunShape.lora_expert_rank``: ``r`` when the experts' kernel (``model/moe.py::GroupedSwiGlu``) runs
    adapters, i.e. a mixture of experts with all three expert projections among ``targets`` and no adapter
    dropout (``Expert.grouped_operands``); else 0 (a dense model, some expert projections not adapted, or
    dropout: the experts then run as modules)."""
    targets = set(targets)
    return int(r) if model.is_moe and set(EXPERT_TARGETS) <= targets and not dropout else 0


def router_saved_bytes_per_token(model: LlamaConfig, e: int) -> int:
    """Bytes the router of one sparse layer keeps per token: the fp32 softmax ``[E]`` (saved by its backward),
    the top-k int64 indices and fp32 values ``[k]`` and the fp32 sum that renormalises them; with the
    load-balancing loss on and logits not in fp32, the loss's own softmax in the compute dtype ``[E]`` (its
    top-k is not differentiated): ``E*(e + 4) + 12*k + 4``."""
    if not model.is_moe:
        return 0
    E, k = model.num_experts, model.num_experts_per_tok
    return E * (e + 4) + 12 * k + 4


def shared_saved_bytes_per_token(model: LlamaConfig, e: int) -> int:
    """Qwen2-MoE's always-on shared expert per token: its SwiGLU ``4*I_s``, its output ``[h]`` and the sigmoid
    gate's value (saved by the sigmoid and the gating product), ``e*(4*I_s + h + 1)``; 0 without one."""
    i_s = model.shared_expert_intermediate_size
    return e * (4 * i_s + model.hidden_size + 1) if (model.is_moe and i_s) else 0


def mlp_saved_bytes_per_token(model: LlamaConfig, e: int) -> int:
    """Bytes the MLP of one decoder layer saves per token: a dense SwiGLU of width ``i`` ``4*e*i`` (gate, up,
    ``silu(gate)``, product); a sparse layer the routed experts + router + shared expert (the three functions
    above). The larger of the model's layer kinds (an upper bound for mixed models; exact for uniform ones)."""
    out = 0
    for i in _kinds(model):
        if model.is_moe_layer(i):
            b = (routed_saved_bytes_per_token(model, e) + router_saved_bytes_per_token(model, e)
                 + shared_saved_bytes_per_token(model, e))
        else:
            b = 4 * e * model.intermediate_size
        out = max(out, b)
    return out


def mlp_pending_bytes_per_token(model: LlamaConfig, e: int) -> int:
    """Output gradients of the MLP's linear layers one micro-batch keeps per token from its ``B`` to its ``W``
    pass (split backward): dense ``e*(h + 2i)`` (down, gate, up outputs); sparse ``e*(E + k*(h + 2*I_e))``
    (router logits, each routed copy's down and gate/up outputs) + the shared expert's ``e*(h + 2*I_s + 1)``.
    The larger of the layer kinds."""
    h, out = model.hidden_size, 0
    for i in _kinds(model):
        if model.is_moe_layer(i):
            b = e * (model.num_experts + model.num_experts_per_tok * (h + 2 * model.moe_intermediate_size))
            if model.shared_expert_intermediate_size:
                b += e * (h + 2 * model.shared_expert_intermediate_size + 1)
        else:
            b = e * (h + 2 * model.intermediate_size)
        out = max(out, b)
    return out


def largest_layer_tensor(model: LlamaConfig) -> int:
    """Elements of the largest single parameter tensor of a decoder layer (one tensor per expert, as the
    checkpoint and :meth:`~npu_train.model.config.LlamaConfig.param_shapes` hold them)."""
    best = 0
    for i in _kinds(model):
        for shape in model.param_shapes(i).values():
            n = 1
            for d in shape:
                n *= d
            best = max(best, n)
    return best


class LoraCounts(NamedTuple):
    """Trainable parameters of one decoder layer under LoRA: ``total`` (memory: every expert's adapters) and
    ``active`` (compute: what one token passes through: attention's adapters and its ``k`` experts')."""

    total: int
    active: int


def _mlp_dims(model: LlamaConfig, width: int) -> dict[str, tuple[int, int]]:
    h = model.hidden_size
    return {"gate": (h, width), "up": (h, width), "down": (width, h)}


def lora_layer_params(model: LlamaConfig, i: int, r: int, targets: Iterable[str],
                      train_router: bool = False) -> LoraCounts:
    """:class:`LoraCounts` of layer ``i`` with rank-``r`` adapters on ``targets`` (short module names: the
    attention projections and ``gate_proj``/``up_proj``/``down_proj``, which also name Mixtral's ``w1``/``w3``/``w2``): each
    adapted linear of shape (in, out) has ``r*(in + out)`` parameters (PEFT's ``lora_A`` [r, in] and ``lora_B``
    [out, r]). On a sparse layer an MLP target adapts *each* expert's projection (E adapters, k of them active
    per token) and the shared expert's; ``train_router``: the router (``[E, h]``, and Qwen2-MoE's shared-expert
    gate ``[1, h]``) is trained in full. Raises ``ValueError`` for an unknown target."""
    h, hd = model.hidden_size, model.head_dim
    attn = {"q_proj": (h, model.num_heads * hd), "k_proj": (h, model.num_kv_heads * hd),
            "v_proj": (h, model.num_kv_heads * hd), "o_proj": (model.num_heads * hd, h)}
    total = active = 0
    for t in targets:
        if t in attn:
            n = r * sum(attn[t])
            total, active = total + n, active + n
            continue
        if t not in EXPERT_TARGETS:
            raise ValueError(f"unknown LoRA target {t!r}; use some of {list(_ATTENTION_TARGETS) + list(EXPERT_TARGETS)}")
        which = EXPERT_TARGETS[t]
        if not model.is_moe_layer(i):
            n = r * sum(_mlp_dims(model, model.intermediate_size)[which])
            total, active = total + n, active + n
            continue
        per_expert = r * sum(_mlp_dims(model, model.moe_intermediate_size)[which])
        shared = (r * sum(_mlp_dims(model, model.shared_expert_intermediate_size)[which])
                  if model.shared_expert_intermediate_size else 0)
        total += model.num_experts * per_expert + shared
        active += model.num_experts_per_tok * per_expert + shared
    if train_router and model.is_moe_layer(i):
        router = model.num_experts * h + (h if model.shared_expert_intermediate_size else 0)
        total, active = total + router, active + router
    return LoraCounts(total, active)


def lora_params_per_layer(model: LlamaConfig, r: int, targets: Iterable[str],
                          train_router: bool = False) -> LoraCounts:
    """:func:`lora_layer_params` of the model's largest layer kind (each count its maximum over the kinds): the
    per-layer figures of ``RunShape.lora_params_per_layer`` and ``lora_active_params_per_layer``."""
    targets = tuple(targets)
    counts = [lora_layer_params(model, i, r, targets, train_router) for i in _kinds(model)]
    return LoraCounts(max(c.total for c in counts), max(c.active for c in counts))
