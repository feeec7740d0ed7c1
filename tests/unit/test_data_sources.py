"""Data sources through Hugging Face datasets (parquet / arrow / CSV / JSON(L) / save_to_disk / globs),
column mapping, bad rows, the cheap source fingerprint, the memory-mapped packed file and its build lock.

Expected token streams are built from the tokenizer directly (``tok.encode`` of each document, EOS between
documents), not from the packing code under test."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from npu_train.data import DataError, botchan_text, build_packed_data, load_packed, micro_batch_tensors
from npu_train.data.rows import read_rows
from npu_train.data.cache import packed_cache_path
from npu_train.data.packfile import token_dtype
from npu_train.data.prepare import TextSpec
from npu_train.data.sources import read_documents, resolve_source, source_key
from lock_wait import build_while_locked

datasets = pytest.importorskip("datasets")
EOS = 0
DOCS = ["The first document has some words in it.", "A second one, shorter.", "Third: the last document here."]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    t.train_from_iterator([botchan_text()[:30_000]], trainer)
    return t


def _stream(tok, docs):
    out = []
    for k, d in enumerate(docs):
        out += ([EOS] if k else []) + tok.encode(d, add_special_tokens=False).ids
    return out


def _make(kind: str, d, docs=DOCS, column="text"):
    ds = datasets.Dataset.from_dict({column: docs, "id": list(range(len(docs)))})
    if kind == "parquet":
        p = d / "t.parquet"
        ds.to_parquet(str(p))
    elif kind == "csv":
        p = d / "t.csv"
        ds.to_csv(str(p), index=False)
    elif kind == "jsonl":
        p = d / "t.jsonl"
        p.write_text("".join(json.dumps({column: x, "id": i}) + "\n" for i, x in enumerate(docs)))
    elif kind == "arrow":  # the arrow (IPC stream) file save_to_disk writes, on its own
        ds.save_to_disk(str(d / "saved"))
        p = d / "t.arrow"
        os.rename(next((d / "saved").glob("*.arrow")), p)
    elif kind == "saved":
        p = d / "saved"
        ds.save_to_disk(str(p))
    else:
        raise AssertionError(kind)
    return str(p)


@pytest.mark.parametrize("kind", ["parquet", "csv", "jsonl", "arrow", "saved"])
def test_each_source_kind_packs_the_documents(tmp_path, tok, kind):
    src = _make(kind, tmp_path)
    assert read_documents(src) == DOCS
    data = build_packed_data(src, tok, seq_len=4, val_fraction=0.2, eos_id=EOS)
    want = _stream(tok, DOCS)
    assert data.n_tokens == len(want)
    flat = torch.cat([data.train, data.val]).long().reshape(-1).tolist()
    assert flat == want[: len(flat)] and len(flat) == len(want) // 5 * 5


def test_glob_and_directory_order(tmp_path, tok):
    for i, name in enumerate(["b.parquet", "a.parquet", "c.jsonl"]):
        datasets.Dataset.from_dict({"text": [f"doc {name} {j}" for j in range(2)]}).to_parquet(str(tmp_path / name)) \
            if name.endswith("parquet") else (tmp_path / name).write_text(json.dumps({"text": "doc c"}) + "\n")
    assert read_documents(str(tmp_path / "*.parquet")) == ["doc a.parquet 0", "doc a.parquet 1",
                                                           "doc b.parquet 0", "doc b.parquet 1"]
    assert read_documents(str(tmp_path))[-1] == "doc c"
    with pytest.raises(DataError, match="matches no"):
        read_documents(str(tmp_path / "*.tsv"))


def test_dataset_dict_splits(tmp_path, tok):
    train = [f"training text number {i} goes on a while." for i in range(6)]
    val = ["held out text number one is here.", "held out text number two is there."]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": train}),
                               "test": datasets.Dataset.from_dict({"body": val})})
    dd.save_to_disk(str(tmp_path / "dd"))
    src = resolve_source(str(tmp_path / "dd"), "text", "train", "test")
    data = build_packed_data(TextSpec(src, text_field="body"), tok, seq_len=4, val_fraction=0.05, eos_id=EOS)
    tr, va = _stream(tok, train), _stream(tok, val)
    assert data.train.long().reshape(-1).tolist() == tr[: len(tr) // 5 * 5]
    assert data.val.long().reshape(-1).tolist() == va[: len(va) // 5 * 5]
    with pytest.raises(DataError, match=r"no split 'validation' .*splits: \['test', 'train'\]"):
        build_packed_data(TextSpec(resolve_source(str(tmp_path / "dd"), "text", "validation")), tok, 4, eos_id=EOS)
    with pytest.raises(DataError, match="needs a DatasetDict"):
        resolve_source(_make("parquet", tmp_path), "text", "train", "test")


def test_column_mapping_and_missing_column(tmp_path, tok):
    src = _make("parquet", tmp_path, column="content")
    spec = TextSpec(resolve_source(src, "text"), text_field="content")
    data = build_packed_data(spec, tok, 4, 0.2, EOS)
    assert data.n_tokens == len(_stream(tok, DOCS))
    with pytest.raises(DataError, match=r"t.parquet: no column 'text' \(columns: \['content', 'id'\]\); "
                                        r"set data.text_field=<column>"):
        build_packed_data(src, tok, 4, 0.2, EOS)


def test_bad_rows_refused_or_skipped(tmp_path, tok):
    p = tmp_path / "b.jsonl"
    rows = [{"text": DOCS[0]}, {"text": 5}, {"text": DOCS[1]}, {"other": "x"}, {"text": DOCS[2]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r'b.jsonl:2: the "text" field must be a string \(int\); .*data.bad_rows=skip'):
        build_packed_data(str(p), tok, 4, 0.2, EOS)
    logs = []
    spec = TextSpec(resolve_source(str(p), "text"), bad_rows="skip")
    data = build_packed_data(spec, tok, 4, 0.2, EOS, log=logs.append)
    assert data.n_tokens == len(_stream(tok, DOCS))
    assert any('2 bad row(s) skipped (data.bad_rows=skip); first: ' in m and "b.jsonl:2" in m for m in logs), logs


def test_chat_rows_mapping_and_bad_rows(tmp_path):
    conv = [[{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}] for i in range(3)]
    conv[1] = [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]
    datasets.Dataset.from_dict({"conv": conv}).to_parquet(str(tmp_path / "c.parquet"))
    with pytest.raises(DataError, match=r"c.parquet:2: messages\[0\] has unknown role 'robot'.*data.bad_rows=skip"):
        read_rows(str(tmp_path / "c.parquet"), "chat", {"messages": "conv"})
    logs = []
    rows = read_rows(str(tmp_path / "c.parquet"), "chat", {"messages": "conv"}, bad_rows="skip", log=logs.append)
    assert [m[1]["content"] for m, _ in rows] == ["A0", "A2"] and [w.split("/")[-1] for _, w in rows] == \
        ["c.parquet:1", "c.parquet:3"]
    assert "1 bad row(s) skipped" in logs[0] and "c.parquet:2" in logs[0]
    with pytest.raises(DataError, match=r"no column 'messages' .*set data.messages_field=<column>"):
        read_rows(str(tmp_path / "c.parquet"), "chat")
    # prompt/completion from a save_to_disk DatasetDict split, with mapped columns; an empty completion
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"q": ["a", "b"], "a": ["x", " "]})})
    dd.save_to_disk(str(tmp_path / "pc"))
    with pytest.raises(DataError, match=r"pc\[train\]:2: empty 'completion'"):
        read_rows(str(tmp_path / "pc"), "prompt_completion", {"prompt": "q", "completion": "a"})
    rows = read_rows(str(tmp_path / "pc"), "prompt_completion", {"prompt": "q", "completion": "a"}, bad_rows="skip",
                     log=lambda m: None)
    assert rows[0][0] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}]


def test_builtin_sets_need_no_network(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert read_documents("botchan") == [botchan_text()]
    rows = read_rows("botchan-chat", "chat")
    assert len(rows) > 100 and rows[0][1].endswith("botchan_chat.jsonl:1")
    with pytest.raises(DataError, match="add data.format=chat"):
        resolve_source("botchan-chat", "text")


@pytest.mark.parametrize("fmt", ["text", "chat", "preference"])
def test_a_missing_source_names_every_built_in_set_with_its_format(tmp_path, fmt):
    """The README uses botchan-chat and botchan-prefs too: a path that names nothing lists all three built-in
    sets, each with the data.format it is for, whatever the format asked."""
    with pytest.raises(FileNotFoundError) as e:
        resolve_source(str(tmp_path / "no" / "such.jsonl"), fmt)
    msg = str(e.value)
    for name, form in (("botchan", "text"), ("botchan-chat", "chat"), ("botchan-prefs", "preference")):
        assert f"{name} (data.format={form})" in msg, msg


def test_source_key_changes_with_the_file(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"text": "alpha beta"}) + "\n")
    k0 = source_key(resolve_source(str(p)))
    st = os.stat(p)
    p.write_text(json.dumps({"text": "alpha bet!"}) + "\n")  # same size, other bytes
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    k1 = source_key(resolve_source(str(p)))
    os.utime(p, (st.st_atime + 5, st.st_mtime + 5))  # touched
    k2 = source_key(resolve_source(str(p)))
    assert len({k0, k1, k2}) == 3
    assert source_key(resolve_source(str(p))) == k2  # stable


def test_large_file_key_reads_samples_only(tmp_path, monkeypatch):
    """A 4 MiB file: the key reads 8 blocks of 64 KiB, not the file."""
    import builtins

    p = tmp_path / "big.txt"
    p.write_bytes(b"word " * ((4 << 20) // 5))
    read = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def seek(self, o):
            self.f.seek(o)

        def read(self, n=-1):
            b = self.f.read(n)
            read.append(len(b))
            return b

    monkeypatch.setattr(builtins, "open", lambda f, m="r", *a, **k: Counting(real_open(f, m, *a, **k))
                        if str(f) == str(p) else real_open(f, m, *a, **k))
    source_key(resolve_source(str(p)))
    assert sum(read) == 8 * 65536 < os.path.getsize(p)


def test_packed_file_is_memory_mapped(tmp_path, tok):
    """The card process's arrays live in a mapping of the cache file, not in anonymous memory."""
    data = build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=str(tmp_path))
    path = packed_cache_path(tmp_path, data.fingerprint)
    assert data.path == str(path) and data.train.dtype == torch.uint16
    again = load_packed(path)
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi))
    ptr = again.train.data_ptr()
    assert any(lo <= ptr < hi for lo, hi in spans), (hex(ptr), spans)
    x, y = micro_batch_tensors(again, torch.tensor([3, 1]))
    rows = torch.from_numpy(np.fromfile(path, dtype=np.uint16, offset=8 + 8192).astype(np.int64)).view(-1, 33)
    assert x.dtype == torch.int64 and torch.equal(x, rows[[3, 1], :-1]) and torch.equal(y, rows[[3, 1], 1:])


