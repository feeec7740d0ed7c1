"""Tiny random Qwen2 / Qwen3 / Mistral models, as an HF directory and as a GGUF file, for the model-families record
(experiments/2026-12-03-model-families.md) and for trying the families without downloading a checkpoint.

``python experiments/scripts/model_families.py [out dir]`` (default ``tiny-families``) writes, per family, ``<out>/<family>/`` (config.json,
model.safetensors, tokenizer.json + tokenizer_config.json with a ChatML template: what ``save_pretrained`` and a
Hub download hold) and ``<out>/<family>.gguf`` (llama.cpp ``convert_hf_to_gguf.py`` layout: ``qwen2`` / ``qwen3``
arch keys and HF row order; Mistral as arch ``llama`` with llama.cpp's q/k permutation, as llama.cpp writes it;
a ``gpt2`` BPE tokenizer with ``tokenizer.ggml.pre=qwen2`` for Qwen). The weights are random
(``<Family>ForCausalLM(config)``, std 0.02, biases N(0, 0.1), norm gains U(0.5, 1.5)); the tokenizer is a
1024-entry byte-level BPE trained on the bundled Botchan text.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

SIZES = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
FAMILIES = {  # family: (transformers config class, model class, extra config keys, tied)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 48}, False),  # head_dim 48 != 128 / 4
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}, False),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_GG = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
       "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
       "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
       "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
       "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
       "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
       "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _tokenizer(out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from npu_train.data.text import botchan_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([botchan_text()], trainers.BpeTrainer(
        vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp LlamaModel.permute
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(path: str, model, tok, family: str) -> None:
    import gguf

    c = model.config
    arch = "llama" if family == "mistral" else family
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{family}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    data = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if family != "mistral" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])  # CONTROL / NORMAL
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(CHATML)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}.get(name)
        a = t.detach().float().numpy()
        if g is None:
            parts = name.split(".")
            sub = ".".join(parts[3:])
            g = f"blk.{parts[2]}.{_GG[sub]}"
            if arch == "llama" and sub == "self_attn.q_proj.weight":
                a = _permute(a, c.num_attention_heads)
            elif arch == "llama" and sub == "self_attn.k_proj.weight":
                a = _permute(a, c.num_key_value_heads)
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(out: str) -> None:
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars: one line per family instead
    os.makedirs(out, exist_ok=True)
    tok = _tokenizer(out)
    for family, (cfg_cls, model_cls, extra, tied) in FAMILIES.items():
        torch.manual_seed(0)
        cfg = getattr(transformers, cfg_cls)(vocab_size=tok.get_vocab_size(), tie_word_embeddings=tied,
                                             bos_token_id=0, eos_token_id=2,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                             **SIZES, **extra)
        model = getattr(transformers, model_cls)(cfg).eval()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
                elif n.endswith(".bias"):
                    p.normal_(0.0, 0.1)
        d = os.path.join(out, family)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                       "eos_token": "<|im_end|>", "chat_template": CHATML}, f, indent=1)
        write_gguf(os.path.join(out, f"{family}.gguf"), model, tok, family)
        print(f"{family}: {d} and {d}.gguf ({sum(p.numel() for p in model.parameters()):,} params)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Write tiny random Qwen2, Qwen3 and Mistral models (an HF directory "
                                 "and a GGUF file per family) to try the families on CPU cards.")
    ap.add_argument("out", nargs="?", default="tiny-families",
                    help="output folder (default: tiny-families); gets <family>/ and <family>.gguf per family")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main(parse_args().out)
