#!/usr/bin/env python
"""Write a random model of a real shape as the Hub holds it: transformers ``from_config``, ``save_pretrained`` in
**bf16** safetensors, with SmolLM2's tokenizer, chat template and special tokens (from the embedded GGUF; its ids < 49152 fit every shape
here).

``python experiments/bench/make_bf16_model.py --shape llama-3.2-1b --layers 16 --out /tmp/m/llama1b``

Shapes: ``llama-3.2-1b`` (hidden 2048, intermediate 8192, 32/8 heads, vocabulary 128256, tied),
``qwen2.5-1.5b`` (hidden 1536, intermediate 8960, 12/2 heads, q/k/v biases, vocabulary 151936, tied) and
``qwen2.5-0.5b`` (hidden 896, intermediate 4864, 14/2 heads, biases, vocabulary 151936, tied), the published
config.json values; ``--layers`` overrides the layer count (16 / 28 / 24 in the published models).
Weights: transformers' own init (N(0, 0.02)). For memory tests: the loss is not meaningful.
"""
from __future__ import annotations

import argparse
import os

SHAPES = {
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, rope_theta=1000000.0,
                                   rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
                                   use_sliding_window=False)),
    "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                                   rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
                                   use_sliding_window=False)),
}


def make(shape: str, out: str, layers: int | None = None, seed: int = 0) -> str:
    """Write the model (bf16 safetensors, config.json, tokenizer.json) to ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from npu_train.model import embedded_model_path, load_config

    smol = embedded_model_path()
    family, kw = SHAPES[shape]
    ids = load_config(smol)
    kw = dict(kw, bos_token_id=ids.bos_token_id, eos_token_id=ids.eos_token_id)
    if layers:
        kw["num_hidden_layers"] = int(layers)
    cfg = (LlamaConfig if family == "llama" else Qwen2Config)(**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_smollm2_tokenizer(out)
    return out


def write_smollm2_tokenizer(out: str) -> None:
    """SmolLM2's tokenizer.json, chat template and special tokens (tokenizer_config.json) into ``out``."""
    import json

    from npu_train.model import chat_template, embedded_model_path, load_tokenizer, special_tokens

    smol = embedded_model_path()
    load_tokenizer(smol).save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": chat_template(smol), **special_tokens(smol)}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    print("wrote", make(a.shape, a.out, a.layers))


if __name__ == "__main__":
    main()
