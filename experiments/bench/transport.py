#!/usr/bin/env python
"""Stage hand-off between two processes: npu-train's shm + ZeroMQ transport vs gloo send/recv.

Two processes (rank 0 and rank 1, each pinned to its own core before ``import torch``; round-robin
when there is one core) hold, at once, everything compared:

- ``shm``: the project's boundary link (``npu_train.transport``: a ``TensorLink`` in ``shm`` mode
  per direction, ``Mailbox``/``Outbox`` over ZeroMQ ``ipc://`` for headers and slot credits), as a
  card process uses it: ``link.send`` writes the tensor into a shared-memory slot and sends a
  header; ``link.recv`` copies it out into a fresh tensor and returns the slot credit;
- ``zmq-inline``: the same link in ``inline`` mode (data as a ZeroMQ frame; what multi-node uses);
- ``gloo``: ``torch.distributed.send/recv`` into a preallocated tensor over a gloo group between
  the same two processes (what ``torch.distributed.pipelining`` uses on CPU);
- ``copy``: ``dst.copy_(src)`` inside rank 0 (the ceiling: one memory copy, no second process).

Bandwidth: a ping-pong of an fp32 tensor of each size (64 KiB ... 64 MiB in steps of 4x); the
hand-off time is half the round trip, GB/s = bytes / hand-off time (GB = 1e9 bytes, KiB/MiB =
2**10/2**20 bytes). Latency: ping-pong of small messages, half the round trip in µs: a 0-byte and
a 64-byte ZeroMQ message (``Outbox.send``/``Mailbox.recv``, the project's control path), the
64-byte tensor through the shm link, and a 64-byte (16 x fp32) and 1-element tensor through gloo.

Each figure is the median of ``--reps`` ping-pongs (after warm-up) in one round; rounds repeat
all methods in a rotated order; reported: median over rounds, [min-max] over rounds, and the
ratio to gloo measured in the same run.

Usage::

    .venv/bin/python experiments/bench/transport.py --quick
    .venv/bin/python experiments/bench/transport.py --rounds 5 --json transport.json
"""
from __future__ import annotations

import sys

if __name__ == "__main__" and "--worker" in sys.argv:  # pin before torch starts threads
    import json as _json
    import os as _os

    _cfg = _json.load(open(sys.argv[sys.argv.index("--worker") + 1]))
    _rank = int(sys.argv[sys.argv.index("--rank") + 1])
    if _cfg["pin"]:
        _os.sched_setaffinity(0, {int(_cfg["cores"][_rank])})

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(HERE))

from _common import core_for, free_port, machine_info, print_machine, spread, usable_cores, write_json  # noqa: E402

KIB, MIB = 2 ** 10, 2 ** 20
SIZES = [64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB]
BULK = ("shm", "zmq-inline", "gloo", "copy")
SMALL = ("zmq 0 B", "zmq 64 B", "shm link 64 B", "gloo 64 B", "gloo 4 B (1 elem)")


def reps_for(nbytes: int, reps: int) -> int:
    """Fewer ping-pongs for large tensors: ``reps`` up to 1 MiB, then down to at least 5."""
    return max(5, min(reps, int(reps * MIB / max(nbytes, 1))))


