"""Unit tests for npu_train.data: text sources, packing/caching and the step sampler."""

from __future__ import annotations

import hashlib
import json
from importlib import resources

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from npu_train.data import (
    DataError,
    PackedData,
    StepSampler,
    botchan_text,
    build_packed_data,
    load_packed,
    micro_batch_tensors,
    read_documents,
    read_text_source,
    save_packed,
    strip_gutenberg,
)
from npu_train.data.cache import packed_cache_path
from npu_train.data.render import _encode_doc

BOTCHAN_SHA256 = "464bd5300c24fce16fcc4555d4231a57632caae4d0090ad6aa92854a3b227ba7"
EOS = 0  # "<eos>" is the first special token of the test tokenizer


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def botchan() -> str:
    return botchan_text()


@pytest.fixture(scope="module")
def tok(botchan) -> Tokenizer:
    """A tiny byte-level BPE (vocab 400) trained on Botchan in-test."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    t.train_from_iterator([botchan[:50_000]], trainer)
    assert t.token_to_id("<eos>") == EOS
    return t


def _write(path, text: str):
    path.write_text(text, encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- text


def test_asset_is_verbatim():
    raw = resources.files("npu_train.data").joinpath("assets", "botchan.txt").read_bytes()
    assert len(raw) == 278_779
    assert hashlib.sha256(raw).hexdigest() == BOTCHAN_SHA256
    assert resources.files("npu_train.data").joinpath("assets", "SOURCE.md").is_file()


def test_botchan_stripped(botchan):
    assert len(botchan) > 200_000
    assert not botchan.startswith("\ufeff")
    assert "\r" not in botchan
    # header (licence blurb, START marker) gone; first body line is the producer credit
    assert botchan.startswith("Produced by David Starner")
    assert "BOTCHAN (MASTER DARLING)" in botchan[:200]
    assert "*** START OF" not in botchan and "*** END OF" not in botchan
    assert "This eBook is for the use of anyone anywhere" not in botchan
    # footer (END marker, licence) gone, including the trailing "End of Project Gutenberg's" line
    assert "PROJECT GUTENBERG" not in botchan.upper()[-5000:]
    assert "FULL LICENSE" not in botchan
    assert botchan.rstrip().endswith("[R: Rad]")
    # actual novel content present
    assert "CHAPTER I\nBecause of an hereditary recklessness, I have been playing always a\n" in botchan


def test_strip_gutenberg_synthetic():
    text = (
        "\ufeffHeader blah\r\nmore header\r\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK FOO ***\r\n"
        "Chapter 1\r\nBody text.\r\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK FOO ***\r\nLicense stuff\r\n"
    )
    assert strip_gutenberg(text) == "Chapter 1\r\nBody text."
    assert strip_gutenberg("plain text, no markers\n") == "plain text, no markers\n"
    assert strip_gutenberg("\ufeffplain") == "plain"


def test_read_text_source_kinds(tmp_path, botchan):
    assert read_text_source("botchan") == botchan
    a = _write(tmp_path / "a.txt", "alpha text\n")
    assert read_text_source(str(a)) == "alpha text\n"
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n")
    assert read_documents(str(j)) == ["one", "two"]
    assert read_text_source(str(j)) == "one\n\ntwo"
    d = tmp_path / "dir"
    d.mkdir()
    _write(d / "z.txt", "zed")
    _write(d / "a.txt", "ay")
    (d / "m.jsonl").write_text(json.dumps({"text": "em"}) + "\n")
    _write(d / "ignored.md", "x,y")
    assert read_documents(str(d)) == ["ay", "em", "zed"]


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_text_source(str(tmp_path / "nope.txt"))


def test_non_utf8_file(tmp_path):
    p = tmp_path / "latin.txt"
    p.write_bytes("caf\u00e9 ok\n".encode("latin-1"))
    with pytest.raises(DataError) as ei:
        read_text_source(str(p))
    msg = str(ei.value)
    assert "latin.txt" in msg and "byte offset 3" in msg and "iconv -f latin1 -t utf-8" in msg
    assert isinstance(ei.value, ValueError)


def test_empty_file(tmp_path):
    p = _write(tmp_path / "empty.txt", "  \n\n")
    with pytest.raises(DataError, match="no text"):
        read_text_source(str(p))


@pytest.mark.parametrize(
    "line, what",
    [("{not json", "malformed JSON"), ('["a"]', '"text" field'), ('{"body": "x"}', '"text" field'),
     ('{"text": 5}', "must be a string")],
)
def test_malformed_jsonl(tmp_path, line, what):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError) as ei:
        read_text_source(str(p))
    assert "bad.jsonl:2" in str(ei.value) and what in str(ei.value)


def test_unsupported_suffix(tmp_path):
    p = _write(tmp_path / "data.xml", "<a/>")
    with pytest.raises(DataError, match="unsupported file type"):
        read_text_source(str(p))


# ----------------------------------------------------------------------------- packing


def test_chunked_encoding_matches_full(tok, botchan):
    assert _encode_doc(tok, botchan) == tok.encode(botchan, add_special_tokens=False).ids


def test_packing_shapes_and_shift(tok, botchan):
    S = 64
    data = build_packed_data("botchan", tok, seq_len=S, val_fraction=0.05, eos_id=EOS, cache_dir=None)
    ids = tok.encode(botchan, add_special_tokens=False).ids
    assert data.n_tokens == len(ids)
    n_seq = len(ids) // (S + 1)
    # stored compactly: a 400-entry vocabulary fits uint16; micro-batches are int64
    assert data.train.dtype == torch.uint16 and data.val.dtype == torch.uint16
    assert data.train.shape[1] == S + 1 and data.val.shape[1] == S + 1
    assert data.n_train + data.n_val == n_seq
    assert data.n_val == round(n_seq * 0.05) and data.n_val >= 1
    # rows are the token stream, in order; validation is the tail
    flat = torch.cat([data.train, data.val]).reshape(-1)
    assert flat.tolist() == ids[: n_seq * (S + 1)]
    x, y = micro_batch_tensors(data, torch.tensor([0, 5, 2]))
    assert x.shape == (3, S) and y.shape == (3, S) and x.dtype == torch.int64
    rows = data.train[[0, 5, 2]].long()
    assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
    xv, yv = micro_batch_tensors(data, torch.tensor([0]), split="val")
    assert torch.equal(xv[0], data.val[0, :-1].long()) and torch.equal(yv[0], data.val[0, 1:].long())


def test_validation_disjoint(tok):
    data = build_packed_data("botchan", tok, seq_len=128, val_fraction=0.1, eos_id=EOS, cache_dir=None)
    n_seq = data.n_train + data.n_val
    assert data.n_val == round(0.1 * n_seq)
    # disjoint token positions: train covers stream rows [0, n_train), val the rest
    train_rows = {tuple(r) for r in data.train.tolist()}
    assert not any(tuple(r) in train_rows for r in data.val.tolist())
    # tiny data: at least one val sequence if possible, at least one train sequence
    assert build_packed_data("botchan", tok, 128, 0.0001, EOS, None).n_val == 1
    assert build_packed_data("botchan", tok, 128, 0.0, EOS, None).n_val == 0


def test_multiple_documents_joined_with_eos(tmp_path, tok):
    d = tmp_path / "docs"
    d.mkdir()
    _write(d / "a.txt", "The first document. " * 20)
    _write(d / "b.txt", "The second document. " * 20)
    data = build_packed_data(str(d), tok, seq_len=8, val_fraction=0.1, eos_id=EOS, cache_dir=None)
    a = tok.encode("The first document. " * 20, add_special_tokens=False).ids
    b = tok.encode("The second document. " * 20, add_special_tokens=False).ids
    assert data.n_tokens == len(a) + 1 + len(b)
    flat = torch.cat([data.train, data.val]).reshape(-1).tolist()
    assert flat == (a + [EOS] + b)[: len(flat)]


def test_cache_round_trip(tmp_path, tok, monkeypatch):
    cache = tmp_path / "cache"
    first = build_packed_data("botchan", tok, 64, 0.05, EOS, str(cache))
    files = list(cache.glob("packed-*.safetensors"))
    assert files == [packed_cache_path(cache, first.fingerprint)]

    class Boom:
        """Same serialization as the real tokenizer, but refuses to tokenize."""

        def to_str(self):
            return tok.to_str()

        def encode(self, *a, **k):
            raise AssertionError("tokenizer called: cache miss")

        encode_batch = encode

    second = build_packed_data("botchan", Boom(), 64, 0.05, EOS, str(cache))
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert (second.seq_len, second.n_tokens, second.fingerprint) == (first.seq_len, first.n_tokens, first.fingerprint)
    # a different seq_len / val_fraction is a different key: cache miss -> tokenizer is called
    with pytest.raises(AssertionError, match="cache miss"):
        build_packed_data("botchan", Boom(), 32, 0.05, EOS, str(cache))
    with pytest.raises(AssertionError, match="cache miss"):
        build_packed_data("botchan", Boom(), 64, 0.1, EOS, str(cache))
    # explicit save/load
    p = save_packed(first, tmp_path / "x.safetensors")
    again = load_packed(p)
    assert isinstance(again, PackedData) and torch.equal(again.train, first.train)
    assert again.fingerprint == first.fingerprint


def test_corrupt_cache_is_rebuilt(tmp_path, tok):
    cache = tmp_path / "cache"
    first = build_packed_data("botchan", tok, 64, 0.05, EOS, str(cache))
    want = first.train.clone()  # first is mapped from the file overwritten in place below
    path = packed_cache_path(cache, first.fingerprint)
    del first
    path.write_bytes(b"garbage")
    again = build_packed_data("botchan", tok, 64, 0.05, EOS, str(cache))
    assert torch.equal(again.train, want)
    assert load_packed(path).fingerprint == again.fingerprint


def test_too_short(tmp_path, tok):
    p = _write(tmp_path / "short.txt", "a few words only")
    with pytest.raises(DataError, match=r"dataset too short: \d+ tokens, need at least 130 .*seq_len=64"):
        build_packed_data(str(p), tok, 64, 0.05, EOS, None)
    with pytest.raises(DataError, match="at least 2"):
        build_packed_data("botchan", tok, 1, 0.05, EOS, None)


def test_vocab_mismatch(tok):
    with pytest.raises(DataError, match=r"tokenizer produced id \d+ but the model's vocabulary has 100 entries"):
        build_packed_data("botchan", tok, 64, 0.05, EOS, None, vocab_size=100)
    ok = build_packed_data("botchan", tok, 64, 0.05, EOS, None, vocab_size=tok.get_vocab_size())
    assert int(ok.train.long().max()) < tok.get_vocab_size()


def test_vocab_mismatch_checked_on_cache_hit(tmp_path, tok):
    build_packed_data("botchan", tok, 64, 0.05, EOS, str(tmp_path))
    with pytest.raises(DataError, match="does not match the model"):
        build_packed_data("botchan", tok, 64, 0.05, EOS, str(tmp_path), vocab_size=100)


# ----------------------------------------------------------------------------- sampler


def _flat(mbs):
    return torch.cat(mbs).tolist()


def test_sampler_shapes_and_determinism():
    s1 = StepSampler(100, micro_batch=4, micro_batches=3, seed=7)
    s2 = StepSampler(100, micro_batch=4, micro_batches=3, seed=7)
    mbs = s1.micro_batches_for_step(0)
    assert len(mbs) == 3 and all(m.shape == (4,) and m.dtype == torch.int64 for m in mbs)
    for k in (0, 1, 8, 9, 50):
        assert _flat(s1.micro_batches_for_step(k)) == _flat(s2.micro_batches_for_step(k))
    assert _flat(s1.micro_batches_for_step(0)) != _flat(StepSampler(100, 4, 3, seed=8).micro_batches_for_step(0))
    # epoch 0 is the documented permutation
    perm = torch.randperm(100, generator=torch.Generator().manual_seed(7))
    assert _flat(s1.micro_batches_for_step(0)) == perm[:12].tolist()
    assert _flat(s1.micro_batches_for_step(1)) == perm[12:24].tolist()


def test_sampler_epoch_disjoint_and_wrap():
    s = StepSampler(100, micro_batch=4, micro_batches=3, seed=1)
    assert s.steps_per_epoch == 8  # 100 // 12; the 4-index remainder is dropped
    epoch0 = [i for k in range(8) for i in _flat(s.micro_batches_for_step(k))]
    assert len(epoch0) == len(set(epoch0)) == 96
    perm1 = torch.randperm(100, generator=torch.Generator().manual_seed(2))
    assert _flat(s.micro_batches_for_step(8)) == perm1[:12].tolist()  # step 8 starts epoch 1
    assert s.epoch_of_step(7) == 0 and s.epoch_of_step(8) == 1


def test_sampler_resume_equality():
    a = StepSampler(37, micro_batch=2, micro_batches=4, seed=3)
    full = [_flat(a.micro_batches_for_step(k)) for k in range(10)]
    b = StepSampler(37, micro_batch=2, micro_batches=4, seed=3)
    b.load_state_dict(a.state_dict())
    assert [_flat(b.micro_batches_for_step(k)) for k in range(5, 10)] == full[5:]


def test_sampler_dp_shares_disjoint():
    n, mb, M, dp = 64, 2, 3, 4
    shares = [StepSampler(n, mb, M, seed=5, dp_rank=r, dp_size=dp) for r in range(dp)]
    for k in range(shares[0].steps_per_epoch):
        idx = [_flat(s.micro_batches_for_step(k)) for s in shares]
        union = [i for x in idx for i in x]
        assert len(union) == len(set(union)) == mb * M * dp
    # a dp_size=1 sampler with the same global batch sees the union in the same order
    single = StepSampler(n, mb * dp, M, seed=5)  # same global batch, same permutation
    assert sorted(_flat(single.micro_batches_for_step(0))) == sorted(
        i for s in shares for i in _flat(s.micro_batches_for_step(0)))


def test_sampler_small_data_wraps():
    s = StepSampler(5, micro_batch=2, micro_batches=4, seed=0)  # global batch 8 > 5 rows
    assert s.steps_per_epoch == 1
    for k in range(4):
        mbs = s.micro_batches_for_step(k)
        assert len(mbs) == 4
        for m in mbs:
            assert len(set(m.tolist())) == 2 and all(0 <= i < 5 for i in m.tolist())
    with pytest.raises(DataError, match="fewer than one micro-batch"):
        StepSampler(3, micro_batch=4, micro_batches=1, seed=0)


def test_sampler_state_mismatch():
    s = StepSampler(100, 4, 3, seed=7)
    st = s.state_dict()
    assert st == {"seed": 7, "n_sequences": 100, "micro_batch": 4, "micro_batches": 3, "dp_size": 1}
    with pytest.raises(ValueError, match="n_sequences: checkpoint 100 != now 90.*start a fresh run"):
        StepSampler(90, 4, 3, seed=7).load_state_dict(st)
    with pytest.raises(ValueError, match="seed"):
        StepSampler(100, 4, 3, seed=8).load_state_dict(st)
    with pytest.raises(ValueError):
        s.micro_batches_for_step(-1)


def test_chunking_falls_back_when_inexact(botchan):
    """A tokenizer that prepends a marker to its input is not chunk-safe: the packer must
    notice and encode the document whole."""
    from tokenizers import normalizers

    from npu_train.data.render import _split_chunks

    chunks = _split_chunks(botchan)
    assert len(chunks) > 2 and "".join(chunks) == botchan
    t = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    t.normalizer = normalizers.Prepend("^")
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.train_from_iterator([botchan], trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    full = t.encode(botchan, add_special_tokens=False).ids
    assert _encode_doc(t, botchan) == full
