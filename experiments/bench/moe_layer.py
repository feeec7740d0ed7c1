"""One mixture-of-experts MLP block, forward + backward: npu-train's ``SparseMoe`` (tokens sorted by expert; the
experts' SwiGLUs in one ``GroupedSwiGlu`` node over the per-expert ``nn.Linear`` weights) against transformers'
own ``Qwen3MoeSparseMoeBlock`` with its default experts implementation (``grouped_mm``: stacked expert tensors,
``torch.nn.functional.grouped_mm``) and its ``eager`` one (a loop over the experts hit), same weights (ours are
views of transformers' stacked tensors: one copy in memory), inputs, dtype and threads, interleaved rounds.
Gradients are dropped after each timed call, so one block's are held at a time.

Prints the machine, the median seconds per forward + backward of each, the spread, and the ratios
``transformers / npu-train`` (> 1: npu-train faster); also of the process's CPU seconds, the run's own work on
a shared host at 1 thread (with more, OpenMP's spinning threads count too). Checks the outputs agree first.

    flock /tmp/bench.lock python experiments/bench/moe_layer.py [--quick] [--dtype bf16|fp32] [--threads N]
        [--hidden 2048 --experts 128 --top-k 8 --moe-intermediate 768 --tokens 1024] [--impls grouped_mm]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

from npu_train.model.config import LlamaConfig  # noqa: E402
from npu_train.model.moe import SparseMoe  # noqa: E402


def _hf_block(H, E, k, Ie, impl, dtype):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=H, intermediate_size=Ie, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, num_experts=E,
                         num_experts_per_tok=k, moe_intermediate_size=Ie, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM._from_config(cfg, experts_implementation=impl, dtype=dtype)
    return model.model.layers[0].mlp


def _share_weights(hf, ours: SparseMoe, others) -> None:
    """Random weights in transformers' stacked experts (gate rows then up rows in ``gate_up_proj``); ours are
    views of them (one copy of the weights in memory) and the other transformers blocks share its parameters."""
    with torch.no_grad():
        hf.gate.weight.normal_(0.0, 0.5)
        hf.experts.gate_up_proj.normal_(0.0, 0.02)
        hf.experts.down_proj.normal_(0.0, 0.02)
    gu, down = hf.experts.gate_up_proj.data, hf.experts.down_proj.data
    ours.gate.weight = torch.nn.Parameter(hf.gate.weight.data)
    for e, ex in enumerate(ours.experts):
        inter = gu.shape[1] // 2
        ex.gate_proj.weight = torch.nn.Parameter(gu[e, :inter])
        ex.up_proj.weight = torch.nn.Parameter(gu[e, inter:])
        ex.down_proj.weight = torch.nn.Parameter(down[e])
    for o in others:
        o.gate.weight, o.experts.gate_up_proj, o.experts.down_proj = (hf.gate.weight, hf.experts.gate_up_proj,
                                                                      hf.experts.down_proj)


class _Frozen(torch.nn.Module):
    """``block`` with its LoRA adapters disabled: the frozen experts alone (what LoRA adds is the difference)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from npu_train.model.lora import adapters_disabled

        with adapters_disabled(self.block):
            return self.block(x)


