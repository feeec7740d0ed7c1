#!/usr/bin/env python
"""Logits of one fixed batch (2 x 64 token ids below 49152, the embedded tokenizer's) in fp32 compute, to check an
export of a mixture of experts (issue 37; record: experiments/2026-12-06-moe.md, "The LoRA export of the stacked
experts"). Not a benchmark. Each mode in its own process (the models are large):

``python experiments/bench/moe_export_logits.py hf DIR OUT.pt``: transformers ``AutoModelForCausalLM`` from ``DIR``
in fp32 (prints the class and the missing / unexpected / mismatched key counts);
``... peft BASE ADAPTER OUT.pt``: the same of ``BASE`` with ``peft.PeftModel.from_pretrained(ADAPTER)``;
``... npt DIR OUT.pt``: npu-train's whole model (``full_model``, stacked experts) on ``DIR``'s files, fp32;
``... cmp A.pt B.pt``: max and mean |A - B|, max relative to max |A|, argmax agreement.
Each prints its seconds and peak RSS (ru_maxrss).
"""
from __future__ import annotations

import resource
import sys
import time

import torch


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    m, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    print(path, type(m).__name__, next(m.parameters()).dtype, {k: len(v) for k, v in info.items()},
          sum(p.numel() for p in m.parameters()), flush=True)
    return m


def _npt(path: str):
    from npu_train.model.llama import full_model
    from npu_train.model.moe import stack_experts
    from npu_train.model.weights import iter_tensors, load_config

    cfg = load_config(path)
    with torch.device("meta"):
        m = full_model(cfg)
    m.to_empty(device="cpu")
    stack_experts(m, copy=False)
    params = dict(m.named_parameters())
    seen = 0
    with torch.no_grad():
        for n, t in iter_tensors(path, cfg, list(params)):
            params[n].copy_(t)
            seen += 1
    assert seen == len(params), (seen, len(params))
    if hasattr(m, "_rope_cache"):
        m._rope_cache = {}
    return m.eval()


def main(argv: list[str]) -> None:
    ids = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    mode, t0 = argv[0], time.time()
    with torch.no_grad():
        if mode == "hf":
            torch.save(_hf(argv[1]).eval()(input_ids=ids).logits.float(), argv[2])
        elif mode == "peft":
            from peft import PeftModel

            m = PeftModel.from_pretrained(_hf(argv[1]), argv[2]).eval()
            torch.save(m(input_ids=ids).logits.float(), argv[3])
        elif mode == "npt":
            torch.save(_npt(argv[1])(ids).float(), argv[2])
        elif mode == "cmp":
            a, b = torch.load(argv[1]), torch.load(argv[2])
            d = (a - b).abs()
            print(f"{argv[1]} vs {argv[2]}: max|a| {a.abs().max():.4g} max diff {d.max():.3g} "
                  f"rel {d.max() / a.abs().max():.3g} mean {d.mean():.3g} "
                  f"argmax equal {(a.argmax(-1) == b.argmax(-1)).float().mean() * 100:.1f} %")
        else:
            raise SystemExit(f"unknown mode {mode!r}: use hf, peft, npt or cmp (see the docstring)")
    print(f"{mode} done in {time.time() - t0:.0f} s, maxrss "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
