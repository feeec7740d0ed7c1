"""``data.val_split`` for chat / prompt_completion / preference: train rows come only from ``data.split`` and
validation rows only from ``data.val_split`` of a ``save_to_disk`` DatasetDict; ``val_fraction`` is not used;
the cache key covers the split. References: transformers' ``apply_chat_template`` and the tokenizer's own
``encode`` of the rows, not the code under test."""
from __future__ import annotations

import json

import pytest
import torch

from npu_train.data import DataError
from npu_train.data.prepare import build_preference_data, build_sft_data
from npu_train.model.llama import IGNORE_INDEX
from smol_chat import smol_chat

pytest.importorskip("transformers")
pytest.importorskip("jinja2")
datasets = pytest.importorskip("datasets")

PAD = 0  # <|endoftext|>: never produced by the template or the rows below


@pytest.fixture(scope="module")
def smol():
    return smol_chat()


def _conv(q: str, a: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


TRAIN_QA = [(f"Train question {i}?", f"Train answer number {i}.") for i in range(5)]
VAL_QA = [(f"Held-out question {j}?", f"Held-out answer {j}, different.") for j in range(3)]


def _save(tmp_path, name: str, train: dict, val: dict) -> str:
    """A DatasetDict {"train", "test"} written with save_to_disk; returns its directory."""
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(train),
                               "test": datasets.Dataset.from_dict(val)})
    out = tmp_path / name
    dd.save_to_disk(str(out))
    return str(out)


