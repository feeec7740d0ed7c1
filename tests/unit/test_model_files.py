"""The model package's public weight check, non-finite weights and the error bases."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from npu_train.data import DataError
from npu_train.errors import UserError
from npu_train.model import ModelFormatError, check_weights, load_config, load_tensors, load_tokenizer


def _tiny_dir(tmp_path, *, poison: str | None = None, drop: str | None = None, reshape: str | None = None):
    """A 2-layer untied Llama as config.json + model.safetensors (random fp32 weights)."""
    d = tmp_path / "tiny"
    d.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
           "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(cfg))
    mcfg = load_config(str(d))
    shapes = dict(mcfg.param_shapes(None))
    for i in range(mcfg.num_layers):
        shapes.update(mcfg.param_shapes(i))
    g = torch.Generator().manual_seed(0)
    ts = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    if poison:
        ts[poison].view(-1)[3] = float("inf")
    if drop:
        del ts[drop]
    if reshape:
        ts[reshape] = torch.zeros(3, 3)
    save_file(ts, str(d / "model.safetensors"))
    return str(d), mcfg, list(shapes)


def test_error_bases():
    assert issubclass(ModelFormatError, UserError) and issubclass(ModelFormatError, ValueError)
    assert issubclass(DataError, UserError) and issubclass(DataError, ValueError)


def test_check_weights_ok_missing_and_shape(tmp_path):
    d, mcfg, _ = _tiny_dir(tmp_path)
    check_weights(d, mcfg)
    d2, mcfg2, _ = _tiny_dir(tmp_path / "a", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ModelFormatError, match=r"'model.layers.1.mlp.up_proj.weight' not found"):
        check_weights(d2, mcfg2)
    d3, mcfg3, _ = _tiny_dir(tmp_path / "b", reshape="model.norm.weight")
    with pytest.raises(ModelFormatError, match=r"shape \(3, 3\), expected \(16,\).*re-download"):
        check_weights(d3, mcfg3)


def test_non_finite_weight_is_one_line_error(tmp_path):
    bad = "model.layers.1.self_attn.k_proj.weight"
    d, mcfg, names = _tiny_dir(tmp_path, poison=bad)
    check_weights(d, mcfg)  # headers are fine; values are checked on load
    ok = load_tensors(d, mcfg, ["model.layers.0.self_attn.k_proj.weight"])  # a stage without it loads
    assert torch.isfinite(ok["model.layers.0.self_attn.k_proj.weight"]).all()
    with pytest.raises(ModelFormatError) as ei:
        load_tensors(d, mcfg, names)
    msg = str(ei.value)
    assert "\n" not in msg and bad in msg and "non-finite" in msg, msg


def test_hf_dir_without_tokenizer_is_one_line(tmp_path):
    d, _, _ = _tiny_dir(tmp_path)
    with pytest.raises(ModelFormatError) as ei:
        load_tokenizer(d)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert "tokenizer.json" in msg and "tokenizer_config.json" in msg and "model.tokenizer=" in msg, msg


def test_hf_dir_without_tokenizer_json_says_so(tmp_path):
    """A model directory with tokenizer_config.json but no tokenizer.json (transformers cannot build a fast
    tokenizer from that alone): the one line names the missing file, the directory and both fixes."""
    d, _, _ = _tiny_dir(tmp_path)
    (tmp_path / "tiny" / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    with pytest.raises(ModelFormatError) as ei:
        load_tokenizer(d)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    assert f"no tokenizer.json in {d}" in msg, msg
    assert f"copy the model's tokenizer.json into {d}" in msg and "model.tokenizer=" in msg, msg


def test_tokenizer_json_file_path(tmp_path):
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    p = tmp_path / "tok" / "tokenizer.json"
    p.parent.mkdir()
    t.save(str(p))
    assert load_tokenizer(str(p)).encode("a").ids == [0]
    assert os.path.isfile(p)


def _sharded(d: str) -> None:
    """Split ``d``'s model.safetensors into two shards with a transformers-style index."""
    from safetensors.torch import load_file

    ts = load_file(os.path.join(d, "model.safetensors"))
    os.remove(os.path.join(d, "model.safetensors"))
    names = sorted(ts)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fn, ns in parts.items():
        save_file({n: ts[n] for n in ns}, os.path.join(d, fn))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {n: fn for fn, ns in parts.items() for n in ns}}, f)


