#!/usr/bin/env python
"""Cost of the zero-bubble backward split on CPU: forward + B + W vs forward + one full backward.

A zero-bubble schedule (``train.schedule=zb``) replaces each stage backward by an input-gradient
pass B (:func:`npu_train.pipeline.backward.backward_input`) and a deferred weight-gradient pass W
(:meth:`WeightGradWork.run`). The split only pays if B + W costs about one backward. This script
times, on a stage of the SmolLM2-135M shape (the default model) with random weights, per
micro-batch ``[micro_batch, seq_len]``:

- ``full``:  forward, ``out.backward(g)`` (what 1F1B runs);
- ``split``: forward, B, W (what zb runs on every stage but the first);
- ``naive``: forward, ``autograd.grad(out, x, retain_graph=True)`` then a second backward for the
  weights (``autograd.grad(out, params)``): the split done the wrong way, for comparison.

Both a middle stage (layers only) and a last stage (layers + norm + LM head + loss) are timed.
Rounds interleave the modes; each figure is the median over ``--rounds`` rounds (after one warm-up
round), at ``--threads`` torch threads. Gradients of ``split`` are checked against ``full``.

``--moe E,K,I`` makes every layer's MLP a Qwen3-MoE sparse block of ``E`` experts, top-``K``, expert width ``I``
(the experts' kernel, ``model/moe.py::GroupedSwiGlu``, runs its backward in both B and W there).

Usage::

    PYTHONPATH=src .venv/bin/python experiments/bench/zb_split_cost.py [--layers 4] [--seq 256] [--rounds 7]
        [--moe 32,4,128]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time
from statistics import median

import torch
import torch.nn.functional as F

from npu_train.model.llama import StageModule
from npu_train.model.presets import get_preset
from npu_train.pipeline.backward import backward_input


CLOCK = time.perf_counter  # --clock cpu: time.process_time (CPU seconds of the process; a busy shared host
#: stretches wall times by whatever else runs, not the CPU time of a 1-thread run)


def one(mode: str, mod: StageModule, x0: torch.Tensor, labels, g) -> tuple[float, float, float]:
    """(forward s, backward-part-1 s, backward-part-2 s) of one micro-batch; grads left in p.grad."""
    x = x0.detach().clone().requires_grad_(True)
    params = list(mod.parameters())
    t0 = CLOCK()
    out = mod(x)
    if labels is not None:
        out = F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), reduction="sum") / labels.numel()
    t1 = CLOCK()
    if mode == "full":
        out.backward(g)
        t2 = t3 = CLOCK()
    elif mode == "split":
        dx, work = backward_input(out, g, x, params)
        t2 = CLOCK()
        work.run()
        t3 = CLOCK()
    else:
        (dx,) = torch.autograd.grad(out, [x], g, retain_graph=True)
        t2 = CLOCK()
        dws = torch.autograd.grad(out, params, g)
        for p, dw in zip(params, dws):
            p.grad = dw if p.grad is None else p.grad + dw
        t3 = CLOCK()
    return t1 - t0, t2 - t1, t3 - t2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"), help="cpu: process CPU seconds")
    ap.add_argument("--modes", default="full,split,naive")
    ap.add_argument("--stages", default="middle,last", help="which stages to time")
    ap.add_argument("--moe", default=None, metavar="E,K,I", help="sparse MLPs: experts, top-k, expert width")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    torch.set_num_threads(a.threads)
    cfg = get_preset("smollm2-135m")
    if a.moe:
        e, k, i = (int(v) for v in a.moe.split(","))
        cfg = dataclasses.replace(cfg, family="qwen3_moe", num_experts=e, num_experts_per_tok=k,
                                  moe_intermediate_size=i, norm_topk_prob=True)
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {a.threads} thread(s); SmolLM2-135M shape{' MoE ' + a.moe if a.moe else ''}, "
          f"{a.layers} layers, "
          f"micro-batch {a.micro_batch} x {a.seq} tokens, fp32, median of {a.rounds} rounds, {a.clock} clock")
    torch.manual_seed(0)
    for head in [h for h, name in ((False, "middle"), (True, "last")) if name in a.stages.split(",")]:
        mod = StageModule(cfg, 0, a.layers, False, head)
        x0 = torch.randn(a.micro_batch, a.seq, cfg.hidden_size)
        labels = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq)) if head else None
        g = None if head else torch.randn(a.micro_batch, a.seq, cfg.hidden_size)
        times: dict[str, list] = {m: [] for m in a.modes.split(",")}
        grads = {}
        for r in range(a.rounds + 1):
            for m in times:
                mod.zero_grad(set_to_none=True)
                t = one(m, mod, x0, labels, g)
                if r:
                    times[m].append(t)
                grads[m] = [p.grad.clone() for p in mod.parameters()]
        err = max(float((s - f).norm() / f.norm()) for s, f in zip(grads["split"], grads["full"]))
        name = "last stage (layers + head + loss)" if head else "middle stage (layers)"
        print(f"\n{name}: max rel. diff of split vs full weight gradients {err:.1e}")
        full = median(sum(t) for t in times["full"])
        for m, ts in times.items():
            fwd, b1, b2 = (median(t[i] for t in ts) for i in range(3))
            tot = median(sum(t) for t in ts)
            parts = {"full": f"backward {b1 * 1e3:7.1f}",
                     "split": f"B {b1 * 1e3:7.1f}  W {b2 * 1e3:7.1f}",
                     "naive": f"dX {b1 * 1e3:7.1f}  2nd backward {b2 * 1e3:7.1f}"}[m]
            spread = (max(sum(t) for t in ts) - min(sum(t) for t in ts)) * 1e3
            print(f"  {m:5s}: fwd {fwd * 1e3:7.1f} ms  {parts} ms  total {tot * 1e3:7.1f} ms "
                  f"(spread {spread:.1f})  ratio to full {tot / full:.3f}")


if __name__ == "__main__":
    main()
