"""Streamed chat / prompt_completion / preference builds (issue 25): the packed file equals the in-memory layout
written here from the module docs, with tiny spool buffers and pass-2 blocks so every sample crosses block
edges; errors keep the order of a build that read every row before rendering.

Reference (not the code under test): rows read with ``json.loads``; SFT samples from
``ChatRenderer.sample`` (the renderer is not what these builds change); preference tokens from the
tokenizer's ``encode`` / transformers' ``apply_chat_template``. Layout rules from the docs: drop / truncate at
``seq_len + 1``, samples without a trained token after the first dropped, last ``n_val_rows`` kept samples
are validation, greedy sequential fill (a sample that does not fit starts the next row), first label of
each sample IGNORE, positions restart at each sample and the padding continues the last one; pairs in rows
2i / 2i+1, completions cut to the room the prompt leaves, pairs without room dropped. Compaction as
``save_packed``: ids uint16 when the array's largest value (padding included) is < 65536 else uint32,
labels a uint8 mask, positions likewise."""
from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
import torch

from npu_train.data import DataError
from npu_train.data import pack as pack_mod
from npu_train.data import spool as spool_mod
from npu_train.data.packfile import load_packed
from npu_train.data.prepare import build_preference_data, build_sft_data
from npu_train.data.render import ChatRenderer
from npu_train.model.llama import IGNORE_INDEX
from lock_wait import build_while_locked
from smol_chat import smol_chat

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

PAD = 0


@pytest.fixture(scope="module")
def smol():
    return smol_chat()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Spool buffers of ~40 tokens and pass-2 blocks of a few rows: many flushes and block edges."""
    monkeypatch.setattr(spool_mod, "BUFFER_TOKENS", 40)
    monkeypatch.setattr(pack_mod, "BLOCK_TOKENS", 150)


def _conv(i: int) -> list[dict]:
    """Conversation ``i``: 1-3 turns of varied length; every 9th has a long answer, every 13th a long prompt."""
    msgs = []
    if i % 4 == 0:
        msgs.append({"role": "system", "content": "Be brief."})
    for t in range(1 + i % 3):
        q = "Why " * (1 + (i * 7 + t) % 6) + f"question {i}.{t}?"
        if i % 13 == 5 and t == 0:
            q = " ".join(["word"] * 90)
        a = f"Answer {i}.{t}" + " and more" * ((i * 5 + t) % 7)
        if i % 9 == 3:
            a += " " + " ".join(f"w{k}" for k in range(80))
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return str(p)


def _n_val(kept: int, vf: float) -> int:
    return 0 if vf <= 0 else min(max(1, int(round(kept * vf))), kept - 1)


def _compact(a: np.ndarray) -> np.ndarray:
    """An int64 array of ids / positions in the smallest unsigned dtype (empty: uint16)."""
    hi = int(a.max()) if a.size else 0
    return a.astype(np.uint16 if hi < 1 << 16 else np.uint32)


def _header(path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def _check_file(got, path, want: dict, n_tokens: int):
    """The mapped ``got`` (built into ``path``) holds exactly the arrays ``want`` (numpy, compacted)."""
    for name, a in want.items():
        t = getattr(got, name)
        assert t is not None, name
        b = t.numpy()
        assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(b, a), name
    for name in ("train_positions", "val_positions"):
        if name not in want:
            assert getattr(got, name) is None
    meta = _header(path)["__metadata__"]
    tops = [int(want[k].max()) for k in ("train", "val") if want[k].size]
    assert int(meta["n_tokens"]) == n_tokens == got.n_tokens
    assert int(meta["max_id"]) == (max(tops) if tops else -1)


# ------------------------------------------------------------------------------- SFT reference
def _ref_lay(samples: list, row: int, pack: bool, pad: int) -> dict:
    """``{"ids", "labels" (uint8 mask), "positions"}``, ids and positions int64 before compaction, from the
    doc's rules."""
    groups, used = [], row
    for s in samples:
        if not pack or used + len(s[0]) > row:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += len(s[0])
    ids = np.full((len(groups), row), pad, dtype=np.int64)
    mask = np.zeros((len(groups), row), dtype=np.uint8)
    pos = np.zeros((len(groups), row), dtype=np.int64)
    for r, g in enumerate(groups):
        c = 0
        for s_ids, s_lab in g:
            n = len(s_ids)
            ids[r, c:c + n] = s_ids
            mask[r, c + 1:c + n] = [int(x != IGNORE_INDEX) for x in s_lab[1:]]
            pos[r, c:c + n] = np.arange(n)
            c += n
        pos[r, c:] = np.arange(n, n + row - c)
    return {"ids": ids, "labels": mask, "positions": pos}