def test_token_dtype():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32 and token_dtype(None) == np.uint32


def test_progress_lines(tmp_path, tok):
    logs = []
    build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=str(tmp_path), log=logs.append, progress_s=0.0)
    assert any(m.startswith("data: tokenizing botchan: ") and "MB/s" in m for m in logs), logs
    assert logs[-1].startswith("data: tokenized botchan: ")


def test_progress_lines_count_tokens_as_the_other_lines_do(tmp_path, tok):
    """Token counts in whole tokens with thousands separators, as the eval and step lines print them
    (``12,345 held-out tokens``); a fresh-clone review read ``0.07M tokens`` in these lines. The final count is
    every token written: at least the packed rows' (the cut tail aside)."""
    import re

    logs = []
    data = build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=str(tmp_path), log=logs.append, progress_s=0.0)
    count = r"(\d{1,3}(?:,\d{3})*) tokens"
    for m in logs:
        if m.startswith(("data: tokenizing ", "data: tokenized ")):
            assert re.search(r"\d+\.\d+M tokens", m) is None and re.search(count, m), m
    n = int(re.search("into " + count, logs[-1]).group(1).replace(",", ""))
    rows = data.train.shape[0] + data.val.shape[0]
    assert n >= 1000 and rows * (data.train.shape[1] - 1) <= n < (rows + 2) * data.train.shape[1], (n, logs[-1])


