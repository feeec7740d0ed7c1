"""How many decoder layers' time the last stage's lm_head + loss costs, in-process (issue 9, run 5).

One pinned process, 1 torch thread, fp32, the embedded SmolLM2-135M shapes with random weights,
one micro-batch of 1 x ``--seq-len`` tokens: forward + backward (gradients accumulating in ``.grad``
as in training) of (a) one decoder layer + final norm + ``lm_head`` + loss, (b) one decoder layer,
(c) four decoder layers; per round the medians over ``--reps`` repetitions (the first two dropped) and
``head = (a - b) / ((c - b) / 3)`` in layers. Then the planner's view: the head's FLOPs over a layer's
(``6 * tokens * V * H`` against ``6 * tokens * params_per_layer``, attention left out) divided by the
calibration profile's ``head_flops_ratio``. Not a benchmark of the project against a baseline: a
probe for the record ``experiments/2026-12-01-bench-run5.md``.

    .venv/bin/python experiments/archive/head_cost_probe.py --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import time

import torch

from npu_train.model import load_config, resolve_model_path
from npu_train.model.llama import StageModule, causal_lm_loss_sum


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--keep-host-memory", action="store_true",
                    help="keep freed host memory as the card processes do (npu_train.hostmem; run 6)")
    ap.add_argument("--profile", default=os.path.expanduser("~/.cache/npu-train/calibration/cpu.json"))
    args = ap.parse_args()
    if args.keep_host_memory:
        from npu_train.hostmem import keep_freed_memory

        assert keep_freed_memory(), "not applied (glibc only; MALLOC_* set?)"
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cfg = load_config(resolve_model_path("embedded"))
    S, L = args.seq_len, cfg.num_layers

    def make(a, b, last):
        torch.manual_seed(0)
        m = StageModule(cfg, a, b, False, last)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        return m

    def run(m, last):
        ts = []
        for _ in range(args.reps):
            x = torch.randn(1, S, cfg.hidden_size, requires_grad=True)
            t0 = time.perf_counter()
            out = m(x)
            if last:
                loss, _ = causal_lm_loss_sum(out, torch.randint(0, cfg.vocab_size, (1, S)))
                loss.backward()
            else:
                out.backward(torch.randn_like(out))
            ts.append(time.perf_counter() - t0)
        return st.median(ts[2:])

    with_head, one, four = make(L - 1, L, True), make(L - 2, L - 1, False), make(L - 5, L - 1, False)
    heads = []
    for r in range(args.rounds):
        a, b, c = run(with_head, True), run(one, False), run(four, False)
        heads.append((a - b) / ((c - b) / 3))
        print(f"round {r}: 1 layer + head {a * 1e3:.1f} ms, 1 layer {b * 1e3:.1f} ms, 4 layers {c * 1e3:.1f} ms "
              f"-> head = {heads[-1]:.2f} layers", flush=True)
    flop_ratio = (6.0 * S * cfg.embedding_params()) / (6.0 * S * cfg.params_per_layer())
    print(f"measured: head = {st.median(heads):.2f} layers (median of {args.rounds} rounds)")
    print(f"FLOPs: head / layer = {flop_ratio:.2f}")
    if os.path.isfile(args.profile):
        ratio = json.load(open(args.profile))["rates"]["head_flops_ratio"]
        print(f"planner: head = {flop_ratio / ratio:.2f} layers (head_flops_ratio {ratio:.3f} from {args.profile})")


if __name__ == "__main__":
    main()