def _ref_samples(renderer, msgs_list, fmt, row, truncation):
    kept = []
    for k, msgs in enumerate(msgs_list):
        s = renderer.sample(msgs, f"r{k}", fmt)
        ids, lab = list(s.ids), list(s.labels)
        if len(ids) > row:
            if truncation == "drop":
                continue
            ids, lab = ids[:row], lab[:row]
        if all(x == IGNORE_INDEX for x in lab[1:]):
            continue
        kept.append((ids, lab))
    return kept


def _messages(row: dict, fmt: str) -> list[dict]:
    if fmt == "chat":
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]


def _expect_sft(renderer, splits, fmt, seq_len, vf, truncation, pack, pad) -> tuple[dict, int]:
    """The compacted arrays a build must write."""
    row = seq_len + 1
    per = [_ref_samples(renderer, m, fmt, row, truncation) for m in splits]
    if len(per) == 2:
        train, val = per
    else:
        n_val = _n_val(len(per[0]), vf)
        train, val = per[0][:len(per[0]) - n_val], per[0][len(per[0]) - n_val:]
    want = {}
    for name, samples in (("train", train), ("val", val)):
        lay = _ref_lay(samples, row, pack, pad)
        want[name] = _compact(lay["ids"])
        want[f"{name}_labels"] = lay["labels"]
        if pack:
            want[f"{name}_positions"] = _compact(lay["positions"])
    return want, sum(len(s[0]) for s in train + val)


SFT_CASES = [  # (fmt, pack, truncation, val)
    ("chat", True, "drop", 0.2),
    ("chat", False, "drop", 0.2),
    ("chat", True, "truncate", 0.2),
    ("chat", False, "truncate", 0.0),
    ("prompt_completion", True, "drop", 0.1),
    ("prompt_completion", False, "truncate", 0.3),
]


def _sft_rows(fmt: str, n: int = 40) -> list[dict]:
    if fmt == "chat":
        return [{"messages": _conv(i)} for i in range(n)]
    return [{"prompt": m[-2]["content"], "completion": m[-1]["content"]} for m in (_conv(i) for i in range(n))]


@pytest.mark.parametrize("fmt, pack, truncation, vf", SFT_CASES)
def test_sft_file_equals_reference(smol, tmp_path, fmt, pack, truncation, vf):
    rows = _sft_rows(fmt)
    src = _write(tmp_path, rows)
    cache = tmp_path / "cache"
    logs = []
    d = build_sft_data(src, fmt, smol["renderer"], seq_len=63, val_fraction=vf, truncation=truncation, pad_id=PAD,
                       pack=pack, cache_dir=cache, log=logs.append)
    want, n_tokens = _expect_sft(smol["renderer"], [[_messages(r, fmt) for r in rows]], fmt, 63, vf, truncation,
                                 pack, PAD)
    assert want["train"].shape[0] > 4 and (vf == 0 or want["val"].shape[0] >= 1)
    _check_file(d, d.path, want, n_tokens)
    assert len(logs) == 1 and f"of {len(rows)} {fmt} samples kept" in logs[0]
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # temporaries removed
    # cached: the same file, one line, repeating what the build dropped or cut (the summary less its layout)
    built = re.split(r", packed into | \(one per sequence of", logs[0][len("data: "):])[0]
    logs = []
    again = build_sft_data(src, fmt, smol["renderer"], seq_len=63, val_fraction=vf, truncation=truncation,
                           pad_id=PAD, pack=pack, cache_dir=cache, log=logs.append)
    n = d.n_train + d.n_val
    assert again.path == d.path and logs == [f"data: {n} {'packed rows of ' if pack else ''}{fmt} samples from {src} "
                                             "(cached)" + (f"; when built: {built}" if "; " in built else "")], logs


