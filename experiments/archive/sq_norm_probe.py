"""Squared gradient norms: ``pow(2).sum()`` against :func:`npu_train.optim.offload.squared_sum`
(time, one thread, and relative error against an fp64 sum), plus whole-tensor ``dot`` /
``vector_norm`` for their error.

    .venv/bin/python experiments/archive/sq_norm_probe.py

Record: experiments/2026-12-01-bench-run8.md, section 2.
"""
from __future__ import annotations

import time

import torch

from npu_train.optim.offload import squared_sum


def _ms(fn, n=5) -> str:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return " ".join(f"{x:.1f}" for x in out)


def _err(got, x) -> float:
    ref = float((x.double() ** 2).sum())
    return abs(float(got) - ref) / ref


def main() -> None:
    torch.set_num_threads(1)
    emb = torch.randn(49152, 576)
    print("[49152, 576] fp32 ms  pow.sum:", _ms(lambda: emb.pow(2).sum()), " squared_sum:", _ms(lambda: squared_sum(emb)))
    layer = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (576,), (576,)]
    ts = [torch.randn(s) for s in layer * 19]
    print("19 layers (171 tensors) ms  pow.sum:", _ms(lambda: [t.pow(2).sum() for t in ts]),
          " squared_sum:", _ms(lambda: [squared_sum(t) for t in ts]))
    x = torch.randn(28_000_000) * 1e-3 + 1e-4
    f = x.reshape(-1)
    print(f"28 M fp32 rel. error  pow.sum {_err(x.pow(2).sum(), x):.1e}  squared_sum {_err(squared_sum(x), x):.1e}  "
          f"dot {_err(torch.dot(f, f), x):.1e}  vector_norm^2 {_err(torch.linalg.vector_norm(f) ** 2, x):.1e}")
    b = torch.randn(4105 * 33 * 10, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print(f"bf16 values rel. error  pow.sum {_err(b.float().pow(2).sum(), b.float()):.1e}  "
          f"squared_sum {_err(squared_sum(b), b.float()):.1e}")


if __name__ == "__main__":
    main()
