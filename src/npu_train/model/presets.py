"""Named architectures of the supported families (values from the published HF ``config.json``);
:func:`get_preset` also takes HF repository ids. Parameter counts are checked in ``tests/unit/test_placement.py``."""
from __future__ import annotations

import copy
import dataclasses

from npu_train.model.config import LlamaConfig

__all__ = ["PRESETS", "ALIASES", "get_preset", "preset_names"]


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


PRESETS: dict[str, LlamaConfig] = {
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0), rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        name="llama-3.1-8b",
    ),
    # meta-llama/Llama-3.1-70B
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_llama3_rope(8.0), rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        name="llama-3.1-70b",
    ),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=_llama3_rope(32.0), rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        name="llama-3.2-1b",
    ),
    # meta-llama/Llama-3.2-3B
    "llama-3.2-3b": LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_layers=28,
        num_heads=24, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_llama3_rope(32.0), rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        name="llama-3.2-3b",
    ),
    # HuggingFaceTB/SmolLM2-135M
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, name="smollm2-135m",
    ),
    # Qwen/Qwen2.5-7B (q/k/v biases; use_sliding_window=false)
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151643, name="qwen2.5-7b", family="qwen2",
    ),
    # Qwen/Qwen3-8B (q_norm/k_norm; head_dim 128 = hidden / heads here, explicit in the config)
    "qwen3-8b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, name="qwen3-8b", family="qwen3",
    ),
    # mistralai/Mistral-7B-v0.3 (sliding_window=null)
    "mistral-7b": LlamaConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, name="mistral-7b", family="mistral", sliding_window=None,
    ),
    # ---- mixtures of experts ----
    # Qwen/Qwen3-30B-A3B config.json: 48 sparse layers (decoder_sparse_step 1, mlp_only_layers []), 128 experts,
    # top-8, norm_topk_prob true, router_aux_loss_coef 0.001, output_router_logits false; intermediate_size
    # 6144 is the width a dense layer would have (none here)
    "qwen3-30b-a3b": LlamaConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, name="qwen3-30b-a3b", family="qwen3_moe",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001, output_router_logits=False,
    ),
    # Qwen/Qwen3-235B-A22B config.json: 94 sparse layers, 128 experts, top-8, moe_intermediate_size 1536
    "qwen3-235b-a22b": LlamaConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=94,
        num_heads=64, num_kv_heads=4, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, name="qwen3-235b-a22b", family="qwen3_moe",
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), router_aux_loss_coef=0.001, output_router_logits=False,
    ),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 32 sparse layers, num_local_experts 8, top-2 (renormalised
    # always: softmax over the top-2 logits), each expert 14336 wide; router_aux_loss_coef 0.02,
    # output_router_logits false, sliding_window null
    "mixtral-8x7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1000000.0, rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, name="mixtral-8x7b", family="mixtral", sliding_window=None,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
        router_aux_loss_coef=0.02, output_router_logits=False,
    ),
}

#: Hugging Face repository ids (lower-cased) -> preset name.
ALIASES: dict[str, str] = {
    "meta-llama/llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama/meta-llama-3.1-8b": "llama-3.1-8b",
    "meta-llama/llama-3.1-70b": "llama-3.1-70b",
    "meta-llama/llama-3.1-70b-instruct": "llama-3.1-70b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b",
    "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "meta-llama/llama-3.2-3b": "llama-3.2-3b",
    "meta-llama/llama-3.2-3b-instruct": "llama-3.2-3b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "qwen/qwen3-8b": "qwen3-8b",
    "qwen/qwen3-8b-base": "qwen3-8b",
    "mistralai/mistral-7b-v0.3": "mistral-7b",
    "mistralai/mistral-7b-instruct-v0.3": "mistral-7b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    "qwen/qwen3-30b-a3b-base": "qwen3-30b-a3b",
    "qwen/qwen3-235b-a22b": "qwen3-235b-a22b",
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    "mistralai/mixtral-8x7b-instruct-v0.1": "mixtral-8x7b",
}


def preset_names() -> list[str]:
    """Sorted preset names accepted by :func:`get_preset`."""
    return sorted(PRESETS)


def get_preset(name: str) -> LlamaConfig:
    """A copy of preset ``name``'s (or HF repo id's) :class:`LlamaConfig`. Raises KeyError listing the names."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in PRESETS:
        raise KeyError(
            f"unknown model preset {name!r}; known presets: {', '.join(preset_names())} "
            f"(or a Hugging Face id: {', '.join(sorted(ALIASES))})"
        )
    cfg = PRESETS[key]
    return dataclasses.replace(cfg, rope_scaling=copy.deepcopy(cfg.rope_scaling))
