#!/usr/bin/env python
"""Tokenization throughput of the data pipeline vs the tokenizers library's batch encoding (issue 25).

``python experiments/bench/data_tokenize.py --mb 50 --rounds 2 [--tokenizer PATH] [--json OUT]``

A JSONL corpus of ``--mb`` MB (runs of 8 Botchan lines joined into ~2 KB documents, shuffled with a fixed
seed) is written once. Every round runs, in a rotated order:

- ``encode_batch``: the lines read and parsed with ``json.loads`` (not timed), then
  ``Tokenizer.encode_batch`` over batches of 1000 documents with the ids taken (timed) — the issue's
  baseline;
- ``encode_batch_fast``: the same with ``encode_batch_fast`` (no offsets), when the library has it;
- ``npu-train``: ``build_packed_data`` end to end into an empty cache directory (timed): reading through
  ``datasets`` (streaming JSON), batching, tokenizing, writing the uint16/uint32 token file.

``datasets`` is imported before the rounds (as ``tokenizers`` is for the baselines; a training job imports
it once anyway); its import time is printed on its own (``--cold``: paid inside round 1's npu-train run,
as before 2026-12-03's second data session).

Prints MB/s per variant (median over rounds, [min-max]) and npu-train's ratio to each baseline (>= 0.8 is
the issue's target), with the machine's cores and load; also each variant's process CPU seconds (all
threads), a steadier figure than wall time on a loaded machine. Default tokenizer: the embedded SmolLM2's.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "src"))


def make_corpus(path: str, mb: float, seed: int = 0, doc_chars: int = 2000) -> str:
    """Write a JSONL corpus of about ``mb`` MB of ``{"text": ...}`` rows (Botchan paragraphs, shuffled)."""
    from npu_train.data.text import botchan_text

    if os.path.isfile(path) and abs(os.path.getsize(path) - mb * 1e6) < 0.05 * mb * 1e6 + 1e5:
        return path
    lines = botchan_text().split("\n")  # paragraphs: runs of 8 lines (the text has no blank lines)
    paras = ["\n".join(lines[i:i + 8]) for i in range(0, len(lines), 8)]
    rng = random.Random(seed)
    tmp = path + ".tmp"
    written = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < mb * 1e6:
            doc, n = [], 0
            while n < doc_chars:
                p = paras[rng.randrange(len(paras))]
                doc.append(p)
                n += len(p)
            line = json.dumps({"text": "\n\n".join(doc)}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
    os.replace(tmp, path)
    return path


def _baseline(tok, texts, fast: bool) -> int:
    enc = tok.encode_batch_fast if fast else tok.encode_batch
    n = 0
    for i in range(0, len(texts), 1000):
        for e in enc(texts[i:i + 1000], add_special_tokens=False):
            n += len(e.ids)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokenizer", default="embedded")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "npt-bench-data"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--cold", action="store_true", help="import datasets inside round 1's npu-train run")
    a = ap.parse_args()
    from tokenizers import Tokenizer  # noqa: F401

    if not a.cold:
        from npu_train.data.sources import open_datasets

        t0 = time.perf_counter()
        open_datasets()
        print(f"import datasets: {time.perf_counter() - t0:.2f} s (not timed in the rounds)", flush=True)

    from npu_train.data import build_packed_data
    from npu_train.model import load_tokenizer, resolve_model_path

    os.makedirs(a.workdir, exist_ok=True)
    corpus = make_corpus(os.path.join(a.workdir, f"corpus-{a.mb:g}mb.jsonl"), a.mb)
    size = os.path.getsize(corpus)
    tok = load_tokenizer(resolve_model_path(a.tokenizer))
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    variants = ["encode_batch", "npu-train"] + (["encode_batch_fast"] if hasattr(tok, "encode_batch_fast") else [])
    times = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    tokens = {}
    for r in range(a.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            t0, c0 = time.perf_counter(), time.process_time()
            if v == "npu-train":
                cache = tempfile.mkdtemp(dir=a.workdir, prefix="cache-")
                d = build_packed_data(corpus, tok, seq_len=2048, val_fraction=0.01, eos_id=0, cache_dir=cache)
                tokens[v] = d.n_tokens
                del d
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                shutil.rmtree(cache)
            else:
                tokens[v] = _baseline(tok, texts, fast=v.endswith("fast"))
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
            times[v].append(dt)
            cpu[v].append(dc)
            print(f"round {r + 1} {v:>18}: {dt:7.2f} s  {size / 1e6 / dt:6.2f} MB/s  cpu {dc:7.2f} s  {tokens[v]} tokens",
                  flush=True)
    cores = len(os.sched_getaffinity(0))
    print(f"\ncorpus {size / 1e6:.1f} MB ({len(texts)} documents), {cores} usable cores, "
          f"load average {os.getloadavg()}, tokenizer {a.tokenizer}")
    summary = {}
    for v in variants:
        med = statistics.median(times[v])
        summary[v] = {"median_s": med, "min_s": min(times[v]), "max_s": max(times[v]), "mb_per_s": size / 1e6 / med,
                      "tokens": tokens[v], "cpu_median_s": statistics.median(cpu[v])}
        print(f"{v:>18}: {size / 1e6 / med:6.2f} MB/s  (median {med:.2f} s [{min(times[v]):.2f}-{max(times[v]):.2f}]; "
              f"cpu median {summary[v]['cpu_median_s']:.2f} s)")
    ours = summary["npu-train"]["median_s"]
    for v in variants:
        if v != "npu-train":
            summary[f"ratio_vs_{v}"] = summary[v]["median_s"] / ours
            summary[f"cpu_ratio_vs_{v}"] = summary[v]["cpu_median_s"] / summary["npu-train"]["cpu_median_s"]
            print(f"npu-train / {v} throughput: {summary[v]['median_s'] / ours:.2f}x "
                  f"(cpu seconds: {summary[f'cpu_ratio_vs_{v}']:.2f}x)")
    # the stream has one EOS between documents that the baselines do not produce
    print(f"token check: npu-train {tokens['npu-train']} = baseline {tokens['encode_batch']} + "
          f"{len(texts) - 1} EOS: {tokens['npu-train'] == tokens['encode_batch'] + len(texts) - 1}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "times": times, "cpu": cpu, "corpus_bytes": size, "cores": cores,
                       "load": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
