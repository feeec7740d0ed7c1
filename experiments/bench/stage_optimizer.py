#!/usr/bin/env python
"""The project's per-step optimizer path vs what the torch pipeline worker does, on one stage's tensors.

One process, ``--threads`` intra-op threads, the tensors of a SmolLM2-135M first stage (embedding
49152 x 576 + ``--layers`` decoder layers, fp32, all resident on a ``cpu`` card), interleaved A/B
over ``--reps`` repetitions (the first of each dropped). Per repetition, outside the timing, every
parameter gets a fresh gradient (a clone of fixed random values); timed:

- ``npu-train``: ``StageOptimizer.grad_sq_sum()`` + ``StageOptimizer.step(lr, clip)`` with the
  ``CPUBackend`` (what ``StageTrainer.train_step`` runs after the collectives);
- ``torch``: the squared norm as in ``experiments/bench/pipeline.py``'s torch worker
  (``sum(float(g.pow(2).sum()))``), ``torch._foreach_mul_`` by the clip coefficient when it is < 1,
  ``AdamW(fused=True).step()``, ``zero_grad(set_to_none=True)``.

Prints wall and CPU (``time.process_time``) seconds per repetition, medians, and the largest
difference between the two sides' parameters at the end (0.0: bit-identical updates). CPU seconds
are the robust figure on a shared machine.

Usage (from the repository root)::

    .venv/bin/python experiments/bench/stage_optimizer.py               # 19 layers, clip 0.3, 8 reps
    .venv/bin/python experiments/bench/stage_optimizer.py --src /tmp/old/src   # another checkout's src
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LAYER = [("self_attn.q_proj.weight", (576, 576)), ("self_attn.k_proj.weight", (192, 576)),
         ("self_attn.v_proj.weight", (192, 576)), ("self_attn.o_proj.weight", (576, 576)),
         ("mlp.gate_proj.weight", (1536, 576)), ("mlp.up_proj.weight", (1536, 576)),
         ("mlp.down_proj.weight", (576, 1536)), ("input_layernorm.weight", (576,)),
         ("post_attention_layernorm.weight", (576,))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=19, help="decoder layers besides the embedding")
    ap.add_argument("--clip", type=float, default=0.3, help="clip coefficient passed to the step")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--src", default=str(ROOT / "src"), help="the npu_train sources to time")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.src)
    import torch

    from npu_train.backends.cpu import CPUBackend
    from npu_train.optim.adamw import StageOptimizer

    torch.set_num_threads(args.threads)
    shapes = {"model.embed_tokens.weight": (49152, 576)}
    for i in range(args.layers):
        shapes.update({f"model.layers.{i}.{n}": s for n, s in LAYER})
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) * 0.02 for n, s in shapes.items()}
    grads = {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
    print(f"{sum(t.numel() for t in init.values()) / 1e6:.1f} M fp32 params, clip {args.clip}, "
          f"{args.threads} thread(s), src {args.src}", flush=True)
    pa = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = StageOptimizer(pa, init, list(pa), CPUBackend(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8)
    pb = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    ob = torch.optim.AdamW(list(pb.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused=True)

    def project() -> tuple[float, float]:
        for n, p in pa.items():
            p.grad = grads[n].clone()
        t, c = time.perf_counter(), time.process_time()
        opt.grad_sq_sum()
        opt.step(1e-4, args.clip)
        return time.perf_counter() - t, time.process_time() - c

    def torch_side() -> tuple[float, float]:
        for n, p in pb.items():
            p.grad = grads[n].clone()
        t, c = time.perf_counter(), time.process_time()
        gs = [p.grad for p in pb.values()]
        sum(float(g.detach().float().pow(2).sum()) for g in gs)
        if args.clip < 1.0:
            torch._foreach_mul_(gs, args.clip)
        ob.step()
        ob.zero_grad(set_to_none=True)
        return time.perf_counter() - t, time.process_time() - c

    res: dict[str, list] = {"npu-train": [], "torch": []}
    for r in range(args.reps):
        order = (("npu-train", project), ("torch", torch_side))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            res[name].append(fn())
    for name, rr in res.items():
        wall, cpu = [w for w, _ in rr[1:]], [c for _, c in rr[1:]]
        print(f"{name:10s} wall median {statistics.median(wall):.3f} s, CPU median {statistics.median(cpu):.3f} s "
              f"(wall per rep {[round(w, 3) for w in wall]})")
    with torch.no_grad():
        diff = max(float((pa[n] - pb[n]).abs().max()) for n in pa)
    print(f"largest |parameter difference| after {args.reps} steps: {diff}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
