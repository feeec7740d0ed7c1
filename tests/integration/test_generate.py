"""``python -m npu_train.generate`` on a trained checkpoint: transformers' greedy generation on the export
equals greedy decoding with the trainer's own model (written here from argmax over its logits)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import run_pipeline
from npu_train.errors import one_refusal


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


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """``(run dir, CheckpointReader of its checkpoint)`` of a 2-step run of the tiny model (one per module)."""
    run = tmp_path_factory.mktemp("generate") / "run"
    _, reader = run_pipeline(tiny_model, str(run), "backend=[cpu]", "train.steps=2")
    return run, reader


def test_generate_from_checkpoint_matches_own_greedy(trained, tmp_path):
    from npu_train.generate import generate, load_for_generation
    from npu_train.model.config import LlamaConfig

    _, reader = trained
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


def test_generate_says_what_the_shard_merge_does(trained, tmp_path):
    """Loading a checkpoint merges its shards (13.5 s without a line on a loaded 2-core host): the export's own
    progress lines (tensors, GiB, the tokenizer) come through ``note``."""
    from npu_train.generate import load_for_generation

    _, reader = trained
    notes: list[str] = []
    load_for_generation(reader.path, str(tmp_path / "wd"), note=notes.append)
    merge = [n for n in notes if n.startswith("export: ")]
    assert any(re.search(r"\d+ tensors, [0-9.]+ [kMG]?B fp32", n) for n in merge), notes  # the header
    assert any(n.startswith("export: tokenizer from") for n in merge), notes


def test_generate_cli_errors_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "npu_train.generate", str(tmp_path / "nope"), "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert one_refusal(r.stderr), r.stderr


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
    assert "generate: [" in r.stderr and "loading gguf" in r.stderr  # it says what it does while it loads
    assert "4" in r.stdout, r.stdout  # greedy SmolLM2-135M-Instruct: "The answer to this classic math problem is 4."


def _truncate(path, size=None) -> None:
    """Cut the file ``path`` to ``size`` bytes (default: half of it), as an interrupted copy leaves it."""
    size = os.path.getsize(path) // 2 if size is None else size
    with open(path, "r+b") as f:
        f.truncate(size)


def _two_checkpoints(reader, tmp_path):
    """A copy of the run's checkpoint as ``step_000001`` and ``step_000002`` of a new root; returns the root."""
    root = tmp_path / "checkpoints"
    for name in ("step_000001", "step_000002"):
        shutil.copytree(reader.path, root / name)
    return root


# (id, the <model> argument made from (run dir, reader, tiny model, tmp_path), text the one error line must hold)
BAD_MODELS = [
    ("checkpoint-shard-file", lambda run, rd, tiny, tmp: os.path.join(rd.path, "stage_000.safetensors"),
     lambda run, rd, tmp: [f"is one file of the checkpoint {rd.path}", f"pass the directory {rd.path}"]),
    ("run-dir", lambda run, rd, tiny, tmp: str(run),
     lambda run, rd, tmp: ["is a run directory", f"pass {run}/checkpoints"]),
    ("empty-dir", lambda run, rd, tiny, tmp: (os.makedirs(tmp / "empty"), str(tmp / "empty"))[1],
     lambda run, rd, tmp: [f"{tmp}/empty has no config.json", "<run>/checkpoints/step_N", ".gguf", "'embedded'"]),
    ("export-adapter-dir", lambda run, rd, tiny, tmp: _fake_export_adapter(tmp, tiny),
     lambda run, rd, tmp: ["LoRA adapters only", f"pass the export directory {tmp}/export,"]),
    ("truncated-shard", lambda run, rd, tiny, tmp: (_truncate(
        _two_checkpoints(rd, tmp) / "step_000002" / "stage_000.safetensors"), str(tmp / "checkpoints" / "step_000002"))[1],
     lambda run, rd, tmp: [f"{tmp}/checkpoints/step_000002/stage_000.safetensors", "truncated or corrupt",
                           f"use an earlier checkpoint, e.g. {tmp}/checkpoints/step_000001"]),
    ("truncated-manifest", lambda run, rd, tiny, tmp: (_truncate(
        _two_checkpoints(rd, tmp) / "step_000002" / "manifest.json", 1000), str(tmp / "checkpoints" / "step_000002"))[1],
     lambda run, rd, tmp: [f"{tmp}/checkpoints/step_000002/manifest.json", "damaged",
                           f"use an earlier checkpoint, e.g. {tmp}/checkpoints/step_000001"]),
    ("truncated-hf-weights", lambda run, rd, tiny, tmp: (shutil.copytree(tiny, tmp / "hf"),
                                                         _truncate(tmp / "hf" / "model.safetensors"), str(tmp / "hf"))[2],
     lambda run, rd, tmp: [f"{tmp}/hf/model.safetensors", "re-download"]),
]