def test_waits_for_another_builder(tmp_path, tok):
    """A lock held by another node / launch: wait, then use its file (the tokenizer is never called)."""
    want = build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=str(tmp_path / "other"))
    target = packed_cache_path(tmp_path / "c", want.fingerprint)
    target.parent.mkdir()
    class Boom:
        def to_str(self):
            return tok.to_str()

        def encode(self, *a, **k):
            raise AssertionError("tokenizer called while another process builds")

        encode_batch = encode

    got, _ = build_while_locked(
        lambda log: build_packed_data("botchan", Boom(), 32, 0.05, EOS, cache_dir=str(tmp_path / "c"), log=log),
        target, want.path)
    assert torch.equal(got.train, want.train)


def test_stale_lock_is_taken_over(tmp_path, tok):
    first = build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=None)
    target = packed_cache_path(tmp_path, first.fingerprint)
    lock = target.with_name(target.name + ".lock")
    lock.write_text("deadhost pid 9\n")
    os.utime(lock, (time.time() - 1000, time.time() - 1000))
    logs = []
    data = build_packed_data("botchan", tok, 32, 0.05, EOS, cache_dir=str(tmp_path), log=logs.append)
    assert "taking over the stale build lock" in logs[0] and not lock.exists()
    assert torch.equal(data.train, first.train)


