"""Llama architecture hyper-parameters (:class:`LlamaConfig`), shared by the model, loaders and planner.
Parameter names are HF ``LlamaForCausalLM``'s with global layer indices, so checkpoints and export need no renaming.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder (HF ``LlamaConfig`` subset). ``rope_scaling``: None or HF's
    Llama-3 dict; ``head_dim`` defaults to hidden // heads; ``max_position_embeddings`` in tokens."""

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

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    # ---- parameter bookkeeping (exact; used by placement and checked against the module) ----
    def layer_param_names(self, i: int) -> list[str]:
        """HF names of the 9 tensors of decoder layer ``i`` (global index)."""
        p = f"model.layers.{i}."
        return [
            p + "input_layernorm.weight",
            p + "self_attn.q_proj.weight",
            p + "self_attn.k_proj.weight",
            p + "self_attn.v_proj.weight",
            p + "self_attn.o_proj.weight",
            p + "post_attention_layernorm.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
        ]

    def param_shapes(self, i: int | None = None) -> dict[str, tuple[int, ...]]:
        """Shapes of decoder layer ``i``'s tensors, or of the non-layer tensors when ``i is None``
        (embedding, final norm, and ``lm_head`` only when untied)."""
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        if i is None:
            out = {"model.embed_tokens.weight": (self.vocab_size, H), "model.norm.weight": (H,)}
            if not self.tie_word_embeddings:
                out["lm_head.weight"] = (self.vocab_size, H)
            return out
        n = self.layer_param_names(i)
        shapes = [(H,), (self.num_heads * D, H), (self.num_kv_heads * D, H),
                  (self.num_kv_heads * D, H), (H, self.num_heads * D), (H,), (I, H), (I, H), (H, I)]
        return dict(zip(n, shapes))

    def params_per_layer(self) -> int:
        """Exact parameter count of one decoder layer."""
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