def _fake_export_adapter(tmp, tiny) -> str:
    """An export directory of a LoRA run: the merged model (here the tiny model) and ``adapter/``."""
    shutil.copytree(tiny, tmp / "export")
    os.makedirs(tmp / "export" / "adapter")
    (tmp / "export" / "adapter" / "adapter_config.json").write_text("{}")
    (tmp / "export" / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    return str(tmp / "export" / "adapter")


@pytest.mark.parametrize("make,expect", [b[1:] for b in BAD_MODELS], ids=[b[0] for b in BAD_MODELS])
def test_generate_bad_model_is_one_error_line(trained, tiny_model, tmp_path, capsys, make, expect):
    """Each wrong or damaged ``<model>`` is one ``error:`` line naming the path and what to pass instead,
    exit status 2 (no traceback, no transformers message about a missing config.json)."""
    from npu_train.generate import main

    run, reader = trained
    model = make(run, reader, tiny_model, tmp_path)
    rc = main([model, "--prompt", "hi", "--max-new-tokens", "2", "--no-chat"])  # the tiny model has no template
    err = capsys.readouterr().err
    assert rc == 2, err
    # progress lines ("generate: [  0.4 s] loading ...", folded at words: "  " on) may come first; the failure
    # is one error line
    err = "".join(l for l in err.splitlines(keepends=True) if not l.startswith("generate: ["))
    err = err[err.find("error: "):] if "error: " in err else err  # a progress line's folded rest
    msg = one_refusal(err)
    assert msg, err
    for text in expect(run, reader, tmp_path):
        assert text in msg, (text, err)


@pytest.mark.parametrize("what", ["hf", "checkpoint"])
def test_generate_no_chat_template_is_refused_before_loading(trained, tiny_model, monkeypatch, capsys, what):
    """Chat mode (the default) on a model without a chat template (the tiny model has none): the refusal comes
    from the model's files before any weight is read; a checkpoint's shards are not merged (a fresh-clone try
    waited ~17 s of merging and loading for the same line)."""
    import npu_train.checkpoint.export as export
    import transformers

    from npu_train.generate import main

    def loaded(*a, **k):
        raise AssertionError("weights loaded before the chat template was checked")

    monkeypatch.setattr(export, "export_hf", loaded)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    model = tiny_model if what == "hf" else trained[1].path
    assert main([model, "--prompt", "hi"]) == 2
    msg = one_refusal(capsys.readouterr().err)
    assert msg == "error: the model has no chat template: pass --no-chat to send the prompt as raw text", msg


def test_generate_ctrl_c_is_one_line(monkeypatch, capsys):
    """Ctrl-C while the model loads: one line on stderr, exit 130, no KeyboardInterrupt traceback."""
    import npu_train.generate as gen

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "load_for_generation", interrupted)
    assert gen.main(["embedded", "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "generate: interrupted" and "Traceback" not in err


def test_generate_empty_raw_prompt_is_refused_before_loading(monkeypatch, capsys):
    """``--prompt '' --no-chat`` (issue 41, fault 12): nothing to continue from; refused with one line naming the
    fix, exit 2, before the model is loaded (it crashed after the load with ``cannot reshape tensor of 0
    elements``)."""
    import npu_train.generate as gen

    loaded = []
    monkeypatch.setattr(gen, "load_for_generation", lambda *a, **k: loaded.append(a) or (_ for _ in ()).throw(
        AssertionError("loaded")))
    assert gen.main(["embedded", "--prompt", "", "--no-chat"]) == 2
    err = capsys.readouterr().err
    msg = one_refusal(err)
    assert msg and msg.startswith("error: --prompt '' with --no-chat") and "pass some text" in msg, err
    assert not loaded


def test_generate_progress_lines_fit_100_columns(monkeypatch, capsys, tmp_path):
    """A progress line naming a long model path (105 columns in a fresh-clone review) is folded at words to 100
    columns; the path itself stays whole."""
    import npu_train.generate as gen

    path = str(tmp_path / "a-long-run-directory-name" / "checkpoints" / "step_000020")

    def loading(model, wd, note, base=None, chat=False):
        note(f"loading npu-train checkpoint {path} (imports first) ...")
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "load_for_generation", loading)
    assert gen.main([path, "--prompt", "hi"]) == 130
    err = capsys.readouterr().err
    assert path in err and all(len(l) <= 100 or " " not in l.strip() for l in err.splitlines()), err
