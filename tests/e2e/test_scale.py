"""A ~0.2 B Llama with the 128,256 vocabulary, saved in bf16 as the Hub holds checkpoints, full fine-tuning on two
CPU cards: train, save, resume, export, with every card's peak anonymous + shared RSS (sampled from outside every
0.1 s through every phase, the bf16 -> fp32 load included, tests/memwatch.py) within its plan (plan.json)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

INTEG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration")
sys.path.insert(0, INTEG)

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1500)]

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4,
             num_hidden_layers=4, vocab_size=128256, tie_word_embeddings=True)
RUN = ("data.seq_len=64", "train.micro_batch=1", "train.accum=2", "train.warmup_steps=1", "train.lr=1e-4",
       "checkpoint.keep=0")


def _model(path: str) -> str:
    import importlib.util

    spec = importlib.util.spec_from_file_location("integration_conftest", os.path.join(INTEG, "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from transformers import LlamaConfig, LlamaForCausalLM

    mod.make_tiny_model(path)  # its tokenizer.json (ids < 384 < the model's vocabulary)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, bos_token_id=0, eos_token_id=0, max_position_embeddings=512))
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)  # bf16, as downloaded
    return path


def _watched(tmp_path, model, *overrides, name):
    from launch_util import watched_job

    job, peaks = watched_job(tmp_path, model, *RUN, *overrides, name=name, env={"NPT_CALIBRATE": "never"})
    with open(os.path.join(job.run_dir, "plan.json")) as f:
        doc = json.load(f)
    assert doc["shape"]["checkpoint_dtype"] == "bf16"
    plan = {st["card"]: int(st["mem"]["total"]) for st in doc["stages"]}
    return job, peaks, plan


def test_scale_train_save_resume_export(tmp_path):
    model = _model(str(tmp_path / "model"))
    ck = str(tmp_path / "ckpt")
    straight, _, _ = _watched(tmp_path, model, "train.steps=6", f"checkpoint.dir={str(tmp_path / 'ck0')}",
                              name="straight")
    first, peaks1, plan = _watched(tmp_path, model, "train.steps=6", "train.stop_after=4", f"checkpoint.dir={ck}",
                                   name="first")
    again, peaks2, _ = _watched(tmp_path, model, "train.steps=6", "train.resume=latest", f"checkpoint.dir={ck}",
                                name="resume")
    report = {c: {"plan_gib": plan[c] / 2**30,
                  **{f"{run}:{ph}": v / 2**30 for run, pk in (("first", peaks1), ("resume", peaks2))
                     for ph, v in pk[c].by_phase.items()}} for c in plan}
    print(json.dumps(report, indent=1))
    assert straight.losses()[4:] == again.own_losses(), (straight.losses(), first.losses(), again.losses())
    assert again.losses() == first.losses() + again.own_losses()  # the first launch's steps carried over
    for c, limit in plan.items():
        for pk in (peaks1, peaks2):
            assert pk[c].anon_shared <= limit, f"{c}: peak {pk[c].anon_shared / 2**30:.2f} GiB > plan {limit / 2**30:.2f}\n{report}"
    # export, then transformers' logits from the export equal those from the checkpoint's masters
    from npu_train.checkpoint.export import export_hf
    from npu_train.checkpoint.store import CheckpointReader, find_checkpoint
    from transformers import LlamaForCausalLM

    out = export_hf(ck, str(tmp_path / "hf"), dtype="fp32")
    reader = CheckpointReader(find_checkpoint("latest", ck))
    ref = LlamaForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    ref.load_state_dict({n: reader.get(f"master.{n}") for n in ref.state_dict() if n != "lm_head.weight"}, strict=False)
    ref.tie_weights()
    got = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    ids = torch.arange(1, 33).view(1, -1)
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)