def _chat_ids(smol, msgs) -> list[int]:
    return list(smol["hf"].apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"])


def _lab(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unshifted int64 labels from the stored uint8 target mask (1: the token id; 0: IGNORE_INDEX)."""
    return torch.where(mask.bool(), ids.to(torch.int64), IGNORE_INDEX)


def _row_samples(ids: torch.Tensor, pos) -> list[list[int]]:
    """The samples (token id lists) of a split's rows: the non-padding tokens of each row, cut where the
    positions restart at 0 (packed rows); ``pos`` None: one sample per row."""
    out = []
    for r in range(ids.shape[0]):
        row = ids[r].tolist()
        n = len(row)
        while n and row[n - 1] == PAD:
            n -= 1
        starts = [0] if pos is None else [j for j in range(n) if int(pos[r, j]) == 0]
        out += [row[a:b] for a, b in zip(starts, starts[1:] + [n])]
    return out


@pytest.mark.parametrize("fmt", ["chat", "prompt_completion"])
@pytest.mark.parametrize("pack", [False, True])
def test_sft_rows_come_from_their_split(smol, tmp_path, fmt, pack):
    if fmt == "chat":
        cols = lambda qa: {"messages": [_conv(q, a) for q, a in qa]}  # noqa: E731
    else:
        cols = lambda qa: {"prompt": [q for q, _ in qa], "completion": [a for _, a in qa]}  # noqa: E731
    src = _save(tmp_path, "dd", cols(TRAIN_QA), cols(VAL_QA))
    logs = []
    d = build_sft_data(src, fmt, smol["renderer"], seq_len=63, val_fraction=0.4, pad_id=PAD, pack=pack,
                       split="train", val_split="test", log=logs.append)
    assert _row_samples(d.train, d.train_positions) == [_chat_ids(smol, _conv(q, a)) for q, a in TRAIN_QA]
    assert _row_samples(d.val, d.val_positions) == [_chat_ids(smol, _conv(q, a)) for q, a in VAL_QA]
    # the labels train the answers of each split's own rows
    train_text = smol["tok"].decode([x for x in _lab(d.train, d.train_labels).reshape(-1).tolist() if x != IGNORE_INDEX])
    val_text = smol["tok"].decode([x for x in _lab(d.val, d.val_labels).reshape(-1).tolist() if x != IGNORE_INDEX])
    assert all(a in train_text and a not in val_text for _, a in TRAIN_QA)
    assert all(a in val_text and a not in train_text for _, a in VAL_QA)
    assert "5 of 5 from split 'train' for training, 3 of 3 from split 'test' for validation" in logs[-1]
    assert "data.val_fraction not used" in logs[-1]


def test_sft_val_rows_truncated_and_skipped_like_train_rows(smol, tmp_path):
    long = ("word " * 200).strip()
    train = {"messages": [_conv(q, a) for q, a in TRAIN_QA] + [_conv("Long one?", long)]}
    val = {"messages": [_conv(q, a) for q, a in VAL_QA[:2]] + [_conv("Long too?", long)]
           + [[{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]]}
    src = _save(tmp_path, "dd", train, val)
    r = smol["renderer"]
    with pytest.raises(DataError, match=r"dd\[test\]:4: messages\[0\] has unknown role 'robot'"):
        build_sft_data(src, "chat", r, seq_len=63, pad_id=PAD, val_split="test", log=lambda m: None)
    logs = []
    d = build_sft_data(src, "chat", r, seq_len=63, pad_id=PAD, val_split="test", bad_rows="skip", log=logs.append)
    assert any("1 bad row(s) skipped" in m and "dd[test]:4" in m for m in logs), logs
    assert d.n_train == 5 and d.n_val == 2  # the long row of each split dropped (data.truncation=drop)
    assert "2 longer than seq_len+1=64 tokens were dropped" in logs[-1]
    # the bad row counts among the rows read, as the line before says it was skipped
    assert "7 of 10 chat samples kept (1 bad row(s) skipped) (5 of 6 from split 'train' for training, 2 of 4 from " \
        "split 'test' for validation" in logs[-1], logs[-1]
    d = build_sft_data(src, "chat", r, seq_len=63, pad_id=PAD, val_split="test", bad_rows="skip",
                       truncation="truncate", log=logs.append)
    assert d.n_train == 6 and d.n_val == 3
    assert _row_samples(d.val, None)[2] == _chat_ids(smol, _conv("Long too?", long))[:64]
    # a split with no usable row is refused, naming it
    src2 = _save(tmp_path, "dd2", {"messages": [_conv(q, a) for q, a in TRAIN_QA]}, {"messages": [_conv("q", long)]})
    with pytest.raises(DataError, match=r"no usable chat sample in split 'test'"):
        build_sft_data(src2, "chat", r, seq_len=63, pad_id=PAD, val_split="test", log=lambda m: None)


STD_TRAIN = [{"prompt": f"Train prompt {i}:", "chosen": f" good {i}.", "rejected": f" bad {i}."} for i in range(4)]
STD_VAL = [{"prompt": f"Held prompt {j}:", "chosen": f" fine {j}.", "rejected": f" poor {j}."} for j in range(2)]


def _pairs(ids: torch.Tensor, lab: torch.Tensor) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, chosen, rejected) ids of consecutive row pairs: the completion is where labels are set."""
    out = []
    for i in range(0, ids.shape[0], 2):
        got = []
        for r in (i, i + 1):
            row, lb = ids[r].tolist(), _lab(ids[r], lab[r]).tolist()
            on = [j for j, x in enumerate(lb) if x != IGNORE_INDEX]
            got.append((row[: on[0]], row[on[0]: on[-1] + 1]))
        assert got[0][0] == got[1][0]
        out.append((got[0][0], got[0][1], got[1][1]))
    return out


def test_preference_pairs_come_from_their_split(smol, tmp_path):
    cols = lambda rows: {k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}  # noqa: E731
    src = _save(tmp_path, "dd", cols(STD_TRAIN), cols(STD_VAL))
    enc = lambda s: smol["tok"].encode(s, add_special_tokens=False).ids  # noqa: E731
    eos = [smol["cfg"].eos_token_id]
    want = lambda rows: [(enc(r["prompt"]), enc(r["chosen"]) + eos, enc(r["rejected"]) + eos) for r in rows]  # noqa: E731
    logs = []
    d = build_preference_data(src, smol["renderer"], 31, val_fraction=0.5, pad_id=PAD, split="train",
                              val_split="test", log=logs.append)
    assert _pairs(d.train, d.train_labels) == want(STD_TRAIN)
    assert _pairs(d.val, d.val_labels) == want(STD_VAL)
    assert "4 of 4 from split 'train' for training, 2 of 2 from split 'test' for validation" in logs[-1]
    assert "data.val_fraction not used" in logs[-1] and "4 train / 2 validation pairs" in logs[-1]
    # bad rows of the validation split follow data.bad_rows like the train split's
    bad = cols(STD_VAL)
    bad["chosen"][1] = bad["rejected"][1] = ""
    src2 = _save(tmp_path, "dd2", cols(STD_TRAIN), bad)
    with pytest.raises(DataError, match=r"dd2\[test\]:2"):
        build_preference_data(src2, smol["renderer"], 31, pad_id=PAD, val_split="test", log=lambda m: None)
    logs = []
    d = build_preference_data(src2, smol["renderer"], 31, pad_id=PAD, val_split="test", bad_rows="skip",
                              log=logs.append)
    assert _pairs(d.val, d.val_labels) == want(STD_VAL[:1]) and "(1 bad row(s) skipped)" in logs[-1]


@pytest.mark.parametrize("fmt", ["chat", "preference"])
def test_cache_key_covers_the_val_split(smol, tmp_path, fmt):
    if fmt == "chat":
        train, val = ({"messages": [_conv(q, a) for q, a in qa]} for qa in (TRAIN_QA, VAL_QA))
    else:
        train, val = ({k: [r[k] for r in rows] for k in ("prompt", "chosen", "rejected")}
                      for rows in (STD_TRAIN, STD_VAL))
    src = _save(tmp_path, "dd", train, val)
    cache = tmp_path / "cache"

    def build(**kw):
        if fmt == "chat":
            return build_sft_data(src, "chat", smol["renderer"], 63, pad_id=PAD, cache_dir=cache, log=lambda m: None,
                                  **kw)
        return build_preference_data(src, smol["renderer"], 31, pad_id=PAD, cache_dir=cache, log=lambda m: None, **kw)

    plain = build(val_fraction=0.2)
    split = build(val_fraction=0.2, val_split="test")
    assert plain.fingerprint != split.fingerprint
    assert len(list(cache.glob("*.safetensors"))) == 2
    # val_fraction is not used with a val_split: same data, same key
    assert build(val_fraction=0.4, val_split="test").fingerprint == split.fingerprint
    assert torch.equal(build(val_fraction=0.4, val_split="test").val.long(), split.val.long())
    # the cached file gives back the split's rows
    assert split.n_val == (2 * len(STD_VAL) if fmt == "preference" else len(VAL_QA))


def test_prepare_data_and_sources_without_splits(smol, tmp_path, monkeypatch):
    from types import SimpleNamespace as N

    from npu_train.data.prepare import prepare_data

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    src = _save(tmp_path, "dd", {"conv": [_conv(q, a) for q, a in TRAIN_QA]},
                {"conv": [_conv(q, a) for q, a in VAL_QA]})
    cfg = N(data=N(source=src, format="chat", seq_len=63, val_fraction=0.05, split="train", val_split="test",
                   messages_field="conv", pack=False), model=N(tokenizer=None))
    d = prepare_data(cfg, smol["path"], smol["cfg"], log=lambda m: None)
    assert d.n_train == len(TRAIN_QA) and d.n_val == len(VAL_QA)
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps({"messages": _conv(q, a)}) + "\n" for q, a in TRAIN_QA))
    cfg.data.source, cfg.data.messages_field = str(p), None
    with pytest.raises(DataError, match="needs a DatasetDict directory"):
        prepare_data(cfg, smol["path"], smol["cfg"], log=lambda m: None)


