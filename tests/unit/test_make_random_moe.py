"""``experiments/bench/make_random_moe.py`` says what it does while it does it: a fresh-clone review saw ~10 s of
silence while it built the model and then one line of 125 columns. Each phase (imports, the build, the write)
now has a line printed before it starts, and every line fits 100 columns, folded at words. The model here is a
stand-in with the real one's interface (building the real one takes seconds and ~0.4 GiB at the smallest)."""
from __future__ import annotations

import os
import sys

import pytest

from scripts import REPO, load_script


@pytest.fixture
def script(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    return load_script(os.path.join(REPO, "experiments", "bench", "make_random_moe.py"), "_npt_make_random_moe")


def test_each_phase_is_announced_before_it_runs_within_100_columns(script, monkeypatch, capsys, tmp_path):
    import torch
    import transformers

    seen = {}

    class Model:  # transformers' Qwen3MoeForCausalLM as the script uses it
        def __init__(self, cfg):
            seen["before build"] = capsys.readouterr().out
            self.w = torch.nn.Parameter(torch.zeros(3, 5))

        def named_parameters(self):
            return [("model.layers.0.mlp.gate.weight", self.w)]

        def parameters(self):
            return [self.w]

        def save_pretrained(self, out, max_shard_size):
            seen["before write"] = capsys.readouterr().out
            assert os.path.isdir(out) and max_shard_size == "2GB"

    def never(*a, **k):
        raise AssertionError("the real model was built")

    # transformers' lazy module puts another module object into sys.modules once its names are loaded: load
    # them, replace the class on the object an import statement reads, and make the real class refuse to build
    # (never gigabytes, whatever transformers does)
    real = transformers.Qwen3MoeForCausalLM
    assert transformers.Qwen3MoeConfig is not None
    monkeypatch.setattr(real, "__init__", never)
    monkeypatch.setattr(sys.modules["transformers"], "Qwen3MoeForCausalLM", Model)
    out = tmp_path / "moe"
    monkeypatch.setattr(sys, "argv", ["make_random_moe.py", "--layers", "2", "--experts", "4", "--moe-intermediate",
                                      "8", "--top-k", "2", "--vocab", "49152", "--out", str(out)])
    script.main()
    rest = capsys.readouterr().out
    assert "importing torch and transformers" in seen["before build"]
    assert "building a random Qwen3-MoE of 2 layer(s) x 4 experts of 8 (top-2)" in " ".join(
        seen["before build"].split()), seen
    assert "writing 0.000 B params" in seen["before write"] and str(out) in " ".join(seen["before write"].split())
    text = seen["before build"] + seen["before write"] + rest
    assert "wrote a random Qwen3-MoE" in rest and (out / "tokenizer.json").is_file()
    for line in text.splitlines():
        assert len(line) <= 100 or " " not in line.strip().removesuffix(" ..."), line  # or a long path alone
        assert line.startswith(("make_random_moe: [", "  ")), line
    # data.format=chat takes the output: it refused it ("the model has no chat template") before the script wrote
    # the embedded SmolLM2's ChatML template and special tokens beside its tokenizer
    from npu_train.model import chat_template, embedded_model_path, special_tokens

    want = chat_template(embedded_model_path())
    assert want and "<|im_start|>" in want and chat_template(str(out)) == want
    assert special_tokens(str(out)) == special_tokens(embedded_model_path())
