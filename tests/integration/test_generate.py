"""``python -m npu_train.generate`` on a trained checkpoint: transformers' greedy generation on the export
equals greedy decoding with the trainer's own model (written here from argmax over its logits)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import run_pipeline


def _own_greedy(model_path_or_reader, cfg, prompt_ids: list[int], n: int) -> list[int]:
    from npu_train.model.llama import full_model

    m = full_model(cfg)
    sd = {name: model_path_or_reader.get(f"master.{name}") for name, _ in m.named_parameters()}
    m.load_state_dict(sd, strict=False)
    if cfg.tie_word_embeddings:
        m.lm_head.weight = m.model.embed_tokens.weight
    m.eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = m(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_generate_from_checkpoint_matches_own_greedy(tiny_model, tmp_path):
    from npu_train.generate import generate, load_for_generation
    from npu_train.model.config import LlamaConfig

    _, reader = run_pipeline(tiny_model, str(tmp_path / "run"), "backend=[cpu]", "train.steps=2")
    ckpt = reader.path
    model, tok = load_for_generation(ckpt, str(tmp_path / "wd"))
    prompt = "The master of the school"
    text = generate(model, tok, prompt, chat=False, max_new_tokens=8)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    expect = _own_greedy(reader, LlamaConfig.from_dict(reader.manifest["model"]), ids, 8)
    eos = tok.eos_token_id
    if eos in expect:
        expect = expect[:expect.index(eos)]
    assert text == tok.decode(expect, skip_special_tokens=True)


def test_generate_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "npu_train.generate", str(tmp_path / "nope"), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr


def test_generate_gguf_without_accelerate():
    """``embedded`` (a GGUF file) generates on the plain install, where ``accelerate`` (which transformers'
    GGUF reader requires) is absent: the subprocess makes it unimportable (``sys.modules[...] = None`` is
    what ``find_spec`` and ``import`` see for a package that is not installed)."""
    from npu_train.model import embedded_model_path

    try:
        embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    code = ("import sys; sys.modules['accelerate'] = None; from npu_train.generate import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "embedded", "--prompt", "What is 2+2?", "--max-new-tokens", "12"],
                       capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout, r.stdout  # greedy SmolLM2-135M-Instruct: "The answer to this classic math problem is 4."
