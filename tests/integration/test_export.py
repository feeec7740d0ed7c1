"""A pipeline checkpoint exported to an HF directory loads in transformers and gives our logits."""
from __future__ import annotations

import pytest
import torch

from conftest import run_pipeline

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_untied"])
def test_export_loads_in_transformers(request, tmp_path, fixture):
    transformers = pytest.importorskip("transformers")
    from npu_train.checkpoint.export import export_hf
    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import full_model

    model = request.getfixturevalue(fixture)
    _, reader = run_pipeline(model, str(tmp_path / "run"), "backend=[cpu,cpu]", "train.steps=2")
    out = export_hf(reader.path, str(tmp_path / "hf"), dtype="fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    cfg = LlamaConfig.from_dict(reader.manifest["model"])
    ours = full_model(cfg)
    ours.load_named_tensors({n: reader.get(f"master.{n}") for n in ours.param_names()})
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits.float() - ours(ids)).abs().max().item()
    assert diff < 1e-4, diff
    # weights changed by training (the export is not just the initial model)
    from npu_train.model import load_tensors
    init = load_tensors(model, cfg, ["model.norm.weight"])["model.norm.weight"]
    assert not torch.equal(init, reader.get("master.model.norm.weight"))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    assert len(tok) == cfg.vocab_size


def test_family_export_loads_as_same_class(tiny_family_model, tmp_path):
    """Qwen2 / Qwen3 / Mistral: pipeline checkpoint -> export -> ``from_pretrained`` is the family's class with
    no missing or unexpected keys (q/k/v biases, q/k norms) and gives our logits."""
    import json

    transformers = pytest.importorskip("transformers")
    from npu_train.checkpoint.export import export_hf
    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import full_model

    model = tiny_family_model
    _, reader = run_pipeline(model, str(tmp_path / "run"), "backend=[cpu,cpu]", "train.steps=2")
    out = export_hf(reader.path, str(tmp_path / "hf"), dtype="fp32")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                 output_loading_info=True)
    with open(f"{model}/config.json") as f:
        assert type(hf).__name__ == json.load(f)["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    cfg = LlamaConfig.from_dict(reader.manifest["model"])
    ours = full_model(cfg)
    ours.load_named_tensors({n: reader.get(f"master.{n}") for n in ours.param_names()})
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf.eval()(ids).logits.float() - ours(ids)).abs().max().item()
    assert diff < 1e-4, diff
