"""In-process timing of the last stage's head, plain torch ops against model/headops.py (record:
experiments/2026-12-02-head.md). One torch thread, the project's host-memory setting, SmolLM2-135M's head
shape (V = 49152, H = 576) at 128 tokens per micro-batch, fp32; medians of 10 repetitions after 2 warm-ups,
two rounds per figure, printed in ms:

1. the weight-gradient product alone: ``g^T x`` into a fresh tensor, that plus ``grad.add_`` (what autograd's
   accumulator does from the second micro-batch on), and ``grad.addmm_(g^T, x)`` (the fused path);
2. the cross-entropy on ``[128, 49152]`` logits: ``F.cross_entropy`` against ``cross_entropy_sum``,
   forward alone and forward + backward;
3. the whole head per micro-batch (linear + cross-entropy, forward + backward, ``.grad`` already there):
   ``nn.Linear`` + ``F.cross_entropy`` against ``HeadLinear(fused_grad=True)`` + ``cross_entropy_sum``.

    .venv/bin/python experiments/archive/head_fused_probe.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from npu_train.hostmem import keep_freed_memory  # noqa: E402
from npu_train.model.headops import HeadLinear, cross_entropy_sum  # noqa: E402

V, H, T = 49152, 576, 128


def ms(f, n: int = 10) -> float:
    f()
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1e3, 1)


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, g, grad = torch.randn(T, H), torch.randn(T, V), torch.randn(V, H)
    z = torch.randn(T, V, requires_grad=True)
    lab = torch.randint(0, V, (T,))
    plain = torch.nn.Linear(H, V, bias=False)
    fused = HeadLinear(H, V)
    fused.weight.data.copy_(plain.weight.data)
    fused.fused_grad = True
    xh = torch.randn(1, T, H, requires_grad=True)
    for head in (plain, fused):
        head.weight.grad = torch.zeros_like(head.weight)

    def head_plain():
        F.cross_entropy(plain(xh).reshape(-1, V), lab, reduction="sum").div(1000).backward()

    def head_fused():
        cross_entropy_sum(fused(xh).reshape(-1, V), lab).div(1000).backward()

    for r in range(2):
        print(f"round {r}: dW g^T x {ms(lambda: g.t() @ x)} | + grad.add_ {ms(lambda: grad.add_(g.t() @ x))} | "
              f"grad.addmm_ {ms(lambda: grad.addmm_(g.t(), x))}")
        print(f"round {r}: CE fwd plain {ms(lambda: F.cross_entropy(z, lab, reduction='sum'))} | "
              f"fused {ms(lambda: cross_entropy_sum(z, lab))} | fwd+bwd plain "
              f"{ms(lambda: F.cross_entropy(z, lab, reduction='sum').backward())} | "
              f"fused {ms(lambda: cross_entropy_sum(z, lab).backward())}")
        print(f"round {r}: head per micro-batch plain {ms(head_plain)} | fused {ms(head_fused)}")


if __name__ == "__main__":
    main()
