"""Preference data (data.format=preference): pair layout, completion-only labels, truncation, bad rows, cache.

The expected tokens come from the definitions (TRL's preference formats), computed here with the shipped
SmolLM2 tokenizer and transformers' ``apply_chat_template``, never with the module under test."""
from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from npu_train.data import DataError
from npu_train.data.batches import micro_batch_tensors
from npu_train.data.packfile import PackedData, load_packed, save_packed
from npu_train.data.prepare import build_preference_data
from npu_train.data.render import ChatRenderer
from npu_train.model.llama import IGNORE_INDEX
from smol_chat import smol_chat

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

EOT = "<|im_end|>"
PAD = 0  # <|endoftext|>: never produced by the template or the rows below


@pytest.fixture(scope="module")
def smol():
    return smol_chat()


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def _build(smol, src, seq_len=64, val_fraction=0.0, **kw):
    kw.setdefault("log", lambda m: None)
    return build_preference_data(src, smol["renderer"], seq_len, val_fraction, pad_id=PAD, **kw)


def _split_row(ids: torch.Tensor, lab: torch.Tensor, pad: int = PAD) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of one unshifted row: the completion is where the labels are set; the
    labels there must equal the ids, everything after it ``pad``."""
    ids, lab = ids.tolist(), lab.tolist()
    on = [j for j, x in enumerate(lab) if x != IGNORE_INDEX]
    a, b = on[0], on[-1] + 1
    assert on == list(range(a, b)), "the completion is one contiguous run"
    assert lab[a:b] == ids[a:b]
    assert ids[b:] == [pad] * (len(ids) - b) and all(x == IGNORE_INDEX for x in lab[:a] + lab[b:])
    return ids[:a], ids[a:b]


def _pairs(d: PackedData, split: str = "train", pad: int = PAD) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) ids of every pair of a split; checks both rows share the prompt."""
    ids, mask = getattr(d, split), getattr(d, f"{split}_labels")
    lab = torch.where(mask.bool(), ids.to(torch.int64), IGNORE_INDEX)  # stored as a uint8 target mask
    assert ids.shape[0] % 2 == 0
    out = []
    for i in range(0, ids.shape[0], 2):
        p1, c = _split_row(ids[i], lab[i], pad)
        p2, r = _split_row(ids[i + 1], lab[i + 1], pad)
        assert p1 == p2, f"pair {i // 2}: the two rows must share the prompt tokens"
        out.append((p1, c, r))
    return out


def _enc(smol, text: str) -> list[int]:
    return smol["tok"].encode(text, add_special_tokens=False).ids


def _chat_ids(smol, msgs, gen=False) -> list[int]:
    out = smol["hf"].apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen, return_dict=True)
    return list(out["input_ids"])


# ------------------------------------------------------------------------------- the three formats
STANDARD = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "One plus one is", "chosen": " two, as everyone knows.", "rejected": " three."},
    {"prompt": "Name a fruit:", "chosen": " an apple", "rejected": " a chair"},
]


def test_standard_rows(smol, tmp_path):
    d = _build(smol, _write(tmp_path, STANDARD))
    eos = smol["cfg"].eos_token_id
    assert d.pairs and d.n_train == 2 * len(STANDARD) and d.n_val == 0
    assert d.train.shape == d.train_labels.shape == (6, 65) and d.train_labels.dtype == torch.uint8
    assert d.train_positions is None and d.val_positions is None
    for (p, c, r), row in zip(_pairs(d), STANDARD):
        assert p == _enc(smol, row["prompt"])  # SmolLM2's tokenizer adds no BOS
        assert c == _enc(smol, row["chosen"]) + [eos] and r == _enc(smol, row["rejected"]) + [eos]
        assert smol["tok"].decode(c, skip_special_tokens=False) == row["chosen"] + EOT
        assert smol["tok"].decode(r, skip_special_tokens=False) == row["rejected"] + EOT