def test_sft_wide_ids_and_positions(smol, tmp_path):
    """pad_id >= 65536 makes the padded arrays uint32; seq_len 70000 makes packed positions uint32."""
    rows = _sft_rows("chat", 12)
    src = _write(tmp_path, rows)
    msgs = [[_messages(r, "chat") for r in rows]]
    d = build_sft_data(src, "chat", smol["renderer"], seq_len=63, val_fraction=0.25, pad_id=70000, pack=True,
                       log=lambda m: None)
    want, n = _expect_sft(smol["renderer"], msgs, "chat", 63, 0.25, "drop", True, 70000)
    assert want["train"].dtype == np.uint32 and d.path is None and d.n_tokens == n
    _check_arrays(d, want)
    d = build_sft_data(src, "chat", smol["renderer"], seq_len=70000, val_fraction=0.25, pad_id=PAD, pack=True,
                       cache_dir=tmp_path / "c", log=lambda m: None)
    want, n = _expect_sft(smol["renderer"], msgs, "chat", 70000, 0.25, "drop", True, PAD)
    assert want["train_positions"].dtype == np.uint32 and want["train"].dtype == np.uint16
    _check_file(d, d.path, want, n)


def _check_arrays(d, want: dict) -> None:
    for name, a in want.items():
        b = getattr(d, name).numpy()
        assert b.dtype == a.dtype and np.array_equal(b, a), name


@pytest.mark.parametrize("pack", [False, True])
def test_sft_val_split_equals_reference(smol, tmp_path, pack):
    datasets = pytest.importorskip("datasets")
    train = [_conv(i) for i in range(30)]
    val = [_conv(100 + j) for j in range(9)]
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": train}),
                               "test": datasets.Dataset.from_dict({"messages": val})})
    dd.save_to_disk(str(tmp_path / "dd"))
    d = build_sft_data(str(tmp_path / "dd"), "chat", smol["renderer"], seq_len=63, val_fraction=0.5, pad_id=PAD,
                       pack=pack, val_split="test", cache_dir=tmp_path / "cache", log=lambda m: None)
    want, n = _expect_sft(smol["renderer"], [train, val], "chat", 63, None, "drop", pack, PAD)
    _check_file(d, d.path, want, n)


# ------------------------------------------------------------------------------- preference reference
def _enc(smol, text: str) -> list[int]:
    return smol["tok"].encode(text, add_special_tokens=False).ids


def _chat_ids(smol, msgs, gen=False) -> list[int]:
    return list(smol["hf"].apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen,
                                               return_dict=True)["input_ids"])


def _pref_rows(kind: str, n: int = 24) -> tuple[list[dict], list]:
    """``(rows, token triples)``: rows of one TRL format and a function of smol giving (prompt, chosen,
    rejected) ids per row (untruncated). Some prompts are long (dropped at seq_len 47), some answers too
    (cut)."""
    rows, spec = [], []
    for i in range(n):
        q = f"Question {i}" + " again" * (i % 5) + ("" if i % 7 != 3 else " " + " ".join(["long"] * 60))
        good = f" apples {i}" + " very good" * (i % 4) + (" " + " ".join(["yes"] * 40) if i % 5 == 1 else "")
        bad = f" pears {i}" + " bad" * (i % 3)
        if kind == "standard":
            rows.append({"prompt": q, "chosen": good, "rejected": bad})
        elif kind == "implicit":
            rows.append({"chosen": q + good, "rejected": q + bad})
        else:
            p = [{"role": "user", "content": q}]
            c, r = [{"role": "assistant", "content": good.strip()}], [{"role": "assistant", "content": bad.strip()}]
            rows.append({"prompt": p, "chosen": c, "rejected": r} if kind == "conversational"
                        else {"chosen": p + c, "rejected": p + r})
        spec.append((q, good, bad))
    return rows, spec


def _pref_tokens(smol, kind: str, spec) -> list:
    eos = smol["cfg"].eos_token_id
    out = []
    for q, good, bad in spec:
        if kind in ("standard", "implicit"):
            out.append((_enc(smol, q), _enc(smol, good) + [eos], _enc(smol, bad) + [eos]))
            continue
        p = [{"role": "user", "content": q}]
        head = _chat_ids(smol, p, gen=True)
        fc = _chat_ids(smol, p + [{"role": "assistant", "content": good.strip()}])
        fr = _chat_ids(smol, p + [{"role": "assistant", "content": bad.strip()}])
        out.append((head, fc[len(head):], fr[len(head):]))
    return out


