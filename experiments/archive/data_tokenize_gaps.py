#!/usr/bin/env python
"""Where build_packed_data's wall time goes outside the tokenizer's encode calls (old vs new ``dataset.py``).

A proxy tokenizer times every ``encode_batch_fast`` call; printed per build: wall, process CPU, time inside
encode calls, the gaps between consecutive calls (Python work during which the Rayon pool has nothing to
do), before the first and after the last. Setup as for data_tokenize_ab.py::

    git show 418cc5e:src/npu_train/data/dataset.py > src/npu_train/data/_old_dataset.py
    python experiments/archive/data_tokenize_gaps.py /tmp/npt-bench-data/corpus-20mb.jsonl
    rm src/npu_train/data/_old_dataset.py
"""
import sys, time, os, tempfile, shutil, hashlib
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from npu_train.data.sources import open_datasets
open_datasets()
from npu_train.model import load_tokenizer, resolve_model_path
from npu_train.data import dataset as NEW
from npu_train.data import _old_dataset as OLD
tok = load_tokenizer(resolve_model_path("embedded"))
corpus = sys.argv[1]
class Proxy:
    def __init__(self, t): self.t, self.calls = t, []
    def __getattr__(self, k): return getattr(self.t, k)
    def encode_batch_fast(self, *a, **k):
        s = time.perf_counter(); r = self.t.encode_batch_fast(*a, **k); self.calls.append((s, time.perf_counter())); return r
out = {"old": [], "new": []}
dig = {}
for rep in range(3):
    for name, mod in (("old", OLD), ("new", NEW)) if rep % 2 == 0 else (("new", NEW), ("old", OLD)):
        p = Proxy(tok)
        cache = tempfile.mkdtemp(prefix="npt-gaps-")
        w, c = time.perf_counter(), time.process_time()
        d = mod.build_packed_data(corpus, p, seq_len=2048, val_fraction=0.01, eos_id=0, cache_dir=cache)
        W, C, end = time.perf_counter() - w, time.process_time() - c, time.perf_counter()
        dig[name] = hashlib.sha256(open(d.path, "rb").read()).hexdigest(); del d
        shutil.rmtree(cache)
        calls = p.calls
        inside = sum(b - a for a, b in calls)
        between = sum(calls[i + 1][0] - calls[i][1] for i in range(len(calls) - 1))
        out[name].append((W, C, inside, between, calls[0][0] - w, end - calls[-1][1]))
for k, v in out.items():
    for W, C, ins, btw, first, last in v:
        print(f"{k}: wall {W:6.2f} cpu {C:6.2f}  in encode {ins:6.2f}  gaps between encodes {btw:5.2f}  before first {first:4.2f}  after last {last:4.2f}  (gaps total {W-ins:5.2f})")
print("identical files:", dig["old"] == dig["new"])