def test_shifted_targets_score_only_the_completion(smol, tmp_path):
    """micro_batch_tensors' target at t is the token at t + 1 for completion tokens, IGNORE elsewhere."""
    d = _build(smol, _write(tmp_path, STANDARD))
    x, y = micro_batch_tensors(d, torch.arange(d.n_train))
    eos = smol["cfg"].eos_token_id
    for b in range(d.n_train):
        row = STANDARD[b // 2]
        p, c = _enc(smol, row["prompt"]), _enc(smol, row["rejected" if b % 2 else "chosen"]) + [eos]
        want = [IGNORE_INDEX] * (len(p) - 1) + c + [IGNORE_INDEX] * (64 - len(p) - len(c) + 1)
        assert y[b].tolist() == want
        assert x[b, : len(p) + len(c)].tolist() == p + c


CONV = [
    {"prompt": [{"role": "user", "content": "What is 12 + 30?"}],
     "chosen": [{"role": "assistant", "content": "It is 42."}],
     "rejected": [{"role": "assistant", "content": "Forty-three, I think."}]},
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hi."},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again, louder."}],
     "chosen": [{"role": "assistant", "content": "HI!"}],
     "rejected": [{"role": "assistant", "content": "no"}]},
]


def _check_conv(smol, d, convs, pad=PAD):
    for (p, c, r), row in zip(_pairs(d, pad=pad), convs):
        head = _chat_ids(smol, row["prompt"], gen=True)
        full_c = _chat_ids(smol, row["prompt"] + row["chosen"])
        full_r = _chat_ids(smol, row["prompt"] + row["rejected"])
        assert full_c[: len(head)] == head and full_r[: len(head)] == head
        assert p == head and c == full_c[len(head):] and r == full_r[len(head):]
        text = smol["tok"].decode(c, skip_special_tokens=False)
        assert text == row["chosen"][0]["content"] + EOT + "\n"


def test_conversational_rows(smol, tmp_path):
    d = _build(smol, _write(tmp_path, CONV))
    assert d.n_train == 4
    _check_conv(smol, d, CONV)


def test_implicit_prompt_conversations(smol, tmp_path):
    rows = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONV]
    d = _build(smol, _write(tmp_path, rows))
    _check_conv(smol, d, CONV)


def test_implicit_prompt_strings(smol, tmp_path):
    """The prompt is the longest common character prefix, less a trailing space (TRL's extract_prompt)."""
    rows = [{"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the hat."},
            {"chosen": "Paris is in France.", "rejected": "Paris is in Spain!"}]
    d = _build(smol, _write(tmp_path, rows))
    eos = smol["cfg"].eos_token_id
    want = [("The cat sat on the", " mat.", " hat."), ("Paris is in", " France.", " Spain!")]
    for (p, c, r), (wp, wc, wr) in zip(_pairs(d), want):
        assert (p, c, r) == (_enc(smol, wp), _enc(smol, wc) + [eos], _enc(smol, wr) + [eos])


def test_column_mapping_and_val_split(smol, tmp_path):
    rows = [{"q": f"Question {i}?", "good": f" Answer {i}.", "bad": " No."} for i in range(10)]
    fields = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    d = _build(smol, _write(tmp_path, rows), val_fraction=0.2, fields=fields)
    assert (d.n_train, d.n_val) == (16, 4)  # 8 + 2 pairs; the last 2 pairs are validation
    got = [smol["tok"].decode(p) for p, _, _ in _pairs(d, "train") + _pairs(d, "val")]
    assert got == [f"Question {i}?" for i in range(10)]
    with pytest.raises(DataError, match=r"no column 'chosen'.*data.chosen_field=<column>"):
        _build(smol, _write(tmp_path, rows, "e.jsonl"))


