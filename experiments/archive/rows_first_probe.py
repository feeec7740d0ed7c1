"""The first stage's optimizer step with and without the rows-first embedding update, in-process.

SmolLM2-135M's shapes: the [49152, 576] embedding + 19 decoder layers (the first stage of a 19/11
split), fp32, every parameter resident (its own master on a cpu card), clip active, 1024 looked-up
rows, one thread. Prints per step the optimizer step's milliseconds and those of the part left for
after the next step's first forward (``StageOptimizer.finish_rows``).

    .venv/bin/python experiments/archive/rows_first_probe.py

Record: experiments/2026-12-01-bench-run8.md, section 3.
"""
from __future__ import annotations

import time

import torch

from npu_train.backends.cpu import CPUBackend
from npu_train.optim.adamw import StageOptimizer

V, H, I, LAYERS = 49152, 576, 1536, 19
EMB = "model.embed_tokens.weight"



def main() -> None:
    torch.set_num_threads(1)
    shapes = {EMB: (V, H)}
    per_layer = {"self_attn.q_proj": (H, H), "self_attn.k_proj": (192, H), "self_attn.v_proj": (192, H),
                 "self_attn.o_proj": (H, H), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H),
                 "mlp.down_proj": (H, I), "input_layernorm": (H,), "post_attention_layernorm": (H,)}
    for layer in range(LAYERS):
        for k, s in per_layer.items():
            shapes[f"model.layers.{layer}.{k}.weight"] = s
    init = {n: torch.randn(s) * 0.02 for n, s in shapes.items()}
    rows = torch.unique(torch.randint(0, V, (1024,)))
    for rows_first in (None, EMB):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        opt = StageOptimizer(params, init, set(params), CPUBackend(), lr=1e-4, weight_decay=0.1, rows_first=rows_first)
        out = []
        for _ in range(5):
            for p in params.values():
                p.grad = torch.randn_like(p) * 1e-3
            t0 = time.perf_counter()
            opt.step(1e-4, 0.5, rows=rows if rows_first else None)
            t1 = time.perf_counter()
            rest = opt.finish_rows()
            out.append(f"{(t1 - t0) * 1e3:.1f}+{rest * 1e3:.1f}")
        print(f"rows_first={rows_first}: step + rest (ms): {' '.join(out)}", flush=True)


if __name__ == "__main__":
    main()