def _expect_pairs(triples: list, seq_len: int, vf, n_train_split=None) -> tuple[dict, int]:
    row = seq_len + 1
    kept, kept_split = [], []
    for k, (p, c, r) in enumerate(triples):
        room = row - len(p)
        if room < 1:
            continue
        kept.append((p, c[:room], r[:room]))
        kept_split.append(n_train_split is None or k < n_train_split)
    if n_train_split is None:
        n_val = _n_val(len(kept), vf)
        parts = {"train": kept[:len(kept) - n_val], "val": kept[len(kept) - n_val:]}
    else:
        parts = {"train": [q for q, t in zip(kept, kept_split) if t],
                 "val": [q for q, t in zip(kept, kept_split) if not t]}
    want = {}
    for name, pairs in parts.items():
        ids = np.full((2 * len(pairs), row), PAD, dtype=np.int64)
        mask = np.zeros((2 * len(pairs), row), dtype=np.uint8)
        for i, (p, c, r) in enumerate(pairs):
            for k, comp in ((2 * i, c), (2 * i + 1, r)):
                ids[k, :len(p)] = p
                ids[k, len(p):len(p) + len(comp)] = comp
                mask[k, len(p):len(p) + len(comp)] = 1
        want[name], want[f"{name}_labels"] = _compact(ids), mask
    return want, sum(2 * len(p) + len(c) + len(r) for p, c, r in kept)


@pytest.mark.parametrize("kind", ["standard", "conversational", "implicit", "implicit_conversational"])
def test_preference_file_equals_reference(smol, tmp_path, kind):
    rows, spec = _pref_rows(kind)
    src = _write(tmp_path, rows)
    logs = []
    d = build_preference_data(src, smol["renderer"], 47, val_fraction=0.2, pad_id=PAD, cache_dir=tmp_path / "cache",
                              log=logs.append)
    triples = _pref_tokens(smol, kind, spec)
    want, n = _expect_pairs(triples, 47, 0.2)
    assert want["train"].shape[0] >= 10 and any(len(p) >= 48 for p, _, _ in triples)  # some dropped
    assert d.pairs
    _check_file(d, d.path, want, n)
    assert len(logs) == 1 and f"of {len(rows)} preference pairs kept" in logs[0]


def test_preference_val_split_equals_reference(smol, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows, spec = _pref_rows("standard", 30)
    cols = lambda rs: {k: [r[k] for r in rs] for k in ("prompt", "chosen", "rejected")}  # noqa: E731
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(cols(rows[:22])),
                          "test": datasets.Dataset.from_dict(cols(rows[22:]))}).save_to_disk(str(tmp_path / "dd"))
    d = build_preference_data(str(tmp_path / "dd"), smol["renderer"], 47, pad_id=PAD, val_split="test",
                              cache_dir=tmp_path / "cache", log=lambda m: None)
    want, n = _expect_pairs(_pref_tokens(smol, "standard", spec), 47, None, n_train_split=22)
    _check_file(d, d.path, want, n)


# ------------------------------------------------------------------------------- error order
def test_sft_read_errors_come_before_render_errors(smol, tmp_path):
    """A bad row found by reading is named even when an earlier row fails to render (or has an id outside the
    vocabulary), as when every row was read before rendering; with data.bad_rows=skip the render error is."""
    ok = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    robot = {"messages": [{"role": "robot", "content": "x"}]}
    src = _write(tmp_path, [ok, ok, ok, robot, ok])
    no_template = ChatRenderer(smol["tok"], None, eos_id=smol["cfg"].eos_token_id)
    with pytest.raises(DataError, match=r"d.jsonl:4: messages\[0\] has unknown role 'robot'"):
        build_sft_data(src, "chat", no_template, seq_len=63, cache_dir=tmp_path / "c", log=lambda m: None)
    with pytest.raises(DataError, match=r"d.jsonl:4: messages\[0\] has unknown role 'robot'"):
        build_sft_data(src, "chat", smol["renderer"], seq_len=63, vocab_size=100, log=lambda m: None)
    src = _write(tmp_path, [ok, ok, robot, ok], "e.jsonl")
    with pytest.raises(DataError, match=r"e.jsonl:1: the model has no chat template"):
        build_sft_data(src, "chat", no_template, seq_len=63, bad_rows="skip", log=lambda m: None)
    with pytest.raises(DataError, match=r"e.jsonl:1: tokenizer produced id \d+ but the model's vocabulary has 100"):
        build_sft_data(src, "chat", smol["renderer"], seq_len=63, vocab_size=100, bad_rows="skip", log=lambda m: None)
    assert not list((tmp_path / "c").iterdir())  # no file or temporary left behind