# ------------------------------------------------------------------------------- truncation
def test_truncation_keeps_the_prompt(smol, tmp_path):
    long = " ".join(f"word{i}" for i in range(60))
    rows = [{"prompt": "Short prompt.", "chosen": " " + long, "rejected": " No."},
            {"prompt": "Another prompt.", "chosen": " Yes.", "rejected": " No."},
            {"prompt": long, "chosen": " Yes.", "rejected": " No."},  # the prompt alone fills the row
            {"prompt": "Third.", "chosen": " Fine.", "rejected": " Bad."}]
    logs = []
    d = _build(smol, _write(tmp_path, rows), seq_len=31, log=logs.append)
    eos = smol["cfg"].eos_token_id
    pairs = _pairs(d)
    assert len(pairs) == 3
    p, c, r = pairs[0]
    assert p == _enc(smol, "Short prompt.")
    assert c == (_enc(smol, " " + long) + [eos])[: 32 - len(p)] and r == _enc(smol, " No.") + [eos]
    assert [smol["tok"].decode(q) for q, _, _ in pairs] == ["Short prompt.", "Another prompt.", "Third."]
    assert len(logs) == 1
    assert "3 of 4 preference pairs kept" in logs[0] and "1 completions truncated" in logs[0]
    assert "1 pair(s) dropped (the prompt alone fills the 32 tokens)" in logs[0]


def test_fewer_than_two_pairs(smol, tmp_path):
    with pytest.raises(DataError, match=r"only 1 usable preference pairs.*raise data.seq_len"):
        _build(smol, _write(tmp_path, STANDARD[:1]))


