#!/usr/bin/env python
"""A/B of two versions of ``npu_train.data.dataset`` against the tokenizers baselines, in one process.

Used for experiments/2026-12-03-data.md (second data session). Put the old version next to the new one first::

    git show 418cc5e:src/npu_train/data/dataset.py > src/npu_train/data/_old_dataset.py
    python experiments/archive/data_tokenize_ab.py /tmp/npt-bench-data/corpus-10mb.jsonl 6
    rm src/npu_train/data/_old_dataset.py

(the corpus is the one ``data_tokenize.py --mb 10`` writes). Rounds rotate the order of encode_batch,
encode_batch_fast (batches of 1000 parsed documents), old and new ``build_packed_data`` into an empty cache;
wall and process CPU seconds per run, medians, ratios, and the sha256 of both cache files (must be equal).
Optional further arguments: batch sizes (characters) for extra ``new-<chars>`` variants.
"""
import sys, time, json, os, tempfile, shutil, hashlib, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from npu_train.data.sources import open_datasets
t=time.perf_counter(); open_datasets(); print("import datasets", round(time.perf_counter()-t, 2))
from npu_train.model import load_tokenizer, resolve_model_path
from npu_train.data import dataset as NEW
from npu_train.data import _old_dataset as OLD
tok = load_tokenizer(resolve_model_path("embedded"))
corpus = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
texts = [json.loads(l)["text"] for l in open(corpus)]
size = os.path.getsize(corpus)
def base(fast):
    enc = tok.encode_batch_fast if fast else tok.encode_batch
    return sum(len(e.ids) for i in range(0, len(texts), 1000) for e in enc(texts[i:i+1000], add_special_tokens=False))
digests = {}
def build(mod, bc=None):
    def f():
        if bc:
            d0 = mod.token_batches.__defaults__
            mod.token_batches.__defaults__ = (bc,)
        cache = tempfile.mkdtemp(prefix="npt-ab-")
        try:
            d = mod.build_packed_data(corpus, tok, seq_len=2048, val_fraction=0.01, eos_id=0, cache_dir=cache)
            n = d.n_tokens
            digests.setdefault(mod.__name__ + str(bc), hashlib.sha256(open(d.path, "rb").read()).hexdigest())
            del d
        finally:
            shutil.rmtree(cache)
            if bc:
                mod.token_batches.__defaults__ = d0
        return n
    return f
V = {"encode_batch": lambda: base(False), "encode_batch_fast": lambda: base(True), "old": build(OLD),
     "new": build(NEW)}
for extra in sys.argv[3:]:
    V[f"new-{extra}"] = build(NEW, int(extra))
names = list(V)
res = {k: [] for k in names}
for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for k in order:
        w, c = time.perf_counter(), time.process_time()
        n = V[k]()
        res[k].append((time.perf_counter() - w, time.process_time() - c))
        print(f"round {r+1} {k:>18}: wall {res[k][-1][0]:6.2f} s  cpu {res[k][-1][1]:6.2f} s  {n} tokens  load {os.getloadavg()[0]:.1f}", flush=True)
print(f"corpus {size/1e6:.1f} MB, load {os.getloadavg()}")
med = {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in res.items()}
for k in names:
    print(f"{k:>18}: wall median {med[k][0]:6.2f} s ({size/1e6/med[k][0]:.2f} MB/s)  cpu median {med[k][1]:6.2f} s")
for k in names:
    if k.startswith(("old", "new")):
        for b in ("encode_batch", "encode_batch_fast"):
            print(f"{k} / {b}: wall {med[b][0]/med[k][0]:.2f}x  cpu {med[b][1]/med[k][1]:.2f}x")
print("digests", digests, "identical:", len(set(digests.values())) == 1)