def test_preference_error_order(smol, tmp_path):
    """Read errors, then tokenizing errors, then ids outside the vocabulary (each the first of its kind)."""
    std = {"prompt": "Question", "chosen": " yes", "rejected": " no"}
    conv = {"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "assistant", "content": "A"}],
            "rejected": [{"role": "assistant", "content": "B"}]}
    r = ChatRenderer(smol["tok"], None, eos_id=smol["cfg"].eos_token_id)
    src = _write(tmp_path, [std, conv, std, {"prompt": "a", "chosen": "b"}, std])
    with pytest.raises(DataError, match=r"d.jsonl:4: field 'rejected' is missing"):
        build_preference_data(src, r, 31, vocab_size=100, log=lambda m: None)
    with pytest.raises(DataError, match=r"d.jsonl:2: the model has no chat template"):
        build_preference_data(src, r, 31, vocab_size=100, bad_rows="skip", log=lambda m: None)
    src = _write(tmp_path, [std, std, std], "e.jsonl")
    with pytest.raises(DataError, match=r"e.jsonl:1: tokenizer produced id"):
        build_preference_data(src, r, 31, vocab_size=100, log=lambda m: None)


# ------------------------------------------------------------------------------- disk space
def test_short_disk_refused_before_the_rows_are_written(smol, tmp_path, monkeypatch):
    """Pass 2 checks the free space against the packed arrays' bytes (+ margin), as save_packed did: a
    one-line DataError with the sizes; no file or temporary left."""
    import shutil
    from collections import namedtuple

    src = _write(tmp_path, _sft_rows("chat", 12))
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda d: Usage(10**9, 10**9, 1000))
    with pytest.raises(DataError, match=r"packed training data needs 1\.\d MB in .* but only 0\.0 MB are free: "
                                        r"free disk space there or point \$NPT_CACHE at a larger disk$"):
        build_sft_data(src, "chat", smol["renderer"], seq_len=63, cache_dir=tmp_path / "c", log=lambda m: None)
    assert not list((tmp_path / "c").iterdir())


def test_disk_full_while_spooling(smol, tmp_path, monkeypatch):
    """ENOSPC while pass 1 writes its temporaries: a DataError naming the fix; nothing left behind."""
    import errno

    def full(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool_mod.SampleSpool, "flush", full)
    src = _write(tmp_path, [{"prompt": f"Q{i}", "chosen": " yes", "rejected": " no"} for i in range(5)])
    with pytest.raises(DataError, match=r"disk ran out of space in .* while writing the packed training data: "
                                        r"free disk space there or point \$NPT_CACHE at a larger disk"):
        build_preference_data(src, smol["renderer"], 31, cache_dir=tmp_path / "c", log=lambda m: None)
    assert not list((tmp_path / "c").iterdir())


# ------------------------------------------------------------------------------- several nodes, one cache
def test_waits_for_another_builder(smol, tmp_path):
    """A build lock held by another node / launch on the same cache: wait (nothing rendered), then map its file."""
    from types import SimpleNamespace

    from npu_train.data.cache import packed_cache_path

    src = _write(tmp_path, _sft_rows("chat", 10))
    want = build_sft_data(src, "chat", smol["renderer"], 63, pack=True, cache_dir=tmp_path / "other", log=lambda m: None)
    target = packed_cache_path(tmp_path / "c", want.fingerprint)
    target.parent.mkdir()

    def boom(*a, **k):
        raise AssertionError("rendered while another process builds")

    r = SimpleNamespace(template=smol["renderer"].template, tok=smol["renderer"].tok, sample=boom)
    got, logs = build_while_locked(
        lambda log: build_sft_data(src, "chat", r, 63, pack=True, cache_dir=tmp_path / "c", log=log), target, want.path)
    assert torch.equal(got.train.long(), want.train.long()) and " (cached)" in logs[-1]


