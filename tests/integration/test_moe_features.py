"""What works for dense models works for mixtures of experts (issue 37), on a tiny Qwen3-MoE (8 experts, top-2):
LoRA with trained routers and the aux loss (export: PEFT adapter on transformers' model == merged export), exact
resume, dp x pp with ZeRO-1, DPO and packed SFT against the single-process references, generate from a checkpoint.
"""
from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

from conftest import make_cfg, make_tiny_model, reference_for, rel_diff, run_pipeline

pytestmark = pytest.mark.timeout(400)

AUX = "train.moe_aux_loss=0.3"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    """Every layer sparse (PEFT 0.21 drops MLP adapters of dense layers in a MoE model when it loads them)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_moe_all")), family="qwen3_moe", tied=False, layers=4,
                           mlp_only_layers=[])


def _same(losses, ref_losses, reader, ref_w, tol=1e-5, wtol=5e-5):
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) / abs(b) < tol, (losses, ref_losses)
    for name, w in ref_w.items():
        assert rel_diff(reader.get(f"master.{name}"), w) < wtol, name


def test_lora_with_router_exports_peft_and_merged(moe_model, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    from npu_train.checkpoint.export import export_hf

    lora = ("train.mode=lora", "lora.rank=4", "lora.alpha=8", "lora.train_router=true", AUX, "train.lr=1e-2")
    _, reader = run_pipeline(moe_model, str(tmp_path / "run"), "backend=[cpu,cpu]", *lora)
    names = reader.manifest["index"]
    assert any(".experts.7.down_proj.lora_B" in k for k in names) and "master.model.layers.3.mlp.gate.weight" in names
    out = export_hf(reader.path, str(tmp_path / "export"), "fp32")
    x = torch.randint(0, 300, (2, 16))
    base = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32)
    with torch.no_grad():
        c = base(input_ids=x).logits
        with warnings.catch_warnings():  # PEFT's RuntimeWarnings: part of the adapter's config matched nothing
            warnings.simplefilter("error", RuntimeWarning)
            a = peft.PeftModel.from_pretrained(base, os.path.join(out, "adapter"))(input_ids=x).logits
        merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert type(merged).__name__ == "Qwen3MoeForCausalLM"
        b = merged(input_ids=x).logits
    assert rel_diff(a, b) < 1e-5
    assert rel_diff(c, b) > 1e-4  # the adapters and routers changed the model


@pytest.mark.parametrize("mode", [("train.mode=full",), ("train.mode=lora", "lora.train_router=true")])
def test_resume_is_exact_with_aux_loss(moe_model, tmp_path, mode):
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    run = ("backend=[cpu,cpu]", "train.steps=4", AUX) + mode
    full, r_full = run_pipeline(moe_model, str(tmp_path / "full"), *run)
    first, _ = run_pipeline(moe_model, str(tmp_path / "a"), *run, ck, "train.stop_after=2")
    rest, r_res = run_pipeline(moe_model, str(tmp_path / "b"), *run, ck, "train.resume=latest")
    assert first + rest == full
    for k in r_full.manifest["index"]:
        if k.startswith(("master.", "exp_avg")):
            assert torch.equal(r_full.get(k), r_res.get(k)), k


def test_dp2_zero1_with_aux_matches_reference(moe_model, tmp_path):
    """dp = 2 x pp = 2, ZeRO-1, aux on: the mean aux over all 8 micro-batches of both replicas, as one process
    with accumulation 8."""
    ref_losses, ref_w = reference_for(moe_model, "train.accum=8", aux_weight=0.3)
    losses, reader = run_pipeline(moe_model, str(tmp_path), "backend=[cpu,cpu,cpu,cpu]", "parallel.dp=2",
                                  "parallel.zero=1", "train.schedule=1f1b", AUX)
    _same(losses, ref_losses, reader, ref_w)


def test_dpo_matches_reference(moe_model, tmp_path):
    from test_dpo_launch import _dpo_overrides, _reference

    ov = _dpo_overrides(tmp_path)
    ref_losses, ref_w = _reference(moe_model, *ov)
    losses, reader = run_pipeline(moe_model, str(tmp_path / "run"), "backend=[cpu,cpu]", *ov)
    # the dense DPO test's weight tolerance (test_dpo_launch: 3e-5): two models' forward passes a step, and AdamW
    # magnifies fp32 rounding in near-zero gradients: on an AMD EPYC host (avx512_bf16) o_proj's master differs by
    # 1.18e-5, at 0ee995b as now. An aux loss of 0.001 turned on in the pipeline alone still fails the losses' 1e-5
    _same(losses, ref_losses, reader, ref_w, wtol=3e-5)


def test_packed_sft_matches_reference(moe_model, tmp_path):
    """Packed rows (positions restart per sample): routing is per token, so each sample alone gives the same."""
    from test_pipeline_equivalence import _prompt_completion_rows

    ov = (f"data.source={_prompt_completion_rows(tmp_path)}", "data.format=prompt_completion", "data.seq_len=96")
    ref_losses, ref_w = reference_for(moe_model, *ov)
    losses, reader = run_pipeline(moe_model, str(tmp_path / "run"), "backend=[cpu,cpu]", *ov)
    _same(losses, ref_losses, reader, ref_w, wtol=1e-5)


def test_generate_from_checkpoint(moe_model, tmp_path):
    from npu_train.generate import generate, load_for_generation

    _, reader = run_pipeline(moe_model, str(tmp_path / "run"), "backend=[cpu]", "train.steps=1")
    model, tok = load_for_generation(reader.path, str(tmp_path / "wd"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    text = generate(model, tok, "The master of the school", chat=False, max_new_tokens=6)
    assert isinstance(text, str)
