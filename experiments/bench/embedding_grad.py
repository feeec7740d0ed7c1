#!/usr/bin/env python
"""The first stage's embedding gradient: torch's dense backward vs rows into a dense ``.grad``.

One optimizer step's worth of embedding backwards (``--micro-batches`` lookups of ``[1, --seq-len]``
token ids into the embedded SmolLM2-135M's ``[49152, 576]`` fp32 embedding, each followed by its
backward, gradients accumulated as the trainer does), timed for

- ``dense``: ``F.embedding(ids, w)`` (torch's default, what ``nn.Embedding`` does): every backward
  makes a new dense ``[V, H]`` gradient (allocation, page faults, zeroing, a scatter) and autograd
  adds it into ``.grad``;
- ``rows``: ``F.embedding(ids, w, sparse=True)`` added into a dense zero ``.grad`` made once per step
  (``StageModule.sparse_embed_grad``, what the project's trainer does on cpu cards; the zeroing of that
  ``.grad`` is included in the figure).

Both in one pinned process at ``--threads`` threads, interleaved over ``--rounds`` rounds; prints the
medians, min-max and the ratio dense/rows, and checks that both give the same gradient.

Usage (from the repository root)::

    .venv/bin/python experiments/bench/embedding_grad.py --rounds 7
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

from _common import machine_info, pin_self, spread, usable_cores  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    pin_self(usable_cores()[0])
    import torch
    import torch.nn.functional as F

    from npu_train.model import load_config, resolve_model_path

    torch.set_num_threads(a.threads)
    cfg = load_config(resolve_model_path("embedded"))
    V, H = cfg.vocab_size, cfg.hidden_size
    w = torch.nn.Parameter(torch.randn(V, H) * 0.02)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, V, (1, a.seq_len), generator=gen) for _ in range(a.micro_batches)]
    gs = [torch.randn(1, a.seq_len, H, generator=gen) for _ in range(a.micro_batches)]

    def step(sparse: bool) -> float:
        w.grad = None
        t0 = time.perf_counter()
        if sparse:
            w.grad = torch.zeros_like(w)
        for x, g in zip(ids, gs):
            F.embedding(x, w, sparse=sparse).backward(g)
        return time.perf_counter() - t0

    step(False), step(True)  # warm-up
    ref = (step(False), w.grad.clone())[1]
    step(True)
    same = torch.equal(ref, w.grad)
    res = {"dense": [], "rows": []}
    for r in range(a.rounds):
        for k in (("dense", "rows") if r % 2 == 0 else ("rows", "dense")):
            res[k].append(step(k == "rows"))
    print(machine_info())
    print(f"embedding [{V}, {H}] fp32 ({V * H * 4 / 1e6:.0f} MB), {a.micro_batches} micro-batches of [1, {a.seq_len}] "
          f"ids per step, {a.threads} thread(s), pinned to core {usable_cores()[0]}, {a.rounds} rounds")
    d, s = spread(res["dense"]), spread(res["rows"])
    for k, v in (("dense (torch default)", d), ("rows into a dense .grad", s)):
        print(f"  {k:<24} {v['median']:.4f} s per step [{v['min']:.4f}-{v['max']:.4f}]")
    ratios = spread([x / y for x, y in zip(res["dense"], res["rows"])])
    print(f"  dense / rows: {ratios['median']:.0f}x [{ratios['min']:.0f}-{ratios['max']:.0f}]; "
          f"same gradient bit for bit: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
