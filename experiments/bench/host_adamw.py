#!/usr/bin/env python
"""Host AdamW step on CPU: fused vs foreach vs for-loop, and the cost of emitting a bf16 copy.

The host optimizer of offloaded layers (``npu_train.optim.adamw``) is
``torch.optim.AdamW(fused=True)`` over fp32 masters on the CPU; after the step the trainer casts
each master to the compute dtype and uploads it (``m.to(p.dtype)`` then ``backend.upload``). This
benchmark times, on ~50M fp32 params:

- ``AdamW(fused=True)`` (baseline), ``AdamW(foreach=True)``, ``AdamW(foreach=False)`` (for-loop);
- emitting the bf16 copy after the step: ``m.to(torch.bfloat16)`` per tensor (fresh allocations,
  what the trainer does), ``buf.copy_(m)`` into preallocated bf16 buffers, and
  ``torch._foreach_copy_`` into preallocated buffers.

Each figure is the median of ``--reps`` steps after two warm-up steps (the first allocates the
moments), for every thread count in ``--threads`` (default 1 and all cores; with two cpu card
processes on two cores each process runs one thread). Ratios are against the fused step measured
in the same run at the same thread count.

Usage::

    .venv/bin/python experiments/bench/host_adamw.py [--params 50e6] [--threads 1 2] [--reps 7]
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from statistics import median

import torch


def make_params(n_params: int, layout: str) -> list[torch.nn.Parameter]:
    """fp32 parameters with gradients. ``model``: SmolLM2-like tensors (576x1536 MLP matrices,
    576x576 / 192x576 attention matrices, 576 norms) until ``n_params``; ``uniform``: 16 equal
    tensors."""
    shapes: list[tuple[int, ...]] = []
    if layout == "uniform":
        shapes = [(n_params // 16,)] * 16
    else:
        layer = [(576,), (576, 576), (192, 576), (192, 576), (576, 576), (576,),
                 (1536, 576), (1536, 576), (576, 1536)]
        total = 0
        while total < n_params:
            for s in layer:
                shapes.append(s)
                total += int(torch.Size(s).numel())
    g = torch.Generator().manual_seed(0)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        ps.append(p)
    return ps


def timed(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def bench(n_params: int, threads: int, reps: int, layout: str) -> list[tuple[str, float, int]]:
    torch.set_num_threads(threads)
    out = []
    n = None
    for name, kw in (("AdamW fused=True", {"fused": True}),
                     ("AdamW foreach=True", {"foreach": True}),
                     ("AdamW foreach=False (for-loop)", {"foreach": False})):
        ps = make_params(n_params, layout)
        n = sum(p.numel() for p in ps)
        opt = torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
        out.append((name, timed(opt.step, reps), n))
        del opt, ps
    ps = make_params(n_params, layout)
    masters = [p.detach() for p in ps]
    out.append(("bf16 copy: m.to(bf16) per tensor (trainer)",
                timed(lambda: [m.to(torch.bfloat16) for m in masters], reps), n))
    bufs = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]

    def into():
        for b, m in zip(bufs, masters):
            b.copy_(m)

    out.append(("bf16 copy: buf.copy_(m) preallocated", timed(into, reps), n))
    out.append(("bf16 copy: _foreach_copy_ preallocated",
                timed(lambda: torch._foreach_copy_(bufs, masters), reps), n))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=50e6)
    ap.add_argument("--threads", type=int, nargs="*", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layout", choices=("model", "uniform"), default="model")
    args = ap.parse_args(argv)
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.lower().startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"torch {torch.__version__}, {cpu}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
          f"{args.params / 1e6:.0f}M fp32 params ({args.layout} layout), median of {args.reps}")
    for t in args.threads:
        rows = bench(int(args.params), t, args.reps, args.layout)
        base = rows[0][1]
        n = rows[0][2]
        print(f"\nthreads {t} ({n / 1e6:.1f}M params in tensors; load {os.getloadavg()[0]:.2f})")
        print(f"  {'variant':<44} {'s/step':>8} {'M params/s':>11} {'vs fused':>9}")
        for name, sec, n in rows:
            print(f"  {name:<44} {sec:8.4f} {n / sec / 1e6:11.0f} {sec / base:8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