@pytest.mark.parametrize("case", ["missing", "shape", "shard-gone", "not-in-shard"])
def test_check_and_load_walk_shards_with_one_message(tmp_path, case):
    """The header check (check_weights) and the loader (load_tensors) walk the shards the same way
    (model.hf.safetensors_walk): the same one-line error, naming the tensor or file and the fix."""
    drop = "model.layers.1.mlp.up_proj.weight" if case == "missing" else None
    d, mcfg, names = _tiny_dir(tmp_path, drop=drop, reshape="model.norm.weight" if case == "shape" else None)
    if drop:
        names.remove(drop)
        names.append(drop)  # the loader is asked for it like any stage would be
    if case in ("shard-gone", "not-in-shard"):
        _sharded(d)
        if case == "shard-gone":
            os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
        else:  # the index names a shard that does not hold the tensor
            idx = os.path.join(d, "model.safetensors.index.json")
            with open(idx) as f:
                wm = json.load(f)
            here = wm["weight_map"]["model.norm.weight"]
            wm["weight_map"]["model.norm.weight"] = next(fn for fn in set(wm["weight_map"].values()) if fn != here)
            with open(idx, "w") as f:
                json.dump(wm, f)
    with pytest.raises(ModelFormatError) as checked:
        check_weights(d, mcfg)
    with pytest.raises(ModelFormatError) as loaded:
        load_tensors(d, mcfg, names)
    msg = str(checked.value)
    assert str(loaded.value) == msg
    assert "\n" not in msg and "re-download" in msg, msg
    want = {"missing": drop, "shape": "has shape (3, 3), expected (16,)", "shard-gone": "shard listed in the index is missing",
            "not-in-shard": "'model.norm.weight' not found in"}[case]
    assert want in msg, msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_is_the_entrywise_check(dtype):
    """``all_finite`` (a sum first, the entry-wise check only when the sum is not finite) says what
    ``isfinite(t).all()`` says: an inf, a -inf, a NaN, inf and -inf together (their sum NaN) anywhere are found;
    finite entries whose sum overflows (2 x the dtype's largest) are finite; empty and integer tensors are."""
    from npu_train.model.files import all_finite

    big = torch.finfo(dtype).max
    t = torch.linspace(-1.0, 1.0, 1000).to(dtype)
    assert all_finite(t) and all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.arange(5))
    for bad in ([float("inf")], [float("-inf")], [float("nan")], [float("inf"), float("-inf")]):
        u = t.clone()
        u[torch.arange(len(bad)) * 7 + 500] = torch.tensor(bad, dtype=dtype)
        assert not all_finite(u), bad
        assert not all_finite(u.reshape(10, 100).t())  # not contiguous
    over = torch.full((4,), big, dtype=dtype)
    assert not bool(torch.isfinite(over.sum())) and all_finite(over)


@pytest.mark.parametrize("typed, preset", [("qwen3-30b-a3", "qwen3-30b-a3b"), ("Llama-3.1-8", "llama-3.1-8b"),
                                           ("Qwen/Qwen3-8", "qwen3-8b")])
def test_a_misspelt_preset_is_named(tmp_path, typed, preset):
    """A missing model path that reads like a misspelt shape preset or HF id (made absolute by the launcher) gets
    "did you mean the preset <name>?", as a misspelt key gets its key; an unrelated path gets no guess."""
    from npu_train.model.files import check_exists

    with pytest.raises(FileNotFoundError, match=rf"did you mean the preset {re.escape(preset)}\? otherwise pass"):
        check_exists(str(tmp_path / typed))
    with pytest.raises(FileNotFoundError) as e:
        check_exists(str(tmp_path / "my-finetune"))
    assert "did you mean" not in str(e.value) and "shape preset: " in str(e.value)
    with pytest.raises(FileNotFoundError) as e:  # generate takes no preset: no guess either
        check_exists(str(tmp_path / typed), presets=False)
    assert "did you mean" not in str(e.value)