# ------------------------------------------------------------------------------- bad rows
BAD = [
    ({"prompt": "a", "chosen": "b"}, r"d.jsonl:2: field 'rejected' is missing"),
    ({"prompt": "a", "chosen": " ", "rejected": "c"}, r"d.jsonl:2: empty 'chosen' completion"),
    ({"prompt": "a", "chosen": "b", "rejected": "b"}, r"d.jsonl:2: chosen and rejected are identical"),
    ({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant", "content": "c"}]},
     r"d.jsonl:2: fields .* mix strings and message lists"),
    ({"prompt": [{"role": "robot", "content": "a"}], "chosen": [], "rejected": []},
     r"d.jsonl:2: prompt\[0\] has unknown role 'robot'"),
]


@pytest.mark.parametrize("row, msg", BAD, ids=["missing", "empty", "identical", "mixed", "role"])
def test_bad_rows_refused_and_skipped(smol, tmp_path, row, msg):
    src = _write(tmp_path, [STANDARD[0], row, STANDARD[1], STANDARD[2]])
    with pytest.raises(DataError, match=msg) as ei:
        _build(smol, src)
    assert "data.bad_rows=skip" in str(ei.value) and "\n" not in str(ei.value)
    logs = []
    d = _build(smol, src, bad_rows="skip", log=logs.append)
    assert d.n_train == 6
    assert logs[0].startswith("data: 1 bad row(s) skipped") and "d.jsonl:2" in logs[0]
    assert "3 of 4 preference pairs kept (1 bad row(s) skipped)" in logs[1]


def test_implicit_prompt_bad_rows(smol, tmp_path):
    ok = {"chosen": "Yes it is.", "rejected": "Yes it was."}
    for row, msg in [({"chosen": "Apples.", "rejected": "Pears."}, "share no prefix"),
                     ({"chosen": "Same.", "rejected": "Same."}, "identical"),
                     ({"chosen": "Yes", "rejected": "Yes it was."}, "empty 'chosen' completion")]:
        with pytest.raises(DataError, match=rf"d.jsonl:2: .*{msg}"):
            _build(smol, _write(tmp_path, [ok, row, ok]))


def test_template_that_breaks_the_prefix(smol, tmp_path):
    """A template rendering the prompt differently once an answer follows: as TRL 1.16's DPOTrainer, the answer
    starts where the prompt's tokens and the whole conversation's diverge, that end of the prompt is left out,
    and the summary says so (issue 40; this was an error before)."""
    from transformers import PreTrainedTokenizerFast

    du = pytest.importorskip("trl.data_utils")
    tpl = ("{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<final>{% endif %}"
           "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    r = ChatRenderer(smol["tok"], tpl, eos_id=smol["cfg"].eos_token_id, **smol["specials"])
    hf = PreTrainedTokenizerFast(tokenizer_object=smol["tok"], **smol["specials"])
    hf.chat_template = tpl
    logs = []
    d = build_preference_data(_write(tmp_path, CONV), r, 64, 0.0, log=logs.append)
    assert _pairs(d) == [_trl_ids(du, hf, row) for row in CONV]
    assert smol["tok"].decode(_pairs(d)[0][1], skip_special_tokens=False).startswith("<final><|im_start|>assistant")
    assert "2 kept pair(s) have a prompt whose last token(s) merge into the answer" in logs[-1]


# ------------------------------------------------------------------------------- cache, built-in set, prepare
def test_cache_round_trip_keeps_pairs(smol, tmp_path):
    src = _write(tmp_path, STANDARD)
    cache = tmp_path / "cache"
    d = _build(smol, src, cache_dir=cache, val_fraction=0.34)
    files = list(cache.glob("packed-*.safetensors"))
    assert len(files) == 1
    back = load_packed(files[0])
    assert back.pairs and back.fingerprint == d.fingerprint and back.train_positions is None
    for split in ("train", "val"):
        idx = torch.arange(getattr(d, f"n_{split}"))
        for a, b in zip(micro_batch_tensors(d, idx, split), micro_batch_tensors(back, idx, split)):
            assert torch.equal(a, b)
    logs = []
    again = _build(smol, src, cache_dir=cache, val_fraction=0.34, log=logs.append)
    assert again.path == str(files[0]) and again.pairs and logs == [f"data: 3 preference pairs from {src} (cached)"]
    # a file written without the field (SFT data, older caches) reads back as pairs=False
    save_packed(PackedData(train=d.train, val=d.val, seq_len=d.seq_len, n_tokens=1, fingerprint="x"),
                tmp_path / "old.safetensors")
    assert load_packed(tmp_path / "old.safetensors").pairs is False


def test_botchan_prefs_builds_and_prepare(smol, tmp_path, monkeypatch):
    from types import SimpleNamespace as N

    from npu_train.data.prepare import prepare_data

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    cfg = N(data=N(source="botchan-prefs", format="preference", seq_len=128, val_fraction=0.05),
            model=N(tokenizer=None))
    logs = []
    d = prepare_data(cfg, smol["path"], smol["cfg"], log=logs.append)
    assert d.pairs and (d.n_train + d.n_val) == 2 * 585 and d.n_val == 2 * 29
    assert "585 of 585 preference pairs kept" in logs[-1]
    asset = resources.files("npu_train.data").joinpath("assets", "botchan_prefs.jsonl")
    rows = [json.loads(x) for x in asset.read_text().splitlines()]
    eos = smol["cfg"].eos_token_id  # prepare_data pads with EOS
    _check_conv(smol, d, rows[:5], pad=eos)
    assert all(c != r for _, c, r in _pairs(d, pad=eos))
    cfg.data.format = "chat"
    with pytest.raises(DataError, match="shipped preference set: set data.format=preference"):
        prepare_data(cfg, smol["path"], smol["cfg"])


def test_botchan_prefs_asset_matches_its_rule(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "p.jsonl"
    subprocess.run([sys.executable, str(root / "scripts/make_botchan_prefs.py"), str(out)], check=True,
                   env={"PYTHONPATH": str(root / "src")}, capture_output=True)
    shipped = root / "src/npu_train/data/assets/botchan_prefs.jsonl"
    assert out.read_bytes() == shipped.read_bytes()
    rows = [json.loads(x) for x in shipped.read_text().splitlines()]
    assert 300 <= len(rows) <= 600
    for r in rows:
        c, j = r["chosen"][0]["content"], r["rejected"][0]["content"]
        assert c != j and sorted(c.split()) == sorted(j.split())  # the same words, another order


def test_parquet_and_save_to_disk_sources(smol, tmp_path):
    """The same pairs from parquet and save_to_disk (with and without a prompt column) give the same rows."""
    datasets = pytest.importorskip("datasets")
    want = _build(smol, _write(tmp_path, CONV))
    implicit = {"chosen": [r["prompt"] + r["chosen"] for r in CONV],
                "rejected": [r["prompt"] + r["rejected"] for r in CONV]}
    explicit = {k: [r[k] for r in CONV] for k in ("prompt", "chosen", "rejected")}
    for name, cols in (("imp", implicit), ("exp", explicit)):
        ds = datasets.Dataset.from_dict(cols)
        ds.to_parquet(str(tmp_path / f"{name}.parquet"))
        ds.save_to_disk(str(tmp_path / f"{name}_ds"))
        for src in (tmp_path / f"{name}.parquet", tmp_path / f"{name}_ds"):
            got = _build(smol, str(src))
            assert torch.equal(got.train, want.train) and torch.equal(got.train_labels, want.train_labels), src


def test_standard_rows_get_the_tokenizers_bos(smol, tmp_path):
    """A tokenizer whose post-processor adds a BOS: the prompt starts with it, the completions do not (the
    text is tokenized whole, as TRL does, so the completions carry the space that separates them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "a": 3, "b": 4, "c": 5, "d": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    r = ChatRenderer(tok, None, eos_id=1)
    rows = [{"prompt": "a b", "chosen": " c", "rejected": " d"}, {"prompt": "b", "chosen": " c c", "rejected": " d"}]
    d = build_preference_data(_write(tmp_path, rows), r, 8, 0.0, pad_id=2, log=lambda m: None)
    assert _pairs(d, pad=2) == [([0, 3, 4], [5, 1], [6, 1]), ([0, 4], [5, 5, 1], [6, 1])]
    conv = _write(tmp_path, CONV, "c.jsonl")
    with pytest.raises(DataError, match=r"c.jsonl:1: the model has no chat template"):
        build_preference_data(conv, r, 8, 0.0, log=lambda m: None)


def _trl_ids(du, hf, example: dict) -> tuple[list[int], list[int], list[int]]:
    """TRL's DPOTrainer dataset steps (trl 1.16 ``_prepare_dataset``): extract_prompt, add EOS to string
    completions, tokenize prompt and prompt + completion, split at their common token prefix."""
    if "prompt" not in example:
        example = du.extract_prompt(example)
    conv = du.is_conversational(example)
    if not conv:
        example = {**example, "chosen": example["chosen"] + hf.eos_token, "rejected": example["rejected"] + hf.eos_token}
    kw = {"add_generation_prompt": True} if conv else {}
    p = du._tokenize(hf, example["prompt"], **kw)["input_ids"]
    c = du._tokenize(hf, example["prompt"] + example["chosen"])["input_ids"]
    r = du._tokenize(hf, example["prompt"] + example["rejected"])["input_ids"]
    n = min(du.common_prefix_length(p, c), du.common_prefix_length(p, r))
    return list(p[:n]), list(c[n:]), list(r[n:])


def test_same_tokens_as_trl(smol, tmp_path):
    """On the same rows, the pairs' tokens equal those TRL's DPOTrainer builds (trl in the environment)."""
    du = pytest.importorskip("trl.data_utils")
    implicit = [{"chosen": "The cat sat on the mat.", "rejected": "The cat sat on the hat."},
                {"chosen": "Paris is in France.", "rejected": "Paris is in Spain!"}]
    implicit_conv = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in CONV]
    for k, rows in enumerate((STANDARD, CONV, implicit, implicit_conv)):
        d = _build(smol, _write(tmp_path, rows, f"{k}.jsonl"))
        assert _pairs(d) == [_trl_ids(du, smol["hf"], r) for r in rows], k
