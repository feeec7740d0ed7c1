"""Decoder hyper-parameters (:class:`LlamaConfig`, alias :data:`ModelConfig`) of the supported model families
(:data:`FAMILIES`: Llama, Qwen2/2.5, Qwen3, Mistral), shared by the model, loaders and planner (torch-free).
Parameter names are HF ``<Family>ForCausalLM``'s with global layer indices, so checkpoints and export need no renaming.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Optional

__all__ = ["LlamaConfig", "ModelConfig", "Family", "FAMILIES", "SUPPORTED_ARCHITECTURES"]


class Family(NamedTuple):
    """One supported decoder family: HF ``architectures[0]`` and ``model_type``, GGUF ``general.architecture``
    (None: llama.cpp converts it as another family's), and its attention features."""

    architecture: str
    model_type: str
    gguf_arch: Optional[str]
    qkv_bias: bool  # biases on q/k/v projections (o_proj has none)
    qk_norm: bool  # per-head RMSNorm [head_dim] of q and k before RoPE


#: family name (``LlamaConfig.family``) -> :class:`Family`
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaForCausalLM", "llama", "llama", False, False),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", "qwen2", True, False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", "qwen3", False, True),
    # llama.cpp's convert_hf_to_gguf writes Mistral-7B as general.architecture=llama
    "mistral": Family("MistralForCausalLM", "mistral", None, False, False),
}
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

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: use one of {sorted(FAMILIES)}")
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
        out.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I)})
        return out

    def params_per_layer(self) -> int:
        """Exact parameter count of one decoder layer (weights, biases and norm gains)."""
        total = 0
        for s in self.param_shapes(0).values():
            c = 1
            for d in s:
                c *= d
            total += c
        return total

    def embedding_params(self) -> int:
        """Parameters of the input embedding (and of ``lm_head`` each, when untied)."""
        return self.vocab_size * self.hidden_size

    def total_params(self) -> int:
        """Exact parameter count of the whole model (tied embeddings counted once)."""
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.num_layers * self.params_per_layer() + self.embedding_params() + head + self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        keys = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in keys})


#: the family-neutral name of :class:`LlamaConfig`
ModelConfig = LlamaConfig
