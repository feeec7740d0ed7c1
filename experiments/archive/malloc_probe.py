"""The last stage's step with and without ``npu_train.hostmem.keep_freed_memory``, both at once.

Two processes, each pinned to its own core and running 1 torch thread: the default model's last
stage (``--layers`` decoder layers + final norm + ``lm_head`` + loss, random weights, fp32) doing the
forward and the split backward (B, then the deferred W passes, as the ``zb*`` schedules) of
``--micro`` micro-batches of 1 x ``--seq-len`` tokens, ``--reps`` times. One process keeps freed host
memory (``keep``), the other has glibc's defaults (``default``); they run at the same time, as the
card processes of a pipeline do, and swap cores every round so that neither core's speed favours
one. Prints per round and process: median seconds per repetition (the first dropped), minor page
faults per repetition and max RSS; then the ratio ``keep / default`` per round. Not a benchmark of
the project against a baseline: a probe for the record ``experiments/2026-12-01-bench-run6.md``.

    .venv/bin/python experiments/archive/malloc_probe.py --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics as st
import subprocess
import sys
import time


def child(mode: str, core: int, args) -> None:
    if mode == "keep":
        from npu_train.hostmem import keep_freed_memory

        assert keep_freed_memory(), "not applied (glibc only; MALLOC_* set?)"
    import torch

    from npu_train.model import load_config, resolve_model_path
    from npu_train.model.llama import StageModule, causal_lm_loss_sum
    from npu_train.pipeline.backward import backward_input

    torch.set_num_threads(1)
    os.sched_setaffinity(0, {core})
    cfg = load_config(resolve_model_path("embedded"))
    L, S = cfg.num_layers, args.seq_len
    torch.manual_seed(0)
    m = StageModule(cfg, L - args.layers, L, False, True)
    params = list(m.parameters())
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731
    ts, fs = [], []
    for _ in range(args.reps):
        xs = [torch.randn(1, S, cfg.hidden_size, requires_grad=True) for _ in range(args.micro)]
        t0, f0, works = time.perf_counter(), faults(), []
        for x in xs:
            loss, _ = causal_lm_loss_sum(m(x), torch.randint(0, cfg.vocab_size, (1, S)))
            works.append(backward_input(loss, None, x, params)[1])
        for w in works:
            w.run()
        ts.append(time.perf_counter() - t0)
        fs.append(faults() - f0)
    print(json.dumps({"mode": mode, "core": core, "s": st.median(ts[1:]), "faults": st.median(fs[1:]),
                      "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "CORE"))
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args)
        return
    cores = sorted(os.sched_getaffinity(0))[:2]
    assert len(cores) == 2, "needs 2 cores"
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    print(f"machine: {os.cpu_count()} logical CPUs; cores {cores}")
    for r in range(args.rounds):
        modes = ("keep", "default") if r % 2 == 0 else ("default", "keep")
        procs = [subprocess.Popen([sys.executable, __file__, "--child", md, str(c), "--reps", str(args.reps),
                                   "--micro", str(args.micro), "--layers", str(args.layers),
                                   "--seq-len", str(args.seq_len)], stdout=subprocess.PIPE, text=True, env=env)
                 for md, c in zip(modes, cores)]
        res = {}
        for p in procs:
            out = json.loads(p.communicate()[0].strip().splitlines()[-1])
            res[out["mode"]] = out
            print(f"round {r}: {out['mode']:<8} core {out['core']}: {out['s'] * 1e3:7.0f} ms per repetition, "
                  f"{out['faults']:8.0f} minor faults, max RSS {out['maxrss_mb']} MB", flush=True)
        print(f"round {r}: keep / default = {res['keep']['s'] / res['default']['s']:.3f}", flush=True)


if __name__ == "__main__":
    main()
