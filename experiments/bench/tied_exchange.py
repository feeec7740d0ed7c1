#!/usr/bin/env python
"""The tied embedding's gradient sum between the first and last stage: the all-reduce after the
drain (the project until 2026-11-30) vs :class:`npu_train.runtime.tied.TiedGradExchange` (dense
last -> first during the drain, the looked-up rows back).

Two processes, each pinned to its own core, gloo, one torch thread each: rank 0 is the first stage,
rank 1 the last. Per trial both start together (barrier); the last stage's backward has ended, the
first stage still runs its drain: ``--drain`` seconds of matmuls (one layer's backward is ~0.2-0.6 s
on the 2-core VM for SmolLM2 at seq 128). Then both sum the ``[V, H]`` fp32 gradient
(``--vocab`` x ``--hidden``, SmolLM2-135M's 49152 x 576 = 113 MB by default); the first stage's
gradient is non-zero only on the rows of ``--tokens`` random token ids (M x S of a step, 8 x 128).

Figures per method (median of ``--trials`` after one warm-up, then median [min-max] over
``--rounds`` rounds, methods interleaved in rotated order): ``drain s`` (the first stage's drain,
slowed if the transfer competes for its core), ``exposed s`` (from the drain's end to the end of the
sum on the first stage: what the step's critical path pays after the backward) and ``total s`` =
drain + exposed; ratio of total to the all-reduce's in the same round. Both methods' results are
checked equal (bit for bit) to ``g_first + g_last``.

Usage::

    .venv/bin/python experiments/bench/tied_exchange.py [--rounds 5] [--trials 5] [--drain 0.5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))
sys.path.insert(0, str(HERE))

from _common import core_for, free_port, machine_info, print_machine, spread, write_json  # noqa: E402

METHODS = ("allreduce", "exchange")


class _Host:
    """The cpu backend's copy semantics (download / upload never alias)."""

    def download(self, t):
        return t.detach().clone()

    def upload(self, t):
        return t.detach().clone()


def _fixed_drain(n: int, a, b) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        a @ b
    return time.perf_counter() - t0


def worker(rank: int, port: int, args: dict, q) -> None:
    os.sched_setaffinity(0, {core_for(rank)})
    import torch
    import torch.distributed as dist

    from npu_train.runtime.tied import TiedGradExchange, looked_up_rows

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    V, H = args["vocab"], args["hidden"]
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, V, (1, args["tokens"]), generator=gen)]
    rows = looked_up_rows(ids)
    g_first = torch.zeros(V, H)
    g_first[rows] = torch.randn(len(rows), H, generator=gen)
    g_last = torch.randn(V, H, generator=gen)
    want = g_first + g_last
    mine = g_first if rank == 0 else g_last
    ex = TiedGradExchange(rank == 0, 1 - rank, group, (V, H), _Host())
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    # the drain as a fixed amount of work (so a slowed drain shows as more seconds)
    for _ in range(50):  # warm-up
        a @ b
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        a @ b
        n += 1
    per_call = 0.2 / n
    calls = max(1, int(args["drain"] / per_call))
    out = {m: [] for m in METHODS}
    order = list(METHODS)
    for rnd in range(args["rounds"]):
        order = order[1:] + order[:1]
        for m in order:
            drains, exposed = [], []
            for trial in range(args["trials"] + 1):
                g = mine.clone()
                if m == "exchange":
                    ex.begin()
                dist.barrier(group=group)
                d = 0.0
                if rank == 1 and m == "exchange":
                    ex.send_dense(g)
                if rank == 0:
                    d = _fixed_drain(calls, a, b)
                t1 = time.perf_counter()
                if m == "allreduce":  # what the trainer did: download, fp32 all-reduce, upload
                    gh = g.clone().float()
                    dist.all_reduce(gh, group=group)
                    g.copy_(gh.clone())
                else:
                    ex.finish(g, rows)
                e = time.perf_counter() - t1
                if not torch.equal(g, want):
                    raise AssertionError(f"{m}: rank {rank} result differs from g_first + g_last")
                if trial:
                    drains.append(d)
                    exposed.append(e)
            if rank == 0:
                out[m].append({"drain": median(drains), "exposed": median(exposed),
                               "total": median([x + y for x, y in zip(drains, exposed)])})
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--drain", type=float, default=0.5, help="seconds of the first stage's drain")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--tokens", type=int, default=1024, help="token ids looked up in the step (M x S)")
    ap.add_argument("--json", default=None)
    args = vars(ap.parse_args())
    info = machine_info()
    print_machine(info)
    print(f"[V, H] = [{args['vocab']}, {args['hidden']}] fp32 ({args['vocab'] * args['hidden'] * 4 / 1e6:.0f} MB), "
          f"{args['tokens']} token ids, drain {args['drain']} s, {args['rounds']} rounds x {args['trials']} trials",
          flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker, args=(r, port, args, q)) for r in (0, 1)]
    for p in ps:
        p.start()
    out = q.get(timeout=1800)
    for p in ps:
        p.join(60)
    res = {m: {k: spread([r[k] for r in out[m]]) for k in ("drain", "exposed", "total")} for m in METHODS}
    ratios = spread([e["total"] / a["total"] for a, e in zip(out["allreduce"], out["exchange"])])
    print(f"{'method':<10} {'drain s':>22} {'exposed s':>22} {'total s':>22}")
    for m in METHODS:
        cells = [f"{res[m][k]['median']:.3f} [{res[m][k]['min']:.3f}-{res[m][k]['max']:.3f}]"
                 for k in ("drain", "exposed", "total")]
        print(f"{m:<10} " + " ".join(f"{c:>22}" for c in cells))
    print(f"exchange total / allreduce total: {ratios['median']:.3f} [{ratios['min']:.3f}-{ratios['max']:.3f}] "
          f"(per round); results equal to g_first + g_last bit for bit: yes")
    write_json(args["json"], {"machine": info, "args": args, "rounds": out, "summary": res, "ratio": ratios})


if __name__ == "__main__":
    main()