def test_mixed_type_jsonl_keeps_string_values(tmp_path):
    """datasets gives a mixed-type JSON column its Json feature, which decodes the string "1919" to an int:
    such a file is read line by line instead, so the text stays text and the bad row is the int one."""
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["1919", "true", "words"]) + json.dumps({"text": 7}) + "\n")
    with pytest.raises(DataError, match=r'm.jsonl:4: the "text" field must be a string \(int\)'):
        read_documents(str(p))
    assert read_documents(str(p), bad_rows="skip") == ["1919", "true", "words"]


def test_inexact_tokenizer_gets_whole_documents(tmp_path):
    """A tokenizer that prepends a marker to its input is not chunk-safe: long documents (the built-in text,
    a long JSONL row) are then encoded whole, so the stream equals encoding each document in one call."""
    from tokenizers import normalizers

    text = botchan_text()
    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.normalizer = normalizers.Prepend("^")
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    full = t.encode(text, add_special_tokens=False).ids
    p = tmp_path / "long.jsonl"
    p.write_text(json.dumps({"text": text}) + "\n")
    for src in ("botchan", str(p)):
        data = build_packed_data(src, t, 64, 0.05, eos_id=None)
        flat = torch.cat([data.train, data.val]).long().reshape(-1).tolist()
        assert data.n_tokens == len(full) and flat == full[: len(flat)]


# ------------------------------------------------------------------------------------------ empty / all-bad sources
EMPTY_FILES = {"zero.jsonl": b"", "blank.jsonl": b"\n  \n\n", "zero.json": b"", "zero.parquet": b"",
               "zero.csv": b"", "blank.csv": b"\n\n"}


@pytest.mark.parametrize("name", sorted(EMPTY_FILES))
def test_empty_file_has_no_rows(tmp_path, tok, name):
    """An empty file (0 bytes or blank lines) as data.source: one DataError naming the file, saying it has no
    rows and how to fix it (not the reader's internal error, e.g. "datasets could not read it (StopIteration)")."""
    p = tmp_path / name
    p.write_bytes(EMPTY_FILES[name])
    with pytest.raises(DataError) as ei:
        read_rows(str(p), "chat")
    msg = str(ei.value)
    assert msg.startswith(f"data.source={str(p)!r}: no rows (the file(s) are empty") and "add rows like" in msg, msg
    assert "could not read" not in msg, msg
    with pytest.raises(DataError, match=rf"{name}: no text \(file\(s\) empty or whitespace only\); add training text"):
        build_packed_data(str(p), tok, 4, 0.2, EOS)


