"""Decoder hyper-parameters (:class:`LlamaConfig`, alias :data:`ModelConfig`) of the supported model families
(:data:`FAMILIES`: Llama, Qwen2/2.5, Qwen3, Mistral, and the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral),
shared by the model, loaders and planner (torch-free). Parameter names are the HF checkpoint's (``<Family>ForCausalLM``
as the Hub holds it, one tensor per expert) with global layer indices, so checkpoints and export need no renaming.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

__all__ = ["LlamaConfig", "ModelConfig", "Family", "FAMILIES", "MOE_FAMILIES", "SUPPORTED_ARCHITECTURES"]


class Family(NamedTuple):
    """One supported decoder family: HF ``architectures[0]`` and ``model_type``, GGUF ``general.architecture``
    (None: llama.cpp converts it as another family's), and its attention features."""

    architecture: str
    model_type: str
    gguf_arch: Optional[str]
    qkv_bias: bool  # biases on q/k/v projections (o_proj has none)
    qk_norm: bool  # per-head RMSNorm [head_dim] of q and k before RoPE
    moe_prefix: str = "mlp"  # module path of the sparse MLP block in checkpoints (Mixtral: "block_sparse_moe")
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # checkpoint names (gate, up, down)


#: family name (``LlamaConfig.family``) -> :class:`Family`
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", "llama", False, False),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", "qwen2", True, False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", "qwen3", False, True),
    # llama.cpp's convert_hf_to_gguf writes Mistral-7B as general.architecture=llama
    "mistral": Family("MistralForCausalLM", "mistral", None, False, False),
    # mixtures of experts (num_experts > 0 in LlamaConfig)
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3moe", False, True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "qwen2_moe", "qwen2moe", True, False),
    # Hub Mixtral checkpoints: block_sparse_moe.gate / block_sparse_moe.experts.<e>.w1 (gate), w3 (up), w2 (down)
    "mixtral": Family("MixtralForCausalLM", "mixtral", None, False, False, "block_sparse_moe", ("w1", "w3", "w2")),
}
#: families whose decoder layers may hold a sparse mixture-of-experts MLP
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
#: the HF architectures accepted, for messages
SUPPORTED_ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a decoder of one of :data:`FAMILIES` (HF config subset). ``rope_scaling``: None or
    HF's Llama-3 dict; ``head_dim`` defaults to hidden // heads (Qwen3 sets it explicitly);
    ``max_position_embeddings`` in tokens. ``family`` fixes ``qkv_bias`` (Qwen2) and ``qk_norm`` (Qwen3);
    ``sliding_window`` (Mistral): attention span in tokens, None = full attention."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = field(default=None, hash=False, compare=False)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    name: str = "llama"
    family: str = "llama"
    sliding_window: Optional[int] = None
    # ---- mixture of experts (HF Qwen3MoeConfig / Qwen2MoeConfig / MixtralConfig names); 0 experts = dense ----
    num_experts: int = 0  # routed experts per sparse layer (Mixtral: num_local_experts)
    num_experts_per_tok: int = 0  # top-k experts per token
    moe_intermediate_size: int = 0  # one routed expert's MLP width (Mixtral: intermediate_size)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1 (Mixtral: always)
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP of width intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: always-on shared expert with a sigmoid gate; 0 = none
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss (Switch Transformer eq. 4)
    output_router_logits: bool = False  # HF's switch for adding the aux loss to the training loss

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: use one of {sorted(FAMILIES)}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in (self.mlp_only_layers or ())))
        if self.num_experts:
            if self.family not in MOE_FAMILIES:
                raise ValueError(f"family={self.family!r} has no experts; num_experts must be 0")
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                    f" and moe_intermediate_size={self.moe_intermediate_size} > 0"
                )
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def qkv_bias(self) -> bool:
        """q/k/v projections carry biases (Qwen2)."""
        return FAMILIES[self.family].qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm (weight [head_dim]) of q and k before RoPE (Qwen3)."""
        return FAMILIES[self.family].qk_norm

    # ---- parameter bookkeeping (exact; used by placement and checked against the module) ----
    def layer_param_names(self, i: int) -> list[str]:
        """HF names of the tensors of decoder layer ``i`` (global index), in the module's
        ``named_parameters()`` order: 9 weights, + q/k/v biases (Qwen2), + q_norm/k_norm (Qwen3)."""
        return list(self.param_shapes(i))

    def param_shapes(self, i: int | None = None) -> dict[str, tuple[int, ...]]:
        """Shapes of decoder layer ``i``'s tensors (``named_parameters()`` order), or of the non-layer tensors
        when ``i is None`` (embedding, final norm, and ``lm_head`` only when untied)."""
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        if i is None:
            out = {"model.embed_tokens.weight": (self.vocab_size, H), "model.norm.weight": (H,)}
            if not self.tie_word_embeddings:
                out["lm_head.weight"] = (self.vocab_size, H)
            return out
        p, q, kv = f"model.layers.{i}.", self.num_heads * D, self.num_kv_heads * D
        out = {p + "input_layernorm.weight": (H,)}
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, H)
            if self.qkv_bias:
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (H, q)
        if self.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (D,)
            out[p + "self_attn.k_norm.weight"] = (D,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if self.is_moe_layer(i):
            out.update(self._moe_shapes(p))
        else:
            out.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                        p + "mlp.down_proj.weight": (H, I)})
        return out

    # ---- mixture of experts ----
    @property
    def is_moe(self) -> bool:
        """Some decoder layers hold a sparse mixture-of-experts MLP."""
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (global index) holds routed experts, by HF's rule (``Qwen3MoeDecoderLayer``): not in
        ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def moe_layers(self) -> list[int]:
        """Global indices of the sparse (expert) layers."""
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    def _moe_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        """Checkpoint names and shapes of a sparse MLP block under layer prefix ``p``: router ``gate`` [E, H],
        each expert's gate/up [I_e, H] and down [H, I_e], and Qwen2-MoE's shared expert + its gate [1, H]."""
        H, Ie, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        fam = FAMILIES[self.family]
        m = f"{p}{fam.moe_prefix}."
        g, u, d = fam.expert_projs
        out = {m + "gate.weight": (E, H)}
        for e in range(E):
            out[f"{m}experts.{e}.{g}.weight"] = (Ie, H)
            out[f"{m}experts.{e}.{u}.weight"] = (Ie, H)
            out[f"{m}experts.{e}.{d}.weight"] = (H, Ie)
        Is = self.shared_expert_intermediate_size
        if Is:
            out.update({m + "shared_expert.gate_proj.weight": (Is, H), m + "shared_expert.up_proj.weight": (Is, H),
                        m + "shared_expert.down_proj.weight": (H, Is), m + "shared_expert_gate.weight": (1, H)})
        return out

    def layer_params(self, i: int) -> int:
        """Exact parameter count of decoder layer ``i`` (weights, biases, norm gains; every expert)."""
        total = 0
        for s in self.param_shapes(i).values():
            c = 1
            for d in s:
                c *= d
            total += c
        return total

    def active_layer_params(self, i: int) -> int:
        """Parameters of layer ``i`` that one token's forward multiplies with: everything but the routed experts
        it is not sent to (``num_experts - num_experts_per_tok`` experts of ``3 * H * I_e`` each). Equals
        :meth:`layer_params` for a dense layer. The compute (FLOP) terms use this; memory uses :meth:`layer_params`."""
        n = self.layer_params(i)
        if self.is_moe_layer(i):
            n -= (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return n

    def params_per_layer(self) -> int:
        """Parameter count of the largest decoder layer: exact for uniform models (every dense family, and the
        MoE presets whose layers are all sparse); an upper bound per layer for the memory plan otherwise."""
        if not self.is_moe:
            return self.layer_params(0)
        return max(self.layer_params(i) for i in self._layer_kinds())

    def active_params_per_layer(self) -> int:
        """Per-token (active) parameter count of the largest layer; :meth:`params_per_layer` for dense models."""
        if not self.is_moe:
            return self.layer_params(0)
        return max(self.active_layer_params(i) for i in self._layer_kinds())

    def _layer_kinds(self) -> list[int]:
        """One representative layer index per distinct layer kind (a sparse and, if any, a dense one)."""
        moe = self.moe_layers()
        dense = [i for i in range(self.num_layers) if not self.is_moe_layer(i)]
        return ([moe[0]] if moe else []) + ([dense[0]] if dense else [])

    def embedding_params(self) -> int:
        """Parameters of the input embedding (and of ``lm_head`` each, when untied)."""
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Exact parameter count of the whole model (tied embeddings counted once)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        if self.is_moe:
            layers = sum(self.layer_params(i) for i in range(self.num_layers))
        else:
            layers = self.num_layers * self.params_per_layer()
        return layers + self.embedding_params() + head + self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        keys = cls.__dataclass_fields__.keys()
        kw = {k: v for k, v in d.items() if k in keys}
        if "mlp_only_layers" in kw:
            kw["mlp_only_layers"] = tuple(kw["mlp_only_layers"] or ())
        return cls(**kw)


#: the family-neutral name of :class:`LlamaConfig`
ModelConfig = LlamaConfig