def _add_lora(ours: SparseMoe, hf, r: int, alpha: float) -> None:
    """Random rank-``r`` adapters (alpha ``alpha``) on every expert projection of ``ours`` (npu-train's per-expert
    ``LoraLinear``, base frozen), and the same adapters through peft 0.21 on transformers' stacked experts
    (``target_parameters``: ``ParamWrapper`` folds ``W + s B A`` per expert into the weight each forward), as peft
    converts npu-train's per-expert adapters: gate and up fused at rank ``2r``, alpha ``2 alpha`` (A stacked, B
    block-diagonal); down at rank ``2r`` too with the second half zero (one rank per peft config)."""
    from peft import LoraConfig, inject_adapter_in_model

    from npu_train.model.lora import LoraLinear, LoraSpec

    spec = LoraSpec(r=r, alpha=alpha)
    gen = torch.Generator().manual_seed(1)
    for p in list(ours.parameters()) + list(hf.parameters()):
        p.requires_grad_(False)
    for ex in ours.experts:
        for n in ex.names:
            lin = LoraLinear(getattr(ex, n), spec)
            with torch.no_grad():
                lin.lora_A.weight.copy_(torch.randn(lin.lora_A.weight.shape, generator=gen) * 0.02)
                lin.lora_B.weight.copy_(torch.randn(lin.lora_B.weight.shape, generator=gen) * 0.02)
            setattr(ex, n, lin)
    cfg = LoraConfig(r=2 * r, lora_alpha=2 * alpha, target_modules=[],
                     target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    inject_adapter_in_model(cfg, hf)
    E, inter = len(ours.experts), ours.experts[0].gate_proj.weight.shape[0]
    wraps = {m.parameter_name: m for m in hf.modules() if type(m).__name__ == "ParamWrapper"}
    with torch.no_grad():
        for name, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            w = wraps[name]
            A, B = w.lora_A["default"].weight, w.lora_B["default"].weight  # [2r E, in], [out, 2r E]
            A.zero_()
            B.zero_()
            for e, ex in enumerate(ours.experts):
                for q, pn in enumerate(projs):
                    lin = getattr(ex, pn)
                    rows = slice(q * inter, (q + 1) * inter) if len(projs) == 2 else slice(None)
                    A[e * 2 * r + q * r: e * 2 * r + (q + 1) * r] = lin.lora_A.weight  # expert e's ranks
                    for c in range(r):  # B's column of (rank c', expert e) is c' * E + e
                        B[rows, (q * r + c) * E + e] = lin.lora_B.weight[:, c]


def _fwd_bwd(block, x, g):
    x = x.detach().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    t0, c0 = time.perf_counter(), time.process_time()
    y = block(x)
    y.backward(g)
    t, c = time.perf_counter() - t0, time.process_time() - c0
    for p in block.parameters():
        p.grad = None  # one block's gradients in memory at a time
    return (t, c), y.detach()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run, not a result)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all usable cores)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per forward (micro-batch x sequence)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--impls", default="grouped_mm,eager",
                    help="transformers experts implementations to time, comma-separated (eager is ~5x slower)")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="rank-R adapters on every expert projection (base frozen): npu-train's against peft on "
                         "transformers' block, and npu-train's frozen path")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.quick:
        a.hidden, a.experts, a.top_k, a.moe_intermediate, a.tokens, a.rounds = 128, 8, 2, 64, 128, 1
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    H, E, k, Ie, N = a.hidden, a.experts, a.top_k, a.moe_intermediate, a.tokens
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=16, hidden_size=H, intermediate_size=Ie, num_layers=1, num_heads=4,
                      num_kv_heads=4, family="qwen3_moe", num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=Ie, norm_topk_prob=True)
    with torch.device("meta"):
        ours = SparseMoe(cfg, 0)
    hf = {impl: _hf_block(H, E, k, Ie, impl, dtype) for impl in a.impls.split(",")}
    first = next(iter(hf.values()))
    _share_weights(first, ours, [b for b in hf.values() if b is not first])
    blocks = {"npu-train": ours, **{f"transformers {impl}": b for impl, b in hf.items()}}
    if a.lora:
        _add_lora(ours, first, a.lora, 2.0 * a.lora)
        for b in hf.values():
            if b is not first:
                raise SystemExit("--lora: one transformers implementation (--impls grouped_mm)")
        blocks = {"npu-train": ours, f"transformers {next(iter(hf))} + peft": first, "npu-train frozen": _Frozen(ours)}
    x = torch.randn(1, N, H, dtype=dtype)
    g = torch.randn(1, N, H, dtype=dtype)
    outs = {n: _fwd_bwd(b, x, g)[1] for n, b in blocks.items()}  # warm-up + agreement
    ref_name = [n for n in blocks if n.startswith("transformers")][0]
    ref = outs[ref_name].float()
    agree = {n: float((o.float() - ref).abs().max() / ref.abs().max()) for n, o in outs.items()}
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    times: dict[str, list] = {n: [] for n in blocks}
    cpu: dict[str, list] = {n: [] for n in blocks}  # process CPU seconds (the run's own work at 1 thread)
    names = list(blocks)
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:  # rotated order per round
            (t, c), _ = _fwd_bwd(blocks[n], x, g)
            times[n].append(t)
            cpu[n].append(c)
    med = {n: statistics.median(t) for n, t in times.items()}
    med_cpu = {n: statistics.median(t) for n, t in cpu.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {torch.get_num_threads()} torch thread(s), {os.cpu_count()} logical CPUs, torch "
          f"{torch.__version__}, load average {load0:.2f} at the start of the timed rounds, {load:.2f} at the end")
    print(f"MoE block: hidden {H}, {E} experts, top-{k}, expert width {Ie}, {N} tokens, {a.dtype}, "
          f"{a.rounds} rounds" + (f", LoRA r {a.lora} on every expert projection" if a.lora else ""))
    for n in names:
        t = times[n]
        print(f"  {n:32s} {med[n] * 1e3:9.2f} ms  [{min(t) * 1e3:.2f}-{max(t) * 1e3:.2f}]  "
              f"CPU {med_cpu[n] * 1e3:9.2f} ms  output rel diff vs {ref_name} {agree[n]:.1e}")
    for n in names[1:]:
        print(f"ratio {n} / npu-train: {med[n] / med['npu-train']:.2f}x  (CPU seconds: "
              f"{med_cpu[n] / med_cpu['npu-train']:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "times_s": times, "median_s": med, "cpu_s": cpu, "median_cpu_s": med_cpu,
                       "agree": agree}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
