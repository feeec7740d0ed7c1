#!/usr/bin/env python
"""Write a randomly initialised Llama of a preset's shape as an HF directory (for benchmarks on machines
without the embedded model's package, e.g. the lent GPU machine, where only a 64 MiB tree travels).

``python experiments/bench/make_random_model.py --preset smollm2-135m --out /tmp/smol``

Weights: linear/embedding ~ N(0, 0.02), norms 1 (HF init), fp32 safetensors. Tokenizer: byte-level BPE
with ``--vocab`` entries trained on the shipped Botchan text (ids stay below the model's vocabulary, so
the throughput of every matrix, the LM head included, is the preset's). Timing only: the loss is not
meaningful.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=2048)
    a = ap.parse_args()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from npu_train.checkpoint.export import hf_config_dict
    from npu_train.data.text import botchan_text
    from npu_train.model.presets import get_preset

    cfg = get_preset(a.preset)
    os.makedirs(a.out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([botchan_text()], trainers.BpeTrainer(
        vocab_size=a.vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(os.path.join(a.out, "tokenizer.json"))
    d = hf_config_dict(cfg, "fp32")
    d.update(bos_token_id=0, eos_token_id=0)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(d, f, indent=1)
    g = torch.Generator().manual_seed(0)
    shapes = dict(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        shapes.update(cfg.param_shapes(i))
    tensors = {n: torch.ones(s) if len(s) == 1 else 0.02 * torch.randn(s, generator=g) for n, s in shapes.items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(a.out, "model.safetensors"))
    print(f"wrote {a.preset} ({sum(t.numel() for t in tensors.values()) / 1e6:.1f} M params) to {a.out}")


if __name__ == "__main__":
    main()
