#!/usr/bin/env python
"""Heap holes of one stage in one process under a cpu card's glibc settings (issue 43).

``python experiments/bench/heap_holes.py --layers 15 --pattern k1 --mode lora [--seq-len 256] [--steps 3] [--trace]``

Builds ``--layers`` decoder layers of the SmolLM2-135M shape (fp32, no embedding or head), sets the card's malloc
settings (``hostmem.keep_freed_memory``: blocks < 1 GiB from the heap, trim past 2 GiB), returns what the build
freed (``release_freed_memory``) and runs forward/backward passes of micro-batches ``[2, S, H]`` in the order
``--pattern`` names (``k1``: ``F0 B0 F1 B1 ...``, one micro-batch at a time; ``k2``: two in flight, 1F1B; ``k4``:
four, GPipe), ``.grad`` set to None after every step as the trainer does. glibc's ``mallinfo2`` and the process's
anonymous RSS (``/proc/self/statm``) are sampled at every module's forward and every saved tensor's pack/unpack;
per step it prints the peak growth of the live bytes (``uordblks + hblkhd``) and of the RSS over the state before
the first step, and their difference: the freed memory the heap keeps resident (holes). ``--trace``: the arena,
live and free bytes after every action.

``--guard-cap G`` (GiB; ``--guard-cap layers`` = one micro-batch's activations of the stage, as the plan's
``MemoryModel.heap_cap``; ``--slack``: a full check only after one layer's activations of RSS growth, as a card's): a :class:`~npu_train.hostmem.HeapGuard` with that cap checks before every layer's
forward and after its backward, as a card's does; it prints the largest holes seen at any sample (``guard holes``,
what can stand between two checks beyond the cap) and the guard's checks, trims and seconds. ``--shape`` picks
the layer shape (a preset name).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os

G = 2**30
PATTERNS = {"k1": "F0 B0 F1 B1 F2 B2 F3 B3", "k2": "F0 F1 B0 F2 B1 F3 B2 B3", "k4": "F0 F1 F2 F3 B0 B1 B2 B3"}


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=15)
    ap.add_argument("--pattern", choices=sorted(PATTERNS), default="k1")
    ap.add_argument("--mode", choices=("lora", "full"), default="lora")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--guard-cap", default=None)
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--slack", action="store_true", help="the guard's slack: one layer's activations (as a card's)")
    ap.add_argument("--micro-batch", type=int, default=2)
    a = ap.parse_args()

    from npu_train.hostmem import HeapGuard, keep_freed_memory, release_freed_memory
    keep_freed_memory()
    import torch
    import torch.autograd.graph as graph

    from npu_train.model.llama import StageModule
    from npu_train.model.lora import LoraSpec, apply_lora
    from npu_train.model.presets import get_preset

    torch.set_num_threads(1)
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = MallInfo2
    page = os.sysconf("SC_PAGE_SIZE")
    cfg = dataclasses.replace(get_preset(a.shape), num_layers=a.layers)
    m = StageModule(cfg, 0, a.layers, False, False)
    if a.mode == "lora":
        apply_lora(m, LoraSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj")), 0)
        for name, p in m.named_parameters():
            p.requires_grad_("lora" in name)
    release_freed_memory()

    def anon() -> int:
        with open("/proc/self/statm") as f:
            v = f.read().split()
        return (int(v[1]) - int(v[2])) * page

    def live() -> int:
        d = mallinfo2()
        return d.uordblks + d.hblkhd

    guard = None
    if a.guard_cap is not None:
        from npu_train.planner.memory import activation_bytes_per_layer
        from npu_train.planner.spec import RunShape

        per_layer = activation_bytes_per_layer(cfg, RunShape(seq_len=a.seq_len, micro_batch=a.micro_batch, dtype="fp32",
                                                             lora_params_per_layer=1 if a.mode == "lora" else 0), "sdpa")
        cap = a.layers * per_layer if a.guard_cap == "layers" else int(float(a.guard_cap) * G)
        guard = HeapGuard.create(cap, per_layer if a.slack else 0)
        m.layer_check = guard.check
        print(f"guard cap {cap / G:.3f} GiB; one layer's activations (plan, sdpa) {per_layer / G:.4f} GiB", flush=True)
    base_live, base_rss = live(), anon()
    peak = {"live": 0, "rss": 0, "guard": 0}

    def sample(*_):
        peak["live"] = max(peak["live"], live() - base_live)
        peak["rss"] = max(peak["rss"], anon() - base_rss)
        if guard is not None:
            peak["guard"] = max(peak["guard"], guard.holes())

    for mod in m.modules():
        mod.register_forward_hook(sample)

    def pack(t):
        sample()
        return t

    def unpack(t):
        sample()
        return t

    for step in range(a.steps):
        ys = {}
        for act in PATTERNS[a.pattern].split():
            j = int(act[1:])
            if act[0] == "F":
                x = torch.randn(a.micro_batch, a.seq_len, cfg.hidden_size, requires_grad=True)
                with graph.saved_tensors_hooks(pack, unpack):
                    ys[j] = m(x)
            else:
                y = ys.pop(j)
                torch.autograd.backward(y, torch.randn_like(y))
            sample()
            if a.trace:
                d = mallinfo2()
                print(f"  {step} {act}: arena {d.arena / G:.3f} live {(d.uordblks + d.hblkhd) / G:.3f} "
                      f"free {d.fordblks / G:.3f} top {d.keepcost / G:.3f}", flush=True)
        for p in m.parameters():
            p.grad = None
        print(f"{a.pattern} {a.mode} layers={a.layers} S={a.seq_len} step {step}: live +{peak['live'] / G:.3f} GiB, "
              f"RSS +{peak['rss'] / G:.3f} GiB, holes {(peak['rss'] - peak['live']) / G:.3f} GiB"
              + ("" if guard is None else f", guard holes {peak['guard'] / G:.3f} GiB; {guard.summary()}"), flush=True)


if __name__ == "__main__":
    main()
