#!/usr/bin/env python
"""Saved activations of a stack of decoder layers, measured from outside, against the planner's per-layer figure
(``planner/memory.py::activation_bytes_per_layer``).

A child process (1 torch thread, ``MALLOC_MMAP_THRESHOLD_=65536`` so every tensor above 64 KiB is its own mapping,
returned on free, and RSS follows the live tensors) builds ``--layers`` decoder layers of a small Llama shape,
runs one forward and backward to warm up, then a forward whose graph it keeps. The parent reads the child's
``RssAnon`` from ``/proc/<pid>/status`` before that forward and after it (the child waits at each point), and
prints the growth less the stack's output (``b*S*H*e``) per layer, next to the planner's ``sdpa`` (fused kernel),
``eager`` (probabilities saved) and ``core`` figures; then the peak RSS the backward adds on top of the held
graph (``VmHWM`` after a reset through ``/proc/<pid>/clear_refs``), against one layer's fp32 probabilities and the
planner's transient for the kernel (``attention_transient_bytes``: the layer's backward on an eager card;
``--frozen`` leaves the weight gradients out of the peak, as the plan counts them in its own term, and the linear
layers' saved inputs out of the held graph; ``--input-grad`` keeps the parameters trained, so the held graph is
training's, and asks the backward for the input's gradient only, the term's own case). ``--shape llama-3.2-1b``:
Llama-3.2-1B's layers.
``--kernel math`` runs attention through PyTorch's math kernel (``sdpa_kernel(SDPBackend.MATH)``, which saves the
probabilities, as an unfused kernel would); ``fused`` lets PyTorch choose (flash attention on CPU). ``--core`` checkpoints the attention core
(``train.recompute_attention``). ``--kv-heads`` sets the key/value heads (4 of 8: grouped-query attention, the
default; 8: none).

Usage::

    .venv/bin/python experiments/bench/activation_rss.py --kernel fused --dtype fp32
    .venv/bin/python experiments/bench/activation_rss.py --kernel math --dtype bf16 --seq 1024
    .venv/bin/python experiments/bench/activation_rss.py --kernel math --dtype fp32 --kv-heads 8
    .venv/bin/python experiments/bench/activation_rss.py --kernel math --dtype bf16 --frozen [--core]
    .venv/bin/python experiments/bench/activation_rss.py --kernel math --dtype bf16 --input-grad \
        --shape llama-3.2-1b --seq 64 --batch 1 [--core]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SHAPE = dict(vocab_size=256, hidden_size=512, intermediate_size=1376, num_layers=4, num_heads=8, num_kv_heads=4,
             head_dim=64)
#: ``--shape``: the default above, or Llama-3.2-1B's layer (hidden 2048, 32 heads of 64, 8 key/value heads)
SHAPES = {"bench": SHAPE, "llama-3.2-1b": dict(vocab_size=256, hidden_size=2048, intermediate_size=8192,
                                                num_layers=4, num_heads=32, num_kv_heads=8, head_dim=64)}


def rss_anon(pid: int, field: str = "RssAnon") -> int:
    """``field`` (``RssAnon``, ``VmRSS``, ``VmHWM``) of process ``pid``'s ``/proc/<pid>/status``, bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def child(args) -> None:
    import torch

    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import DecoderLayer, rope_cos_sin

    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cfg = LlamaConfig(**{**SHAPES[args.shape], "num_layers": args.layers,
                         "num_kv_heads": args.kv_heads or SHAPES[args.shape]["num_kv_heads"]})
    layers = [DecoderLayer(cfg, i, recompute_core=args.core).to(dtype).requires_grad_(not args.frozen)
              for i in range(args.layers)]
    cos, sin = rope_cos_sin(cfg, args.seq, dtype=dtype)
    x = torch.randn(args.batch, args.seq, cfg.hidden_size, dtype=dtype)

    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def kernel():  # the backward too (a checkpointed core recomputes with it)
        return sdpa_kernel(SDPBackend.MATH) if args.kernel == "math" else nullcontext()

    def run():
        h = run.first = x.detach().requires_grad_(True)
        with kernel():
            for layer in layers:
                h = layer(h, cos, sin)
        return h

    with kernel():  # warm-up: lazily built state, the kernels' first calls (the backward the run will make)
        if args.input_grad:
            warm = run()
            torch.autograd.grad(warm, [run.first], torch.ones_like(warm))
            del warm
        else:
            run().float().sum().backward()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    sys.stdout.write("base\n")
    sys.stdout.flush()
    sys.stdin.readline()
    out = run()
    grad = torch.ones_like(out) if args.input_grad else None
    sys.stdout.write("held\n")
    sys.stdout.flush()
    sys.stdin.readline()
    with kernel():  # the parent reset the peak RSS: what the backward allocates on top of the held graph
        if args.input_grad:  # the layers' input gradient only: no weight gradients, the held graph training's
            torch.autograd.grad(out, [run.first], grad)
        else:
            out.float().sum().backward()
    sys.stdout.write("backward\n")
    sys.stdout.flush()
    sys.stdin.readline()
    del out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--kernel", choices=("fused", "math"), default="fused")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="bench", help="the layers' shape")
    ap.add_argument("--kv-heads", type=int, default=0,
                    help="key/value heads (equal to the heads: no grouped-query attention; default: the shape's)")
    ap.add_argument("--core", action="store_true", help="the attention core checkpointed (recompute_attention)")
    ap.add_argument("--frozen", action="store_true", help="parameters frozen: no weight gradients in the backward")
    ap.add_argument("--input-grad", action="store_true",
                    help="parameters trained, the backward asked for the input's gradient only (torch.autograd.grad):"
                         " the held graph is training's, no weight gradients (the plan's grads term)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", *sys.argv[1:]]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "base"
    time.sleep(0.2)
    base = rss_anon(p.pid)
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "held"
    time.sleep(0.2)
    held = rss_anon(p.pid)
    held_rss = rss_anon(p.pid, "VmRSS")
    with open(f"/proc/{p.pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "backward"
    peak = rss_anon(p.pid, "VmHWM") - held_rss
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait()

    from npu_train.model.config import LlamaConfig
    from npu_train.planner import RunShape
    from npu_train.planner.memory import activation_bytes_per_layer, attention_transient_bytes

    cfg = LlamaConfig(**{**SHAPES[args.shape], "num_layers": args.layers,
                         "num_kv_heads": args.kv_heads or SHAPES[args.shape]["num_kv_heads"]})
    shape = RunShape(seq_len=args.seq, micro_batch=args.batch, micro_batches=1, schedule="1f1b", dtype=args.dtype)
    e = 4 if args.dtype == "fp32" else 2
    out = args.batch * args.seq * cfg.hidden_size * e
    per = (held - base - out) / args.layers
    figs = {a: activation_bytes_per_layer(cfg, shape, a) for a in ("sdpa", "eager", "core")}
    print(f"layers {args.layers}, S {args.seq}, b {args.batch}, {args.dtype}, kv heads {args.kv_heads} of "
          f"{cfg.num_heads}, kernel {args.kernel}"
          f"{', core checkpointed' if args.core else ''}: RssAnon +{(held - base) / 2**20:.1f} MiB, less the output "
          f"{out / 2**20:.1f} MiB: {per / 2**20:.2f} MiB per layer; planner: "
          + ", ".join(f"{a} {v / 2**20:.2f} MiB ({per / v:.3f}x)" for a, v in figs.items()))
    probs = 4 * cfg.num_heads * args.batch * args.seq ** 2
    planned = attention_transient_bytes(cfg, shape, args.core) if args.kernel == "math" else 0
    grads = ("no weight gradients" if args.frozen else "input gradient only" if args.input_grad
             else "weight gradients included")
    print(f"backward: peak RSS {peak / 2**20:.1f} MiB above the held graph ({grads}) = "
          f"{peak / probs:.2f}x one layer's fp32 probabilities [b, a, S, S] ({probs / 2**20:.1f} MiB); planner's "
          f"transient {planned / 2**20:.1f} MiB ({planned / max(peak, 1):.3f}x the peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