def worker(cfg_path: str, rank: int) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import zmq

    from npu_train.transport import Endpoint, Mailbox, Outbox, TensorLink, unlink_job_segments

    cfg = json.load(open(cfg_path))
    torch.set_num_threads(1)
    peer = 1 - rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    ctx = zmq.Context()
    token, job = cfg["token"], cfg["job_id"]
    inbox = Mailbox(ctx, Endpoint.ipc(cfg["ipc_dir"], rank), token)
    out = Outbox(ctx, Endpoint.ipc(cfg["ipc_dir"], peer), token, src_rank=rank)
    slot = max(cfg["sizes"] + [64])
    links = {}
    for mode in ("shm", "inline"):
        tx = TensorLink(mode, job, f"{mode}.r{rank}to{peer}", slot, 2).open_sender()
        rx = TensorLink(mode, job, f"{mode}.r{peer}to{rank}", slot, 2)
        links[mode] = (tx, rx)
    dist.barrier()
    seq = [0]

    def pingpong_link(mode, x, n):
        tx, rx = links[mode]
        ts = []
        for _ in range(n):
            seq[0] += 1
            s = seq[0]
            t0 = time.perf_counter()
            if rank == 0:
                tx.send(x, "t", s, 0, out, inbox, timeout_s=120)
                rx.recv("t", s, 1, inbox, out, timeout_s=120)
            else:
                y = rx.recv("t", s, 0, inbox, out, timeout_s=120)
                tx.send(y, "t", s, 1, out, inbox, timeout_s=120)
            ts.append((time.perf_counter() - t0) / 2)
        return ts

    def pingpong_gloo(x, buf, n):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            ts.append((time.perf_counter() - t0) / 2)
        return ts

    def pingpong_zmq(payload, n):
        ts = []
        for _ in range(n):
            seq[0] += 1
            s = seq[0]
            t0 = time.perf_counter()
            if rank == 0:
                out.send("p", s, 0, payload=payload)
                inbox.recv("p", s, 1, 120)
            else:
                _, pl = inbox.recv("p", s, 0, 120)
                out.send("p", s, 1, payload=pl)
            ts.append((time.perf_counter() - t0) / 2)
        return ts

    def measure(method, nbytes, n, warm):
        x = torch.randn(max(1, nbytes // 4))
        buf = torch.empty_like(x)
        if method in ("shm", "shm link 64 B"):
            f = lambda k: pingpong_link("shm", x, k)  # noqa: E731
        elif method == "zmq-inline":
            f = lambda k: pingpong_link("inline", x, k)  # noqa: E731
        elif method.startswith("gloo"):
            f = lambda k: pingpong_gloo(x, buf, k)  # noqa: E731
        elif method.startswith("zmq"):
            pl = b"" if method == "zmq 0 B" else bytes(64)
            f = lambda k: pingpong_zmq(pl or None, k)  # noqa: E731
        elif method == "copy":
            def f(k):
                ts = []
                if rank == 0:
                    for _ in range(k):
                        t0 = time.perf_counter()
                        buf.copy_(x)
                        ts.append(time.perf_counter() - t0)
                return ts
        f(warm)
        dist.barrier()
        ts = f(n)
        dist.barrier()
        return spread(ts)["median"] if ts else None

    res = []
    try:
        for rnd in range(cfg["rounds"]):
            for i, size in enumerate(cfg["sizes"]):
                k = (rnd + i) % len(BULK)
                for m in BULK[k:] + BULK[:k]:
                    t = measure(m, size, reps_for(size, cfg["reps"]), 2)
                    res.append({"round": rnd, "kind": "bulk", "method": m, "bytes": size, "s": t})
            k = rnd % len(SMALL)
            for m in SMALL[k:] + SMALL[:k]:
                nb = 0 if m == "zmq 0 B" else (4 if "1 elem" in m else 64)
                t = measure(m, nb, cfg["small_reps"], 20)
                res.append({"round": rnd, "kind": "small", "method": m, "bytes": nb, "s": t})
            if rank == 0:
                print(f"  round {rnd + 1}/{cfg['rounds']} done", flush=True)
    finally:
        for tx, rx in links.values():
            tx.close()
            rx.close()
        inbox.close()
        out.close()
        ctx.destroy(linger=0)
        if rank == 0:
            unlink_job_segments(job)
    if rank == 0:
        with open(cfg["out"], "w") as fh:
            json.dump(res, fh)
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="tensor sizes in bytes")
    ap.add_argument("--reps", type=int, default=50, help="ping-pongs per size up to 1 MiB (fewer above)")
    ap.add_argument("--small-reps", type=int, default=2000)
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, 64 KiB and 1 MiB, few reps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.small_reps = 1, 5, 50
        if args.sizes == SIZES:
            args.sizes = [64 * KIB, MIB]
    from npu_train.transport import new_token

    cores = usable_cores()
    info = machine_info()
    print_machine(info)
    pin = [core_for(r, cores) for r in range(2)]
    if len(cores) < 2 and not args.no_pin:
        print(f"note: one usable core: both processes pinned to core {pin[0]}", flush=True)
    print(f"two processes pinned to cores {pin}" if not args.no_pin else "processes not pinned", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # short: ipc socket paths
    cfg = {"port": free_port(), "token": new_token(), "job_id": f"bench{os.getpid()}", "ipc_dir": str(work),
           "sizes": args.sizes, "rounds": args.rounds, "reps": args.reps, "small_reps": args.small_reps,
           "out": str(work / "res.json"), "cores": pin, "pin": not args.no_pin}
    (work / "cfg.json").write_text(json.dumps(cfg))
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(work / "cfg.json"), "--rank", str(r)],
                              cwd=ROOT) for r in range(2)]
    rcs = [p.wait() for p in procs]
    if any(rcs) or not (work / "res.json").is_file():
        print(f"error: workers exited {rcs}", flush=True)
        return 1
    res = json.loads((work / "res.json").read_text())
    shutil.rmtree(work, ignore_errors=True)
    summary = summarize(res)
    write_json(args.json, {"machine": info, "args": vars(args), "results": res, "summary": summary})
    return 0


def _fmt_size(b: int) -> str:
    return f"{b // MIB} MiB" if b >= MIB else f"{b // KIB} KiB" if b >= KIB else f"{b} B"


def summarize(res: list[dict]) -> list[dict]:
    out = []
    print("\nhand-off bandwidth, GB/s (1e9 B/s): median over rounds [min-max]; ratio to gloo of the same run")
    sizes = sorted({r["bytes"] for r in res if r["kind"] == "bulk"})
    print(f"  {'size':>8} " + " ".join(f"{m:>24}" for m in BULK))
    for b in sizes:
        cells = []
        gl = spread([b / r["s"] for r in res if r["kind"] == "bulk" and r["bytes"] == b and r["method"] == "gloo"])
        for m in BULK:
            s = spread([b / r["s"] / 1e9 for r in res if r["kind"] == "bulk" and r["bytes"] == b
                        and r["method"] == m and r["s"]])
            ratio = s["median"] * 1e9 / gl["median"] if s["n"] and gl["n"] else None
            out.append({"kind": "bulk", "bytes": b, "method": m, "GB_per_s": s, "vs_gloo": ratio})
            cells.append(f"{s['median']:6.2f} [{s['min']:.2f}-{s['max']:.2f}] {ratio:4.2f}x" if s["n"] else "n/a")
        print(f"  {_fmt_size(b):>8} " + " ".join(f"{c:>24}" for c in cells))
    print("\nsmall-message latency, µs (half a round trip): median over rounds [min-max]")
    for m in SMALL:
        s = spread([r["s"] * 1e6 for r in res if r["kind"] == "small" and r["method"] == m])
        out.append({"kind": "small", "method": m, "us": s})
        if s["n"]:
            print(f"  {m:<20} {s['median']:8.1f} [{s['min']:.1f}-{s['max']:.1f}]")
    return out


if __name__ == "__main__":
    if "--worker" in sys.argv:
        raise SystemExit(worker(sys.argv[sys.argv.index("--worker") + 1], int(sys.argv[sys.argv.index("--rank") + 1])))
    raise SystemExit(main())
