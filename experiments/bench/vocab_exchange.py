#!/usr/bin/env python
"""Vocabulary parallelism's exchange between P card processes of one host: shared memory
(``runtime.vocab_exchange=shm``, ``npu_train.pipeline.vocabshm.ShmExchange``) against gloo over TCP loopback
(``GlooExchange``, the default), in the same run, on the same processes.

Per round and method, the two ``[b, S, H]`` tensors of one ``V(m)`` (``--mib`` MiB each, bf16, as the compute dtype
sends them) and its statistics:

- ``x``: the hidden state from the head (card P-1) until every card has it (broadcast_async + wait; shm: the head
  writes it into its slot once and every card computes on the slot, as ``VocabWork`` does: ``view()``);
- ``dx``: every card's partial input gradient until the head holds their sum (reduce_sum_async + the head's
  wait; shm: each card writes its slot, the head sums the P slots);
- ``stats``: the ``[P, N, 3]`` fp32 statistics all-reduce (gloo in both: the same call).

Each timing starts after a barrier and ends when the slowest card is done (an all-reduce MAX of the cards'
seconds); reported per method: the median over ``--reps`` after ``--warmup`` reps, per round, then the median and
[min-max] over rounds; GB/s = tensor bytes / seconds (GB = 1e9 B; the planner's ``vocab_latency`` divides the same
bytes by the rate), and shm / gloo of each round.

Usage (the bench lock: one benchmark at a time on the shared host)::

    flock /tmp/bench.lock .venv/bin/python experiments/bench/vocab_exchange.py --P 2 4 --mib 16 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))


def _card(rank, P, init, q, job, nbytes, reps, warmup):
    import torch
    import torch.distributed as dist

    from npu_train.pipeline.vocab import GlooExchange
    from npu_train.pipeline.vocabshm import ShmExchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=P)
    head = P - 1
    H = 4096
    N = nbytes // (2 * H)
    g, gx = dist.new_group(list(range(P))), dist.new_group(list(range(P)))
    exs = {"gloo": GlooExchange(g, head, xgroup=gx),
           "shm": ShmExchange(g, head, gx, job, "vx0", nbytes, 1)}
    x = torch.randn(1, N, H).to(torch.bfloat16)
    st = torch.zeros(P, N, 3)
    out = {}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt)

    for how, ex in exs.items():
        def bcast():  # as VocabWork receives it: shm, the head's slot itself (view); gloo, into the buffer
            t = x.clone() if rank == head else torch.empty_like(x)
            h = ex.broadcast_async(t)
            h.view() if hasattr(h, "view") else h.wait()

        def reduce():
            t = x.clone()
            ex.reduce_sum_async(t).wait()

        def stats():
            ex.all_reduce_sum(st)

        for name, fn in (("x", bcast), ("dx", reduce), ("stats", stats)):
            ts = [timed(fn) for _ in range(warmup + reps)][warmup:]
            out[(how, name)] = statistics.median(ts)
    dist.barrier()
    exs["shm"].close()
    q.put((rank, {f"{a}/{b}": v for (a, b), v in out.items()}))
    dist.destroy_process_group()


def one_round(P, mib, reps, warmup):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = "bench" + secrets.token_hex(3)
    d = tempfile.mkdtemp(prefix="npt-vx-")
    ps = [ctx.Process(target=_card, args=(r, P, f"file://{d}/rdv", q, job, mib << 20, reps, warmup))
          for r in range(P)]
    for p in ps:
        p.start()
    try:
        res = dict(q.get(timeout=600) for _ in ps)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        from npu_train.transport.shm import unlink_job_segments

        unlink_job_segments(job)
    return res[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, nargs="+", default=[16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"# host: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}", flush=True)
    rows = []
    for P in a.P:
        for mib in a.mib:
            rounds = [one_round(P, mib, a.reps, a.warmup) for _ in range(a.rounds)]
            nbytes = mib << 20
            for name in ("x", "dx", "stats"):
                def rate(r, how):
                    b = nbytes if name != "stats" else 12 * P * (nbytes // (2 * 4096))
                    return b / r[f"{how}/{name}"] / 1e9
                g = [rate(r, "gloo") for r in rounds]
                s = [rate(r, "shm") for r in rounds]
                ratio = [si / gi for si, gi in zip(s, g)]
                row = dict(P=P, mib=mib, tensor=name, gloo=g, shm=s, ratio=ratio,
                           gloo_ms=[r[f"gloo/{name}"] * 1e3 for r in rounds],
                           shm_ms=[r[f"shm/{name}"] * 1e3 for r in rounds])
                rows.append(row)
                med = statistics.median
                print(f"P={P} {mib:3d} MiB {name:5s}  gloo {med(g):6.2f} GB/s [{min(g):.2f}-{max(g):.2f}] "
                      f"{med(row['gloo_ms']):7.2f} ms   shm {med(s):6.2f} GB/s [{min(s):.2f}-{max(s):.2f}] "
                      f"{med(row['shm_ms']):7.2f} ms   shm/gloo {med(ratio):5.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]",
                      flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