def test_all_rows_bad_and_skipped_says_no_usable_rows(tmp_path, tok):
    """data.bad_rows=skip on a file whose every row is bad: "no usable rows", the count and the first bad row
    (not "no rows" / "no text", which would send the user looking for an empty file)."""
    p = tmp_path / "bad.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [{"text": 1}, {"other": "x"}]))
    with pytest.raises(DataError,
                       match=r"no usable rows: 2 bad row\(s\) skipped .*first: .*bad.jsonl:1: .*fix the rows"):
        build_packed_data(TextSpec(resolve_source(str(p), "text"), bad_rows="skip"), tok, 4, 0.2, EOS)
    with pytest.raises(DataError, match=r"no usable rows: all 2 row\(s\) are bad and were skipped "
                                        r"\(data.bad_rows=skip\); first: .*bad.jsonl:1: .*; fix the rows"):
        read_rows(str(p), "chat", {"messages": "text"}, bad_rows="skip", log=lambda m: None)
    from npu_train.data.rows import iter_pairs

    q = tmp_path / "pairs.jsonl"
    q.write_text("".join(json.dumps({"prompt": "a", "chosen": "x", "rejected": "x"}) + "\n" for _ in range(3)))
    with pytest.raises(DataError, match=r"no usable rows: all 3 row\(s\) are bad .*first: .*pairs.jsonl:1: "):
        list(iter_pairs(str(q), bad_rows="skip", log=lambda m: None))


@pytest.mark.parametrize("override,want", [
    ("data.bad_rows=maybe", "data.bad_rows='maybe': use one of ['refuse', 'skip']"),
    ("data.truncation=cut", "data.truncation='cut': use one of ['drop', 'truncate']"),
    ("data.format=csv", "data.format='csv': use one of ['text', 'chat', 'prompt_completion', 'preference']"),
])
def test_data_choices_are_refused_by_config_validation(override, want):
    """A misspelt data choice is refused where the launcher validates the config, before it plans or prints
    anything (it came after the plan's schedule line, two lines instead of one error)."""
    from omegaconf import OmegaConf

    from npu_train.config import Config, ConfigError, validate

    validate(OmegaConf.structured(Config))
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([override]))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == want


def test_a_missing_source_is_quoted_once(tmp_path, monkeypatch):
    """A long absolute ``data.source`` that names nothing appears once in its refusal (it was quoted, then
    quoted again as the resolved path); a relative one says the directory it was looked for in."""
    long = str(tmp_path / ("a-long-directory-name-" * 5) / "corpus" / "train-data-file-with-a-long-name.jsonl")
    with pytest.raises(FileNotFoundError) as e:
        resolve_source(long)
    assert str(e.value).count("train-data-file-with-a-long-name") == 1, str(e.value)
    assert str(e.value).startswith(f"data.source={long!r}: no such file or directory; use one of the built-in")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as e:
        resolve_source("mine.jsonl")
    assert f"data.source='mine.jsonl': no such file or directory (relative to {tmp_path});" in str(e.value)


def test_a_model_given_as_data_source_names_model_path(tmp_path):
    """rev4 CONFUSING 2: a model directory as data.source had its config.json read as rows ("no column 'text'
    ... set data.text_field=architectures"): it is named a model with model.path as the fix; a .gguf too. A data
    directory that happens to hold a config.json but no weights is still data."""
    model = tmp_path / "moe4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(DataError, match=rf"data\.source={model} is a model directory \(config\.json, "
                                        rf"model\.safetensors\), not data: did you mean model\.path={model}\?"):
        resolve_source(str(model))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(DataError, match=r"is a model file \(\.gguf\), not data: did you mean model\.path="):
        resolve_source(str(gguf))
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"text": "a config as a row"}))
    assert resolve_source(str(data)).kind == "files"
