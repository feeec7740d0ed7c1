#!/usr/bin/env python
"""Launcher and card processes' peak memory against the corpus size (issue 25): it must not grow.

``python experiments/bench/data_memory.py --sizes 10,300 [--format text|chat] [--workdir DIR] [--json OUT]``

``--format chat``: a JSONL corpus of generated conversations (:func:`make_chat_corpus`: 1-2 turns, each
message 1-2 Botchan sentences) and the tiny model given a chat template (:data:`CHAT_TEMPLATE`,
``<|endoftext|>`` ending each turn); the job adds ``data.format=chat data.seq_len=256
data.truncation=truncate`` (``data.pack`` stays on, its default).

For each size (MB of JSONL text, :func:`data_tokenize.make_corpus`) one short training job of a tiny random
Llama (tests/integration/conftest.py ``make_tiny_model``, byte-level BPE of 384 entries, so ~2.5 bytes a
token) runs under ``memwatch.py`` (sampled from outside the processes, every 0.2 s): ``launch/run.py
data.source=<corpus> data.seq_len=128 train.steps=3 train.micro_batch=2 train.accum=2 data.eval_batches=0
checkpoint.save=false``, with the data cache emptied first so the launcher tokenizes the corpus in that
run. Prints per size: the launcher's and the largest card process's peak RssAnon+RssShmem (what the
process holds itself; the memory-mapped token file is page cache, RssFile) and VmHWM (all resident pages,
file-backed included), the token file's size and the wall time; then the 300-vs-10 ratios.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, HERE)
G = 2 ** 30
#: the tiny model's chat template for --format chat (its one special token ends each turn)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def make_chat_corpus(path: str, mb: float, seed: int = 0) -> str:
    """Write a JSONL corpus of about ``mb`` MB of ``{"messages": [...]}`` rows: 1-2 user / assistant turns,
    each message 1-2 Botchan sentences (drawn with ``seed``)."""
    import random
    import re

    from npu_train.data.text import botchan_text

    if os.path.isfile(path) and abs(os.path.getsize(path) - mb * 1e6) < 0.05 * mb * 1e6 + 1e5:
        return path
    sents = [x.strip() for x in re.split(r"(?<=[.!?])\s+", botchan_text()) if 8 < len(x.strip()) < 200]
    rng = random.Random(seed)
    tmp, written = path + ".tmp", 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < mb * 1e6:
            msgs = []
            for _ in range(rng.randint(1, 2)):
                for role in ("user", "assistant"):
                    msgs.append({"role": role, "content": " ".join(rng.choice(sents) for _ in range(rng.randint(1, 2)))})
            line = json.dumps({"messages": msgs}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    os.replace(tmp, path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,300")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "npt-bench-data"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep-data", action="store_true",
                    help="keep token files already in the cache (a corpus tokenized by an earlier run is not "
                         "tokenized again: the card processes' figures only)")
    ap.add_argument("--format", default="text", choices=["text", "chat"])
    ap.add_argument("--root", default=ROOT, help="the tree whose launch/run.py and src/ run the jobs (e.g. an "
                    "older checkout, for contrast); default: this one")
    a = ap.parse_args()
    from data_tokenize import make_corpus

    sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
    from conftest import make_tiny_model

    os.makedirs(a.workdir, exist_ok=True)
    model = make_tiny_model(os.path.join(a.workdir, "tiny"))
    extra = []
    if a.format == "chat":
        with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}, f)
        extra = ["data.format=chat", "data.truncation=truncate"]
    cache = os.path.join(a.workdir, "npt-cache")
    env = dict(os.environ, NPT_CACHE=cache, PYTHONPATH=os.path.join(a.root, "src"))
    results = []
    for mb in [float(x) for x in a.sizes.split(",")]:
        corpus = (make_chat_corpus(os.path.join(a.workdir, f"chat-{mb:g}mb.jsonl"), mb) if a.format == "chat"
                  else make_corpus(os.path.join(a.workdir, f"corpus-{mb:g}mb.jsonl"), mb))
        for f in [] if a.keep_data else glob.glob(os.path.join(cache, "data", "packed-*")):
            os.unlink(f)
        run = tempfile.mkdtemp(dir=a.workdir, prefix=f"run-{mb:g}mb-")
        cmd = [sys.executable, os.path.join(HERE, "memwatch.py"), "--run-dir", run, "--",
               sys.executable, os.path.join(a.root, "launch", "run.py"), f"model.path={model}",
               f"data.source={corpus}", f"data.seq_len={256 if a.format == 'chat' else 128}", *extra,
               "train.steps=3", "train.micro_batch=2", "train.accum=2", "data.eval_batches=0", "checkpoint.save=false", "runtime.threads=1", f"hydra.run.dir={run}"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, cwd=a.root, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            print(out.stdout[-3000:], out.stderr[-3000:])
            return 1
        procs = json.loads(lines[-1])["processes"]
        launcher = [p for p in procs if "launch/run.py" in str(p["cmd"]) and p["card"] is None]
        cards = [p for p in procs if p["card"] is not None]
        token_file = max((os.path.getsize(f) for f in glob.glob(os.path.join(cache, "data", "packed-*.safetensors"))),
                         default=0)
        tok_lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("data: tokeniz", "data: rendering"))
                     or " samples kept" in ln]
        r = {"corpus_mb": os.path.getsize(corpus) / 1e6, "token_file_mb": token_file / 1e6, "wall_s": wall,
             "launcher_anon_shm_gib": max(p["anon_shared_bytes"] for p in launcher) / G,
             "launcher_hwm_gib": max(p["hwm_bytes"] for p in launcher) / G,
             "card_anon_shm_gib": max(p["anon_shared_bytes"] for p in cards) / G,
             "card_hwm_gib": max(p["hwm_bytes"] for p in cards) / G, "n_cards": len(cards),
             "tokenize_log": tok_lines[-1] if tok_lines else ""}
        results.append(r)
        print(f"corpus {r['corpus_mb']:8.1f} MB  token file {r['token_file_mb']:7.1f} MB  launcher anon+shm "
              f"{r['launcher_anon_shm_gib']:.3f} GiB (VmHWM {r['launcher_hwm_gib']:.3f})  card anon+shm "
              f"{r['card_anon_shm_gib']:.3f} GiB (VmHWM {r['card_hwm_gib']:.3f})  wall {wall:.0f} s", flush=True)
        print(f"    {r['tokenize_log']}", flush=True)
    if len(results) >= 2:
        lo, hi = results[0], results[-1]
        print(f"\n{hi['corpus_mb'] / lo['corpus_mb']:.0f}x the text: launcher anon+shm "
              f"{hi['launcher_anon_shm_gib'] / lo['launcher_anon_shm_gib']:.2f}x, VmHWM "
              f"{hi['launcher_hwm_gib'] / lo['launcher_hwm_gib']:.2f}x; card anon+shm "
              f"{hi['card_anon_shm_gib'] / lo['card_anon_shm_gib']:.2f}x, VmHWM {hi['card_hwm_gib'] / lo['card_hwm_gib']:.2f}x")
    print(f"{len(os.sched_getaffinity(0))} usable cores, load average {os.getloadavg()}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"results": results, "load": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
