#!/usr/bin/env python
"""The heap guard's cost in step time: the same stage with and without a cpu card's guard, one process, rounds
interleaved (issue 43).

``flock /tmp/bench.lock python experiments/bench/heap_guard_cost.py [--layers 20] [--mode full] [--seq-len 128]
[--rounds 8] [--steps 2]``

Builds ``--layers`` decoder layers of the SmolLM2-135M shape (fp32; the default job's first card holds 20) under the
card's malloc settings (``hostmem.keep_freed_memory``) and runs optimizer-free training steps of ``--accum``
micro-batches ``[--micro-batch, S, H]`` in 1F1B order with two in flight (``F0 F1 B0 F2 B1 F3 B2 B3``), ``.grad``
set to None after each step as the trainer does. Each round runs ``--steps`` steps in each of three settings, the
order rotated every round (so no setting always runs first or after the same one):

- ``off``: no guard;
- ``below``: the guard a card arms (``HeapGuard.create``: cap = the layers' activations of one micro-batch, slack =
  half a layer's, as ``MemoryModel.heap_cap`` / ``heap_slack``) with its limit above the RSS (the plan's other
  terms + cap, not reached): every check is one ``/proc/self/statm`` read, what a card does in every run that
  stays within its plan;
- ``at``: the same guard with limit 0 (always past it): full checks (``mallinfo2``) at every slack of growth and a
  trim whenever the holes pass the cap, what a card does near its plan's total.

The checks are installed where the trainer installs them (``StageTrainer._heap_guard``): before each layer's forward
and after its backward (``StageModule.layer_check``), after each parameter's gradient accumulation
(``register_post_accumulate_grad_hook``), and at each action's start (as ``pipeline.stage``). Prints each
setting's median step time and the ratios ``below / off`` and ``at / off`` over the same rounds, and the
guard's own count of checks, full checks, trims and seconds. Timings from a shared machine are noisy: compare only
the ratios of one run.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

G = 2**30


def build(a):
    """``(module, cfg, one layer's activations in bytes)``: the stage, its parameters trained (full) or adapters."""
    import torch  # noqa: F401

    from npu_train.model.llama import StageModule
    from npu_train.model.lora import LoraSpec, apply_lora
    from npu_train.model.presets import get_preset
    from npu_train.planner.memory import activation_bytes_per_layer
    from npu_train.planner.spec import RunShape

    cfg = dataclasses.replace(get_preset(a.shape), num_layers=a.layers)
    m = StageModule(cfg, 0, a.layers, False, False)
    if a.mode == "lora":
        apply_lora(m, LoraSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj")), 0)
        for name, p in m.named_parameters():
            p.requires_grad_("lora" in name)
    per_layer = activation_bytes_per_layer(cfg, RunShape(seq_len=a.seq_len, micro_batch=a.micro_batch, dtype="fp32",
                                                         lora_params_per_layer=1 if a.mode == "lora" else 0), "sdpa")
    return m, cfg, per_layer


def install(m, guard):
    """The trainer's checks on ``m`` for ``guard``; returns the hook handles (to remove)."""
    m.layer_check = guard.check
    return [p.register_post_accumulate_grad_hook(guard.check) for p in m.parameters() if p.requires_grad]


def step(m, cfg, a, check) -> None:
    """One step: ``--accum`` micro-batches in 1F1B order (two in flight), ``check`` at each action's start."""
    import torch

    order = ["F0", "F1"] + [x for j in range(2, a.accum) for x in (f"B{j - 2}", f"F{j}")] + \
        [f"B{a.accum - 2}", f"B{a.accum - 1}"]
    ys = {}
    for act in order:
        if check is not None:
            check()
        j = int(act[1:])
        if act[0] == "F":
            x = torch.randn(a.micro_batch, a.seq_len, cfg.hidden_size, requires_grad=True)
            ys[j] = m(x)
        else:
            y = ys.pop(j)
            torch.autograd.backward(y, torch.randn_like(y))
    for p in m.parameters():
        p.grad = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--mode", choices=("lora", "full"), default="full")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shape", default="smollm2-135m")
    a = ap.parse_args()

    from npu_train.hostmem import HeapGuard, keep_freed_memory, release_freed_memory

    keep_freed_memory()
    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    m, cfg, per_layer = build(a)
    release_freed_memory()
    cap, slack = a.layers * per_layer, per_layer // 2
    guards = {"below": HeapGuard.create(cap, slack, limit_bytes=1 << 50), "at": HeapGuard.create(cap, slack, 0)}
    step(m, cfg, a, None)  # warm-up: the heap's first growth, the kernels' first calls
    times: dict = {k: [] for k in ("off", "below", "at")}
    names = list(times)
    for r in range(a.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            g = guards.get(name)
            handles = install(m, g) if g is not None else []
            if g is None:
                m.layer_check = None
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step(m, cfg, a, None if g is None else g.check)
            times[name].append((time.perf_counter() - t0) / a.steps)
            for h in handles:
                h.remove()
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{a.shape} {a.mode} layers={a.layers} S={a.seq_len} b={a.micro_batch} accum={a.accum}, {a.rounds} rounds "
          f"x {a.steps} steps, threads {a.threads}; cap {cap / G:.3f} GiB, slack {slack / G:.4f} GiB")
    print("median step: " + ", ".join(f"{k} {v:.3f} s" for k, v in med.items()))
    print(f"ratio below / off {med['below'] / med['off']:.4f}, at / off {med['at'] / med['off']:.4f} "
          f"(per round: below {min(b / o for b, o in zip(times['below'], times['off'])):.3f}-"
          f"{max(b / o for b, o in zip(times['below'], times['off'])):.3f}, at "
          f"{min(b / o for b, o in zip(times['at'], times['off'])):.3f}-"
          f"{max(b / o for b, o in zip(times['at'], times['off'])):.3f})")
    for k, g in guards.items():
        print(f"{k}: {g.checks} checks, {g.full} full, {g.trims} trims ({g.released / G:.2f} GiB), {g.seconds:.2f} s "
              f"in checks ({g.seconds / max(1, g.checks) * 1e3:.3f} ms each)")


if __name__ == "__main__":
    main()
