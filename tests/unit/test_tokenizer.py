"""The GGUF tokenizer follows ``tokenizer.ggml.pre`` like llama.cpp (``llm_tokenizer_bpe``).

Expected pre-token pieces below are worked out by hand from each rule's regexes (applied in
order, every match and gap a piece) — not produced by the code under test; ids are then the
BPE of each piece in the model's vocabulary.
"""
from __future__ import annotations

import os

import pytest

from npu_train.errors import UserError
from npu_train.model import ModelFormatError, embedded_model_path, load_tokenizer
from npu_train.model.tokenizer import pre_tokenizer_for

pytest.importorskip("transformers")

# (text, {rule: pieces})
CASES = [
    ("  12", {
        "smollm": ["  ", "1", "2"],        # \p{N} first, then GPT-2: "\s+(?!\S)" takes both spaces
        "gpt2": [" ", " 12"],              # "\s+(?!\S)" backs off to one space, " ?\p{N}+"
        "llama3": [" ", " ", "12"],        # "\s+(?!\S)", then "\s+", then "\p{N}{1,3}"
        "default": [" ", " ", "12"],       # GPT-2 gives " ", " 12"; then "\p{N}+" splits "12" off
    }),
    ("I'm 2024 héllo!!", {
        "smollm": ["I", "'m", " ", "2", "0", "2", "4", " héllo", "!!"],
        "gpt2": ["I", "'m", " 2024", " héllo", "!!"],
        "llama3": ["I", "'m", " ", "202", "4", " héllo", "!!"],
        "default": ["I", "'", "m", " ", "202", "4", " héllo", "!!"],  # "'" is \p{P}: split first
    }),
    ("they'll pay 12345", {
        "smollm": ["they", "'ll", " pay", " ", "1", "2", "3", "4", "5"],
        "gpt2": ["they", "'ll", " pay", " 12345"],
        "llama3": ["they", "'ll", " pay", " ", "123", "45"],
        "default": ["they", "'", "ll", " pay", " ", "123", "45"],
    }),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py, written out)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


B2U = _bytes_to_unicode()


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory):
    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with pytest.MonkeyPatch.context() as mp:  # build it afresh, not from the user's cache
        mp.setenv("NPT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield load_tokenizer(path)


def test_embedded_gguf_uses_smollm_rule(smol_tok):
    assert smol_tok.encode("  12").ids == [256, 33, 34]  # issue 11: was [216, 216, 33, 34]


@pytest.mark.parametrize("rule", ["smollm", "gpt2", "llama3", "default"])
def test_pre_tokenizer_rules(smol_tok, rule):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(smol_tok.to_str())
    tok.pre_tokenizer = pre_tokenizer_for({"llama3": "llama-bpe", "gpt2": "gpt-2"}.get(rule, rule))
    for text, by_rule in CASES:
        pieces = by_rule[rule]
        assert "".join(pieces) == text
        got = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert got == ["".join(B2U[b] for b in p.encode("utf-8")) for p in pieces], (rule, text)
        want_ids = [t.id for p in pieces for t in tok.model.tokenize("".join(B2U[b] for b in p.encode("utf-8")))]
        assert tok.encode(text).ids == want_ids, (rule, text)


def test_unknown_pre_rule_refused():
    with pytest.raises(ModelFormatError, match=r"tokenizer.ggml.pre='deepseek-llm' is not a supported") as ei:
        pre_tokenizer_for("deepseek-llm", "m.gguf")  # (qwen2 is supported since issue 26)
    assert isinstance(ei.value, UserError) and "model.tokenizer=" in str(ei.value)


def test_the_documented_route_from_a_gguf_to_a_tokenizer_json(tmp_path):
    """docs/models.md asks an HF directory for a ``tokenizer.json``; its one-line route from the embedded GGUF
    writes one that tokenizes as the run does."""
    import re
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from npu_train.model import load_tokenizer, resolve_model_path

    repo = os.path.join(os.path.dirname(__file__), "..", "..")
    doc = open(os.path.join(repo, "docs", "models.md")).read()
    (code,) = re.findall(r'^\.venv/bin/python -c "(.*tokenizer\.json.*)"$', doc, flags=re.M)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(repo, "src")))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    text = "Botchan's \\u201cquick\\u201d tongue, 1906."
    assert (Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids
            == load_tokenizer(resolve_model_path("embedded")).encode(text).ids)
