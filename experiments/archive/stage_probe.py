"""One pipeline stage's schedule in-process, per action, against the same stage inside the pipeline.

Runs the real :class:`~npu_train.pipeline.stage.StageRunner` of one stage (``--stage`` of ``--split``,
the embedded SmolLM2-135M shapes with random weights, fp32, 1 torch thread, pinned to ``--core``) for
``--steps`` optimizer steps of ``--M`` micro-batches of 1 x ``--seq-len`` tokens under ``--schedule``,
with a boundary transport that never waits (received tensors are made up front, sends are dropped),
and prints the per-action means of steps 2..N from :attr:`StageRunner.trace` (``runtime.trace``'s
recording): what the stage costs with nobody else on its core and no neighbour to wait for. Start
two at once (``--stage 0 --core 0 &`` and ``--stage 1 --core 1``) to add the other core's load.
Compare with ``trace.json`` of a launch with ``runtime.trace=true`` (record
``experiments/2026-12-01-bench-run7.md``). A probe, not a benchmark.

    .venv/bin/python experiments/archive/stage_probe.py --split 19 11 --stage 1 --core 1
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics as st
import time

import torch

from npu_train.hostmem import keep_freed_memory
from npu_train.model import load_config, resolve_model_path
from npu_train.model.llama import StageModule
from npu_train.pipeline.stage import StageRunner


class _FreeComm:
    """A BoundaryComm whose receives return ready-made tensors and whose sends do nothing."""

    def __init__(self, shape):
        self.act = torch.randn(shape)
        self.grad = torch.randn(shape) * 1e-3

    def recv_act(self, step, micro):
        return self.act.clone()

    def recv_grad(self, step, micro):
        return self.grad.clone()

    def send_act(self, step, micro, t):
        pass

    def send_grad(self, step, micro, t):
        pass


class _Cpu:
    def upload(self, t):
        return t

    def synchronize(self):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", type=int, nargs="+", default=[19, 11])
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--schedule", default="zb-h2")
    ap.add_argument("--M", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--core", type=int, default=None)
    args = ap.parse_args()
    keep_freed_memory()  # as the card processes
    torch.set_num_threads(1)
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    cfg = load_config(resolve_model_path("embedded"))
    P, s = len(args.split), args.stage
    a = sum(args.split[:s])
    b = a + args.split[s]
    torch.manual_seed(0)
    m = StageModule(cfg, a, b, s == 0, s == P - 1)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    S = args.seq_len
    runner = StageRunner(m, _Cpu(), P, s, args.schedule, _FreeComm((1, S, cfg.hidden_size)))
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, cfg.vocab_size, (1, S), generator=g) for _ in range(args.M)]
    ys = [torch.randint(0, cfg.vocab_size, (1, S), generator=g) for _ in range(args.M)]
    per_kind = collections.defaultdict(list)
    totals = []
    for step in range(args.steps):
        for p in m.parameters():
            p.grad = None
        runner.trace = []
        t0 = time.perf_counter()
        if s == 0 or s == P - 1:
            runner.run_step(step, xs if s == 0 else None, ys if s == P - 1 else None)
        else:
            runner.run_middle(step, args.M)
        totals.append(time.perf_counter() - t0)
        if step > 0:
            for kind, _, t_start, t_ready, t_done, t_end in runner.trace:
                per_kind[kind].append(t_done - t_ready)
    means = {k: st.mean(v) * 1e3 for k, v in per_kind.items()}
    print(f"stage {s} of split {args.split} ({args.split[s]} layers{' + head' if s == P - 1 else ''}), "
          f"{args.schedule}, M={args.M}, seq {S}, core {args.core}: step {st.median(totals[1:]):.3f} s; per action ms "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(means.items())), flush=True)


if __name__ == "__main__":
    main()
