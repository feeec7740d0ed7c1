#!/usr/bin/env python
"""The data files two source trees write for the same sources are byte-identical, for every ``data.format``.

``python experiments/bench/data_stream_equal.py --old-src /work/main/src [--workdir DIR]``: builds every case
once with the package at ``--old-src`` and once with this tree, each in its own process, and compares.
In steps (e.g. the old files saved before a refactor, compared after it):

``python experiments/bench/data_stream_equal.py --inputs DIR --build OUT`` builds every case with the package
on ``PYTHONPATH`` into ``OUT/<case>.safetensors`` (``--inputs``: where the generated source files live, made
on first use and reused, so both builds see the same files and modification times);
``python experiments/bench/data_stream_equal.py --compare OLD NEW`` compares two such folders.

Every case goes through ``npu_train.data.prepare.prepare_data`` (the job's entry point, present in every tree)
with the embedded SmolLM2 tokenizer and chat template, a cache of its own (``$NPT_CACHE``), and the cache
file it wrote is compared whole: sha256 of all its bytes (header, metadata and arrays); a difference prints
the metadata and, per array, dtype, shape and sha256. Cases: text (``botchan``; a parquet of documents with
``data.doc_mask``; a ``DatasetDict`` with ``data.val_split``; a JSONL with a bad row and
``data.bad_rows=skip``), chat (``botchan-chat`` packed / one per row, truncation drop / truncate, seq_len 64
to 512, a ``DatasetDict`` split), prompt_completion (rows made from ``botchan-chat``), preference
(``botchan-prefs``; string rows; implicit-prompt strings and conversations; a ``DatasetDict`` split).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

CASES = [  # name, data.* keys (source "@x": generated input file x)
    ("text-botchan-128", dict(format="text", source="botchan", seq_len=128)),
    ("text-docs-64-docmask", dict(format="text", source="@docs.parquet", seq_len=64, text_field="body",
                                  doc_mask=True, val_fraction=0.1)),
    ("text-dd-valsplit-32", dict(format="text", source="@docs_dd", seq_len=32, text_field="body",
                                 val_split="test")),
    ("text-badrow-skip-16", dict(format="text", source="@docs_bad.jsonl", seq_len=16, bad_rows="skip")),
    ("chat-pack-128", dict(format="chat", source="botchan-chat", seq_len=128, pack=True)),
    ("chat-flat-128", dict(format="chat", source="botchan-chat", seq_len=128, pack=False)),
    ("chat-pack-512-trunc", dict(format="chat", source="botchan-chat", seq_len=512, pack=True,
                                 truncation="truncate")),
    ("chat-flat-64-trunc", dict(format="chat", source="botchan-chat", seq_len=64, pack=False,
                                truncation="truncate")),
    ("chat-pack-256-vf0.2", dict(format="chat", source="botchan-chat", seq_len=256, pack=True, val_fraction=0.2)),
    ("chat-dd-valsplit-128", dict(format="chat", source="@chat_dd", seq_len=128, val_split="test")),
    ("pc-pack-96", dict(format="prompt_completion", source="@pc.jsonl", seq_len=96, pack=True)),
    ("pc-flat-128", dict(format="prompt_completion", source="@pc.jsonl", seq_len=128, pack=False)),
    ("pref-128", dict(format="preference", source="botchan-prefs", seq_len=128)),
    ("pref-64-vf0.3", dict(format="preference", source="botchan-prefs", seq_len=64, val_fraction=0.3)),
    ("pref-str-96", dict(format="preference", source="@pref_str.jsonl", seq_len=96)),
    ("pref-implicit-str-96", dict(format="preference", source="@pref_implicit_str.jsonl", seq_len=96)),
    ("pref-implicit-chat-128", dict(format="preference", source="@pref_implicit_chat.jsonl", seq_len=128)),
    ("pref-dd-valsplit-128", dict(format="preference", source="@pref_dd", seq_len=128, val_split="test")),
]

DEFAULTS = dict(val_fraction=0.05, split="train", val_split=None, bad_rows="refuse", text_field="text",
                doc_mask=False, truncation="drop", pack=True, messages_field=None, prompt_field=None,
                completion_field=None, chosen_field=None, rejected_field=None)


def make_inputs(d: str) -> None:
    """The generated sources, written once into ``d`` (kept: their mtimes are part of the cache key)."""
    if os.path.isfile(os.path.join(d, "done")):
        return
    import datasets

    os.makedirs(d, exist_ok=True)
    assets = os.path.join(ROOT, "src/npu_train/data/assets")
    chats = [json.loads(x) for x in open(os.path.join(assets, "botchan_chat.jsonl"))]
    prefs = [json.loads(x) for x in open(os.path.join(assets, "botchan_prefs.jsonl"))]
    text = open(os.path.join(assets, "botchan.txt"), encoding="utf-8-sig").read().replace("\r\n", "\n")
    lines = text.splitlines()[200:]
    paras = ["\n".join(lines[i:i + 8]) for i in range(0, 8 * 400, 8)]  # 400 documents of 8 lines

    def jsonl(name, rows):
        with open(os.path.join(d, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    jsonl("pc.jsonl", [{"prompt": r["messages"][-2]["content"], "completion": r["messages"][-1]["content"]}
                       for r in chats])
    jsonl("docs_bad.jsonl", [{"text": p} if i != 7 else {"text": 7} for i, p in enumerate(paras[:200])])
    strs = [{"prompt": r["prompt"][0]["content"], "chosen": r["chosen"][0]["content"],
             "rejected": r["rejected"][0]["content"]} for r in prefs]
    jsonl("pref_str.jsonl", strs)
    jsonl("pref_implicit_str.jsonl", [{"chosen": s["prompt"] + " " + s["chosen"],
                                       "rejected": s["prompt"] + " " + s["rejected"]} for s in strs])
    jsonl("pref_implicit_chat.jsonl", [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}
                                       for r in prefs])
    docs = datasets.Dataset.from_dict({"body": paras})
    docs.to_parquet(os.path.join(d, "docs.parquet"))
    datasets.DatasetDict({"train": docs.select(range(360)), "test": docs.select(range(360, 400))}).save_to_disk(
        os.path.join(d, "docs_dd"))
    cd = datasets.Dataset.from_list(chats)
    datasets.DatasetDict({"train": cd.select(range(len(chats) - 40)),
                          "test": cd.select(range(len(chats) - 40, len(chats)))}).save_to_disk(
        os.path.join(d, "chat_dd"))
    pd = datasets.Dataset.from_list(prefs)
    datasets.DatasetDict({"train": pd.select(range(500)), "test": pd.select(range(500, len(prefs)))}).save_to_disk(
        os.path.join(d, "pref_dd"))
    open(os.path.join(d, "done"), "w").close()


def build(inputs: str, out: str) -> None:
    """Build every case with the package on sys.path through ``prepare_data``; link each cache file into
    ``out/<case>.safetensors``."""
    from npu_train.data.prepare import prepare_data
    from npu_train.model import embedded_model_path, load_config

    path = embedded_model_path()
    mcfg = load_config(path)
    os.makedirs(out, exist_ok=True)
    for name, kw in CASES:
        d = dict(DEFAULTS, **kw)
        if d["source"].startswith("@"):
            d["source"] = os.path.join(inputs, d["source"][1:])
        cache = os.path.join(out, "cache-" + name)
        os.environ["NPT_CACHE"] = cache
        cfg = SimpleNamespace(data=SimpleNamespace(**d), model=SimpleNamespace(tokenizer=None))
        data = prepare_data(cfg, path, mcfg, log=lambda m: None)
        dst = os.path.join(out, name + ".safetensors")
        if os.path.exists(dst):
            os.unlink(dst)
        os.link(data.path, dst)
        print(name, "built", flush=True)


def read(path: str) -> tuple[str, dict, dict]:
    """``(sha256 of the file, metadata, {array: (dtype, shape, sha256)})`` of a packed-data file."""
    whole = hashlib.sha256(open(path, "rb").read()).hexdigest()[:16]
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        arrays = {}
        for k, v in header.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            f.seek(base + a)
            arrays[k] = (v["dtype"], tuple(v["shape"]), hashlib.sha256(f.read(b - a)).hexdigest()[:16])
    return whole, header.get("__metadata__", {}), arrays


def compare(old: str, new: str) -> int:
    """Print one line per case (IDENTICAL: the two files' bytes are equal); the number of cases that differ."""
    bad = 0
    for name, _ in CASES:
        wo, mo, ao = read(os.path.join(old, name + ".safetensors"))
        wn, mn, an = read(os.path.join(new, name + ".safetensors"))
        same = wo == wn
        bad += not same
        shapes = ", ".join(f"{k} {v[0]}{list(v[1])}" for k, v in sorted(an.items()))
        print(f"{name:24s} {'IDENTICAL' if same else 'DIFFERENT'}  sha256 {wn}  n_tokens {mn.get('n_tokens')}  "
              f"{shapes}")
        if not same:
            print("   old", mo, ao, "\n   new", mn, an)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-src", help="build with this tree and with this checkout's src, then compare")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--inputs", help="the generated sources' folder (made on first use)")
    ap.add_argument("--build", metavar="OUT", help="build every case with the package on PYTHONPATH into OUT")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    a = ap.parse_args()
    if a.build:
        inputs = a.inputs or os.path.join(a.build, "inputs")
        make_inputs(inputs)
        build(inputs, a.build)
        return 0
    if a.compare:
        return 1 if compare(*a.compare) else 0
    if not a.old_src:
        ap.error("give --old-src, --build or --compare")
    work = a.workdir or tempfile.mkdtemp(prefix="npt-stream-eq-")
    inputs = a.inputs or os.path.join(work, "inputs")
    for which, src in (("old", a.old_src), ("new", os.path.join(ROOT, "src"))):
        env = dict(os.environ, PYTHONPATH=src)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--inputs", inputs, "--build",
                        os.path.join(work, which)], env=env, check=True, cwd=work)
    return 1 if compare(os.path.join(work, "old"), os.path.join(work, "new")) else 0


if __name__ == "__main__":
    sys.exit(main())