def test_progress_lines_touch_the_lock(smol, tmp_path):
    logs = []
    src = _write(tmp_path, _sft_rows("chat", 6))
    build_preference_data(_write(tmp_path, _pref_rows("standard", 6)[0], "p.jsonl"), smol["renderer"], 47,
                          cache_dir=tmp_path / "c", log=logs.append, progress_s=0.0)
    assert any(m.startswith("data: rendering ") and "rows read" in m for m in logs), logs
    # whole tokens, as the other lines count them (not "0.00M tokens")
    assert all(re.search(r", \d[\d,]* kept, \d[\d,]* tokens, ", m) for m in logs if m.startswith("data: rendering ")), logs
    logs = []
    build_sft_data(src, "chat", smol["renderer"], 63, truncation="truncate", cache_dir=tmp_path / "c", log=logs.append,
                   progress_s=0.0)
    assert any(m.startswith("data: rendering ") for m in logs) and "samples kept" in logs[-1]


# ------------------------------------------------------------------------------- a relaunch repeats the losses
def _drop_losses(path) -> None:
    """Rewrite the packed file's header without the ``losses`` metadata, as a file written before it was
    recorded (the JSON header is padded with spaces to its old length; the arrays stay where they are)."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        assert header["__metadata__"].pop("losses", None) is not None
        blob = json.dumps(header).encode()
        f.seek(8)
        f.write(blob + b" " * (n - len(blob)))


def test_cached_line_repeats_what_the_build_dropped(smol, tmp_path):
    """A cache hit repeats the first build's counts of bad rows skipped and samples / completions cut or
    dropped (stored in the packed file's metadata); a file without them (an older cache, same key) is still
    used and its line says nothing more."""
    long = " ".join(["word"] * 120)
    rows = [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}."}]}
            for i in range(6)]
    rows[2]["messages"][1]["content"] = long
    src = _write(tmp_path, rows + ['{"messages": 7}'])
    cache = tmp_path / "c"
    first = []
    d = build_sft_data(src, "chat", smol["renderer"], 63, cache_dir=cache, bad_rows="skip", log=first.append)
    assert "5 of 7 chat samples kept (1 bad row(s) skipped)" in first[-1], first
    logs = []
    build_sft_data(src, "chat", smol["renderer"], 63, cache_dir=cache, bad_rows="skip", log=logs.append)
    assert logs == [f"data: 5 chat samples from {src} (cached); when built: 5 of 7 chat samples kept (1 bad row(s) "
                    "skipped); 1 longer than seq_len+1=64 tokens were dropped (data.truncation=drop); first bad row: "
                    f"{src}:7: " + first[0].split(f"{src}:7: ", 1)[1]], logs
    _drop_losses(d.path)
    logs = []
    again = build_sft_data(src, "chat", smol["renderer"], 63, cache_dir=cache, bad_rows="skip", log=logs.append)
    assert again.path == d.path and logs == [f"data: 5 chat samples from {src} (cached)"]

    prows = [{"prompt": f"Q{i}", "chosen": " yes" + (" " + long if i == 1 else ""), "rejected": " no"}
             for i in range(4)] + [{"prompt": "Q", "chosen": " same", "rejected": " same"}]
    psrc = _write(tmp_path, prows, "p.jsonl")
    first = []
    d = build_preference_data(psrc, smol["renderer"], 47, cache_dir=cache, bad_rows="skip", log=first.append)
    assert "4 of 5 preference pairs kept (1 bad row(s) skipped); 1 completions truncated" in first[-1], first
    logs = []
    build_preference_data(psrc, smol["renderer"], 47, cache_dir=cache, bad_rows="skip", log=logs.append)
    assert logs == [f"data: 4 preference pairs from {psrc} (cached); when built: 4 of 5 preference pairs kept (1 bad "
                    "row(s) skipped); 1 completions truncated to fit seq_len+1=48 tokens (the prompt is kept); 0 "
                    f"pair(s) dropped (the prompt alone fills the 48 tokens); first bad row: {psrc}:5: "
                    + first[0].split(f"{psrc}:5: ", 1)[1]], logs
    _drop_losses(d.path)
    logs = []
    build_preference_data(psrc, smol["renderer"], 47, cache_dir=cache, bad_rows="skip", log=logs.append)
    assert logs == [f"data: 4 preference pairs from {psrc} (cached)"]


def test_cached_text_line_repeats_the_bad_rows(smol, tmp_path):
    """The text build: a cache hit repeats how many bad rows the build skipped and the first (it logs nothing
    on a hit otherwise, as before, and nothing for a file without the record)."""
    from npu_train.data.prepare import TextSpec, build_packed_data
    from npu_train.data.sources import resolve_source

    src = _write(tmp_path, [{"text": f"Line {i} of some plain text for packing."} for i in range(20)] + [{"text": 5}])
    spec = TextSpec(resolve_source(src, "text"), bad_rows="skip")
    first = []
    d = build_packed_data(spec, smol["tok"], 16, 0.1, eos_id=0, cache_dir=tmp_path / "c", log=first.append)
    said = [m for m in first if "bad row(s) skipped" in m]
    assert said == [f"data: 1 bad row(s) skipped (data.bad_rows=skip); first: {src}:21: " + said[0].split(":21: ")[1]]
    logs = []
    build_packed_data(spec, smol["tok"], 16, 0.1, eos_id=0, cache_dir=tmp_path / "c", log=logs.append)
    assert logs == [f"data: {d.n_train + d.n_val} packed sequences of {src} (cached); when built: "
                    + said[0][len("data: "):]], logs
    _drop_losses(d.path)
    logs = []
    build_packed_data(spec, smol["tok"], 16, 0.1, eos_id=0, cache_dir=tmp_path / "c", log=logs.append)
    assert logs == []


def test_full_disk_message_gives_the_free_space_when_the_write_failed(smol, tmp_path, monkeypatch):
    """ENOSPC while pass 1 spools or pass 2 writes the rows: the message gives the free space when the write
    failed (0.0 MB), not what is free again once the build's temporaries were removed (5000 MB)."""
    import errno
    import os
    import shutil
    from collections import namedtuple

    Usage = namedtuple("Usage", "total used free")
    cache = tmp_path / "c"
    cache.mkdir()
    state = {"full": False}

    def usage(d):  # 1 kB left while the temporaries fill the disk; their space is free again once removed
        held = any(p.name.startswith(".") for p in cache.iterdir())
        return Usage(10**10, 0, 1000 if state["full"] and held else 5 * 10**9)

    def enospc(write):
        def full(*a, **k):
            write(*a, **k)
            state["full"] = True
            raise OSError(errno.ENOSPC, "No space left on device")
        return full

    monkeypatch.setattr(shutil, "disk_usage", usage)
    src = _write(tmp_path, _sft_rows("chat", 12))
    with monkeypatch.context() as m:
        m.setattr(spool_mod.SampleSpool, "flush", enospc(spool_mod.SampleSpool.flush))
        with pytest.raises(DataError, match=r"^the disk ran out of space in .*/c \(0\.0 MB free when the write failed; "
                                            r"0\.0 MB written by then, removed since\) while writing the packed "
                                            r"training data: free disk space there or point \$NPT_CACHE at a larger "
                                            r"disk$"):
            build_sft_data(src, "chat", smol["renderer"], 63, cache_dir=cache, log=lambda m: None)
    assert os.listdir(cache) == []
    state["full"] = False
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", enospc(os.pwrite))
        with pytest.raises(DataError, match=r"^the disk ran out of space in .*/c \(0\.0 MB free when the write failed; "
                                            r"the packed data needs 1\.\d MB\) while writing the packed training data: "
                                            r"free disk space there or point \$NPT_CACHE at a larger disk$"):
            build_preference_data(_write(tmp_path, _pref_rows("standard", 6)[0], "p.jsonl"), smol["renderer"], 47,
                                  cache_dir=cache, log=lambda m: None)
    assert os.listdir(cache) == []
