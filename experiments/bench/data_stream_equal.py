#!/usr/bin/env python
"""Old (in-memory) vs streamed chat / prompt_completion / preference builds give the same packed arrays.

``python experiments/bench/data_stream_equal.py --old-src /work/main/src [--workdir DIR]``

Runs every case once with the package at ``--old-src`` (the in-memory build of e602f95; its result written
with that tree's ``save_packed``) and once with this tree (the streamed build, its cache file), each in its
own process, with the embedded SmolLM2 tokenizer and chat template; then compares per case every array
(dtype, shape, sha256 of the bytes) and the metadata (fingerprint, n_tokens, max_id, pairs). Cases:
``botchan-chat`` (chat) with pack on / off, truncation drop / truncate, seq_len 128 / 512; prompt_completion
rows made from it; ``botchan-prefs`` (preference) at seq_len 128 / 256.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))

CASES = [  # name, format, source ("pc" = prompt_completion rows made from botchan-chat), knobs
    ("chat-pack-128", "chat", "botchan-chat", dict(seq_len=128, pack=True)),
    ("chat-flat-128", "chat", "botchan-chat", dict(seq_len=128, pack=False)),
    ("chat-pack-512-trunc", "chat", "botchan-chat", dict(seq_len=512, pack=True, truncation="truncate")),
    ("chat-flat-64-trunc", "chat", "botchan-chat", dict(seq_len=64, pack=False, truncation="truncate")),
    ("chat-pack-256-vf0.2", "chat", "botchan-chat", dict(seq_len=256, pack=True, val_fraction=0.2)),
    ("pc-pack-96", "prompt_completion", "pc", dict(seq_len=96, pack=True)),
    ("pref-128", "preference", "botchan-prefs", dict(seq_len=128)),
    ("pref-64", "preference", "botchan-prefs", dict(seq_len=64, val_fraction=0.3)),
]


def worker(out_dir: str, which: str) -> None:
    """Build every case with the package on sys.path; write ``<case>.safetensors`` into ``out_dir``."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - the renderer needs it

    from npu_train.data.chat import ChatRenderer
    from npu_train.data.dataset import save_packed
    from npu_train.data.preference import build_preference_data
    from npu_train.data.sft import build_sft_data
    from npu_train.model import chat_template, embedded_model_path, load_config, load_tokenizer, special_tokens

    path = embedded_model_path()
    cfg, tok = load_config(path), load_tokenizer(path)
    r = ChatRenderer(tok, chat_template(path), eos_id=cfg.eos_token_id, **special_tokens(path))
    pc = os.path.join(out_dir, "..", "pc.jsonl")
    for name, fmt, src, kw in CASES:
        src = pc if src == "pc" else src
        cache = os.path.join(out_dir, "cache-" + name)
        kw = dict(kw)
        seq_len = kw.pop("seq_len")
        if fmt == "preference":
            d = build_preference_data(src, r, seq_len, kw.pop("val_fraction", 0.05), pad_id=cfg.eos_token_id,
                                      cache_dir=cache, log=lambda m: None)
        else:
            d = build_sft_data(src, fmt, r, seq_len, kw.pop("val_fraction", 0.05), pad_id=cfg.eos_token_id,
                               cache_dir=cache, log=lambda m: None, **kw)
        out = os.path.join(out_dir, name + ".safetensors")
        if d.path is not None:
            os.link(d.path, out)
        else:
            save_packed(d, out)
        print(which, name, "built", flush=True)


def read(path: str) -> tuple[dict, dict]:
    """``(meta, {name: (dtype, shape, sha256)})`` of a packed-data file."""
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
    return header.get("__metadata__", {}), arrays


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-src", required=True)
    ap.add_argument("--workdir", default=tempfile.mkdtemp(prefix="npt-stream-eq-"))
    ap.add_argument("--worker", nargs=2, metavar=("OUT", "WHICH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(*a.worker)
        return 0
    os.makedirs(a.workdir, exist_ok=True)
    rows = [json.loads(x) for x in open(os.path.join(ROOT, "src/npu_train/data/assets/botchan_chat.jsonl"))]
    with open(os.path.join(a.workdir, "pc.jsonl"), "w") as f:
        for r in rows:
            m = r["messages"]
            f.write(json.dumps({"prompt": m[-2]["content"], "completion": m[-1]["content"]}) + "\n")
    for which, src in (("old", a.old_src), ("new", os.path.join(ROOT, "src"))):
        out = os.path.join(a.workdir, which)
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=src)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--old-src", a.old_src, "--worker", out, which],
                       env=env, check=True, cwd=a.workdir)
    bad = 0
    for name, *_ in CASES:
        mo, ao = read(os.path.join(a.workdir, "old", name + ".safetensors"))
        mn, an = read(os.path.join(a.workdir, "new", name + ".safetensors"))
        keys = ("fingerprint", "n_tokens", "max_id", "pairs", "seq_len", "format")
        same = ao == an and all(mo.get(k) == mn.get(k) for k in keys)
        bad += not same
        shapes = ", ".join(f"{k} {v[0]}{list(v[1])}" for k, v in sorted(an.items()))
        print(f"{name:22s} {'IDENTICAL' if same else 'DIFFERENT'}  n_tokens {mn.get('n_tokens')}  {shapes}")
        if not same:
            print("   old", mo, ao, "\n   new", mn, an)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