def test_text_cache_key_ignores_val_fraction_with_a_val_split(smol, tmp_path):
    """Text with ``data.val_split``: the fraction is unused, so it must not change the cache key (a second
    launch with another ``data.val_fraction`` reuses the cache); without a split it still does."""
    from npu_train.data.prepare import TextSpec, build_packed_data
    from npu_train.data.sources import resolve_source

    words = " ".join(f"word{i}" for i in range(400))
    src = _save(tmp_path, "text", {"text": [words] * 4}, {"text": [words]})
    cache = tmp_path / "cache"

    def build(vf, split):
        spec = TextSpec(resolve_source(src, "text", "train", split))
        return build_packed_data(spec, smol["renderer"].tok, 31, val_fraction=vf, eos_id=PAD, cache_dir=cache)

    assert build(0.1, "test").fingerprint == build(0.3, "test").fingerprint
    assert build(0.1, None).fingerprint != build(0.3, None).fingerprint
    assert len(list(cache.glob("*.safetensors"))) == 3


def test_text_with_a_val_split_says_the_fraction_is_unused(smol, tmp_path, monkeypatch):
    """docs/data.md promises the log line says so, for every format: text too, built or cached."""
    from types import SimpleNamespace as N

    from npu_train.data.prepare import prepare_data

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    words = " ".join(f"word{i}" for i in range(400))
    src = _save(tmp_path, "text", {"text": [words] * 4}, {"text": [words]})
    cfg = N(data=N(source=src, format="text", seq_len=31, val_fraction=0.05, split="train", val_split="test",
                   doc_mask=False), model=N(tokenizer=None))
    for _ in range(2):  # built, then from the cache
        logs: list[str] = []
        d = prepare_data(cfg, smol["path"], smol["cfg"], log=logs.append)
        assert (f"data: {d.n_train} training sequences from split 'train', {d.n_val} validation sequences from "
                "split 'test'; data.val_fraction not used") in logs


def test_held_out_micro_batches_and_the_note_for_a_split_smaller_than_one():
    """``data.eval_batches`` whole micro-batches; fewer held-out rows than a micro-batch: one padded
    micro-batch of them (SFT) or none (DPO pairs), with one note naming the settings that give more."""
    from npu_train.runtime.spec import eval_micro_batches, eval_note

    assert eval_micro_batches(n_val=9, micro_batch=2, eval_batches=4, pairs=False) == [2, 2, 2, 2]
    assert eval_micro_batches(n_val=5, micro_batch=2, eval_batches=4, pairs=False) == [2, 2]
    assert eval_micro_batches(n_val=1, micro_batch=2, eval_batches=4, pairs=False) == [1]
    assert eval_micro_batches(n_val=2, micro_batch=4, eval_batches=4, pairs=True) == []
    assert eval_micro_batches(n_val=1, micro_batch=2, eval_batches=0, pairs=False) == []
    assert eval_micro_batches(n_val=0, micro_batch=2, eval_batches=4, pairs=False) == []
    assert eval_note(9, 2, 4, False) == "" and eval_note(1, 2, 0, False) == ""
    assert eval_note(1, 2, 4, False).startswith("note: evaluation runs on 1 held-out row(s), fewer than a "
                                                "micro-batch (2), padded")
    dpo = eval_note(2, 4, 4, True)
    assert dpo.startswith("note: no held-out evaluation: 1 held-out pair(s), fewer than a micro-batch (2 pairs)")
    assert "data.val_fraction" in dpo and "train.micro_batch" in dpo
