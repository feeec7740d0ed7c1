"""LoRA (``train.mode=lora``) through the pipeline vs a single-process ``peft`` reference.

The reference is transformers' ``LlamaForCausalLM`` wrapped by ``peft.get_peft_model`` with the same
rank/alpha/targets (dropout 0), written here from the formulas: summed token cross-entropy divided by
the step's target tokens, global-norm clipping, warm-up + cosine LR, ``torch.optim.AdamW`` over the
adapters (all 2-D, so all decayed). Only the initial adapter values are taken from the trainer
(``init_adapter``: A random, B = 0), as a user would load a shared initialisation.
Tolerance: fp32 per-step losses and final adapters within 1e-5 relative.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import make_cfg, peft_lora_model, rel_diff, run_pipeline

peft = pytest.importorskip("peft")

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]
LORA = ["train.mode=lora", "lora.rank=4", "lora.alpha=8", "train.lr=5e-3", "train.weight_decay=0.01"]


def _lr(step, lr, warmup, total, floor_ratio):
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = lr * floor_ratio
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def _peft_reference(model_path, cfg):
    from npu_train.data.batches import micro_batch_tensors
    from npu_train.data.prepare import prepare_data
    from npu_train.data.sampler import StepSampler
    from npu_train.model import load_config

    t, lo = cfg.train, cfg.lora
    mcfg = load_config(model_path)
    data = prepare_data(cfg, model_path, mcfg)
    model, adapters = peft_lora_model(model_path, lo, t.seed)
    params = list(adapters.values())
    assert params and all(p.requires_grad for p in params)
    opt = torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay,
                            foreach=False)
    sampler = StepSampler(data.train.shape[0], t.micro_batch, t.accum, t.seed)
    losses = []
    for step in range(t.steps):
        opt.zero_grad()
        mbs = [micro_batch_tensors(data, i) for i in sampler.micro_batches_for_step(step)]
        n_tok = sum(int((y != -100).sum()) for _, y in mbs)
        tot = 0.0
        for x, y in mbs:
            logits = model(input_ids=x).logits.float()
            ls = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                   ignore_index=-100, reduction="sum")
            (ls / n_tok).backward()
            tot += float(ls.detach())
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
        coef = min(1.0, t.clip / (float(norm) + 1e-6)) if t.clip > 0 else 1.0
        for p in params:
            p.grad.mul_(coef)
        for g in opt.param_groups:
            g["lr"] = _lr(step, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio)
        opt.step()
        losses.append(tot / n_tok)
    return losses, {n: p.detach().clone() for n, p in adapters.items()}


_REF = {}


@pytest.mark.parametrize("backend", ["[cpu]", "[cpu,cpu]", "[cpu,cpu,cpu]"])
def test_lora_pipeline_matches_peft_reference(tiny_model, tmp_path, backend):
    if tiny_model not in _REF:
        _REF[tiny_model] = _peft_reference(tiny_model, make_cfg(tiny_model, *LORA))
    ref_losses, ref_adapters = _REF[tiny_model]
    losses, reader = run_pipeline(tiny_model, str(tmp_path), f"backend={backend}", *LORA)
    assert len(losses) == 3
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0] - 1e-3  # the adapters really trained
    for name, w in ref_adapters.items():
        got = reader.get(f"master.{name}")
        assert rel_diff(got, w) < 1e-5, f"{name}: rel diff {rel_diff(got, w):.2e}"
    # only adapters have optimizer state; the frozen base is not in the checkpoint
    assert not [k for k in reader.manifest["index"] if k.startswith("master.") and "lora_" not in k]


def test_lora_export_peft_and_merged(tiny_model, tmp_path):
    """The PEFT adapter loads with ``peft`` on the base and gives the same logits as the merged export."""
    from transformers import LlamaForCausalLM

    from npu_train.checkpoint.export import export_hf

    _, reader = run_pipeline(tiny_model, str(tmp_path / "run"), "backend=[cpu,cpu]", *LORA)
    out = export_hf(reader.path, str(tmp_path / "export"), "fp32")
    adapter_dir = os.path.join(out, "adapter")
    cfgj = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
    assert cfgj["peft_type"] == "LORA" and cfgj["r"] == 4 and cfgj["lora_alpha"] == 8
    x = torch.randint(0, 300, (2, 16))
    base = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter_dir)
    merged = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a = with_adapter(input_ids=x).logits
        b = merged(input_ids=x).logits
        c = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)(input_ids=x).logits
    assert rel_diff(a, b) < 1e-5
    assert rel_diff(c, b) > 1e-4  # the adapter changes the model


def test_lora_resume_is_exact(tiny_model, tmp_path):
    """LoRA stop after 1 step + train.resume=latest equals the uninterrupted run (losses and adapters)."""
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    full, r_full = run_pipeline(tiny_model, str(tmp_path / "full"), "backend=[cpu,cpu]", *LORA)
    first, _ = run_pipeline(tiny_model, str(tmp_path / "a"), "backend=[cpu,cpu]", *LORA, ck, "train.stop_after=1")
    rest, r_res = run_pipeline(tiny_model, str(tmp_path / "b"), "backend=[cpu,cpu]", *LORA, ck, "train.resume=latest")
    assert first + rest == full
    for k in r_full.manifest["index"]:
        if k.startswith(("master.", "exp_avg")):
            assert torch.equal(r_full.get(k), r_res.get(k)), k


def test_lora_family_matches_peft_and_exports(tiny_family_model, tmp_path):
    """Qwen2 / Qwen3 / Mistral: LoRA at P = 2 equals the peft reference (Qwen2's q/k/v biases stay frozen, as
    peft's ``bias="none"``); the export's merged model loads as the family's class with no missing or
    unexpected keys and equals the base + PEFT adapter. Losses within 1e-5 relative, adapters within 5e-4: the
    peft reference itself moves by up to 1.0e-4 (Qwen2 k_proj lora_A) between fp32 and fp64, as A's gradient is
    proportional to B (zero at step 0) and Adam's first steps divide tiny gradients by their own size; the
    pipeline differed by up to 2.1e-4 (Qwen2 o_proj lora_B), Qwen3 and Mistral passed 1e-4."""
    from transformers import AutoModelForCausalLM

    from npu_train.checkpoint.export import export_hf

    model = tiny_family_model
    ref_losses, ref_adapters = _peft_reference(model, make_cfg(model, *LORA))
    losses, reader = run_pipeline(model, str(tmp_path / "run"), "backend=[cpu,cpu]", *LORA)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < 1e-5, (losses, ref_losses)
    worst = max((rel_diff(reader.get(f"master.{name}"), w), name) for name, w in ref_adapters.items())
    assert worst[0] < 5e-4, worst
    assert not [k for k in reader.manifest["index"] if k.startswith("master.") and "lora_" not in k]
    out = export_hf(reader.path, str(tmp_path / "export"), "fp32")
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter"))
    merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert type(merged).__name__ == json.load(open(os.path.join(model, "config.json")))["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        assert rel_diff(with_adapter(input_ids=x).logits, merged(input_ids=x).logits) < 1e-5
