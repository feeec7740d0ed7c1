#!/usr/bin/env python
"""Write a randomly initialised mixture of experts in Qwen3-30B-A3B's shape with N layers as an HF directory
(issue 37's memory runs: as many layers as fit on this machine).

``python experiments/bench/make_random_moe.py --layers 4 --out /tmp/moe4``
``python experiments/bench/make_random_moe.py --layers 4 --moe-intermediate 96 --vocab 49152 --out /tmp/moe4s``
(the smaller-expert variant for full fine-tuning, with the tokenizer's vocabulary)
``python experiments/bench/make_random_moe.py --layers 2 --hidden 4096 --kv-heads 8 --experts 8 --top-k 2
--moe-intermediate 14336 --vocab 49152 --out /tmp/mix2`` (Mixtral-8x7B's layer shape on the Qwen3-MoE class)

Shape (Qwen/Qwen3-30B-A3B config.json): hidden 2048, 128 experts, top-8, norm_topk_prob, moe_intermediate 768,
32 query / 4 key-value heads of head_dim 128, vocabulary 151936, untied, rms_norm_eps 1e-6, rope_theta 1e6;
every layer sparse. Made with transformers' ``Qwen3MoeForCausalLM`` ``from_config`` (its init: N(0, 0.02), norms 1;
a router still all zero is drawn N(0, 0.02) too, so tokens spread over the experts) and written with
``save_pretrained`` in bf16 (one tensor per expert, as transformers 5 writes Qwen3-MoE; shards of 2 GB).

Tokenizer: the embedded SmolLM2-135M's (``model.path=embedded``), saved as ``tokenizer.json``; its 49152 ids
stay below the model's 151936, so every matrix, the LM head included, has the real shape (rows of the
embedding above 49151 are never looked up; the head still scores all 151936). The loss is not meaningful.
Its chat template (the embedded model's ChatML one) is saved as ``chat_template.jinja`` and its special tokens
in ``tokenizer_config.json``, so ``data.format=chat`` takes the output (it refused it for want of a template).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _say(text: str, t0: float) -> None:
    """One progress line on stdout, ``make_random_moe: [  12 s] <text>``, folded at words within 100 columns."""
    from npu_train.metrics.report import fold_long_line

    print(fold_long_line(f"make_random_moe: [{time.time() - t0:4.0f} s] {text}"), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, required=True, help="decoder layers (all sparse)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--moe-intermediate", type=int, default=768, help="one expert's width (Qwen3-30B-A3B: 768)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (>= the tokenizer's 49152)")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048; Mixtral-8x7B: 4096)")
    ap.add_argument("--kv-heads", type=int, default=4, help="key-value heads of 128 (32 query heads; Mixtral: 8)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.vocab < 49152:
        ap.error(f"--vocab {a.vocab}: the SmolLM2 tokenizer's ids go up to 49151; use >= 49152")
    t0 = time.time()
    what = (f"a random Qwen3-MoE of {a.layers} layer(s) x {a.experts} experts of {a.moe_intermediate} "
            f"(top-{a.top_k}), vocabulary {a.vocab}")
    _say("importing torch and transformers ...", t0)

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    from npu_train.model.files import embedded_model_path
    from npu_train.model.tokenizer import chat_template, load_tokenizer, special_tokens

    hf_logging.disable_progress_bar()  # no "Writing model shards" bars: the lines below say what happens
    torch.manual_seed(a.seed)
    tok = load_tokenizer(embedded_model_path())
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=6144, num_hidden_layers=a.layers,
        num_attention_heads=32, num_key_value_heads=a.kv_heads, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=a.experts,
        num_experts_per_tok=a.top_k, moe_intermediate_size=a.moe_intermediate, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=None)
    _say(f"building {what} in bf16 and drawing its weights (transformers' init) ...", t0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 2 B/param in memory, never an fp32 copy
    model = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") and not p.any():
                p.normal_(0.0, 0.02)
    n = sum(p.numel() for p in model.parameters())
    _say(f"writing {n / 1e9:.3f} B params ({2 * n / 2**30:.2f} GiB bf16, shards of 2 GB) and the tokenizer "
         f"to {a.out} ...", t0)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, max_shard_size="2GB")
    tok.save(os.path.join(a.out, "tokenizer.json"))
    with open(os.path.join(a.out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chat_template(embedded_model_path()))  # data.format=chat renders rows with it
    with open(os.path.join(a.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({k: v for k, v in special_tokens(embedded_model_path()).items() if v}, f, indent=1)
    _say(f"wrote {what}, {n / 1e9:.3f} B params, bf16, to {a.out}", t0)


if __name__ == "__main__":
    main()
