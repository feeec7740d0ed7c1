#!/usr/bin/env python
"""Host AdamW on CPU: the project's update of an offloaded tensor against torch's fused AdamW and the
memory-bandwidth limit measured in the same process (default); ``--variants``: fused vs foreach vs
for-loop, the cost of emitting a bf16 copy, the bf16 emission fused into the step, two processes at once.

Default (issue 39): the MLP matrices of one Llama-3.1-8B layer (3 x 14336 x 4096 fp32 masters, 176 M
params; ``--params`` scales the three), at each ``--threads`` count, interleaved over ``--rounds``:

- ``same-traffic limit`` (the limit the ratios are taken against): :func:`npu_train.optim.onepass.stream_probe`,
  the one-pass kernel's own loads and stores with one add each instead of AdamW's arithmetic (bf16 gradient
  read; master and both moments read and written in place; a fresh bf16 copy written, as the project's path
  allocates it; 28 B/param, the same five streams and threads);
- ``add_ limit``: ``a.add_(b)`` on two fp32 tensors of the same total size (read 8 B, write 4 B per
  element, all in place; two streams), bytes/s divided by AdamW's 28 B/param (the limit before: the
  one-pass update read 104-122 % of it, a probe that under-reads the five-stream traffic); ``copy limit``:
  ``a.copy_(b)`` counted as 8 B per element (the hardware also reads ``a`` before writing it, so this
  understates the bandwidth by up to a third; the ratio to it is the looser one);
- ``project, bf16 grad``: :func:`npu_train.optim.onepass.adamw_onepass` as the host updater calls it
  (bf16 gradient, clip 0.5, bf16 copy out; 28 B/param); ``project, fp32 grad`` (30 B/param);
- ``old path, bf16 grad``: the same call with ``use_kernel=False`` (``.float()``, clip ``mul_``, fused
  AdamW, ``.to(bf16)``: the update before the one-pass kernel and the fallback without a compiler;
  52 B/param);
- ``torch fused, fp32 grad``: ``torch.optim.AdamW(fused=True).step()`` alone (no clip, no copy; 28 B/param).

Printed: M params/s (median over rounds, [min-max]), share of the same-traffic limit, ratio to torch fused.

The host optimizer of offloaded layers (``npu_train.optim.adamw``) is
``torch.optim.AdamW(fused=True)`` over fp32 masters on the CPU; after the step the trainer casts
each master to the compute dtype and uploads it (``m.to(p.dtype)`` then ``backend.upload``). This
benchmark times, on ~50M fp32 params (SmolLM2-like tensor shapes by default):

- ``AdamW(fused=True)`` (the baseline), ``AdamW(foreach=True)``, ``AdamW(foreach=False)`` (for-loop);
- emitting the bf16 copy after the step: ``m.to(torch.bfloat16)`` per tensor (fresh allocations,
  what the trainer does), ``buf.copy_(m)`` into preallocated bf16 buffers, and
  ``torch._foreach_copy_`` into preallocated buffers;
- step + emission together: the fused step followed by ``_foreach_copy_`` (two passes over the
  masters); the fused kernel (``torch._fused_adamw_``, what ``AdamW(fused=True)`` calls) run on
  chunks of ``--chunk-kib`` KiB of each tensor, each chunk's bf16 copy made right after its
  update while the chunk is still in cache (one pass over memory; bit-identical to the fused
  step); and the AdamW update with the bf16 output written by one ``torch.compile``d (inductor,
  C++) kernel per tensor (``--no-compile`` skips it; its rounding differs from the fused kernel's
  by a few ulp, the maximum difference is printed);
- two processes at once: the fused step (+ ``_foreach_copy_`` emission) in two processes, each
  pinned to its own core with ``--pair-threads`` threads, started together, against one process
  alone measured in the same rounds (as two card processes on one host would share its memory
  bandwidth).

Each figure is the median of ``--reps`` steps after two warm-up steps (the first allocates the
moments); rounds (``--rounds``) repeat every variant in a rotated order; reported: the median over
rounds, [min-max] over rounds, params/s (1e6 params per second), and the ratio to the fused step
measured in the same round set at the same thread count.

Usage::

    flock /tmp/bench.lock .venv/bin/python experiments/bench/host_adamw.py [--params 176e6] [--threads 1 2]
    .venv/bin/python experiments/bench/host_adamw.py --variants [--params 50e6] [--threads 1 2] [--reps 7]
    .venv/bin/python experiments/bench/host_adamw.py --quick
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import core_for, machine_info, print_machine, spread, usable_cores, write_json  # noqa: E402

LR, BETAS, EPS, WD = 1e-4, (0.9, 0.95), 1e-8, 0.1


def make_params(n_params: int, layout: str, seed: int = 0) -> list[torch.nn.Parameter]:
    """fp32 parameters with gradients. ``model``: SmolLM2-like tensors (576x1536 MLP matrices,
    576x576 / 192x576 attention matrices, 576 norms) until ``n_params``; ``uniform``: 16 equal
    tensors."""
    shapes: list[tuple[int, ...]] = []
    if layout == "uniform":
        shapes = [(n_params // 16,)] * 16
    else:
        layer = [(576,), (576, 576), (192, 576), (192, 576), (576, 576), (576,),
                 (1536, 576), (1536, 576), (576, 1536)]
        total = 0
        while total < n_params:
            for s in layer:
                shapes.append(s)
                total += int(torch.Size(s).numel())
    g = torch.Generator().manual_seed(seed)
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        ps.append(p)
    return ps


def timed(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


# ----------------------------------------------------------------------------- fused step + bf16
class ChunkedFusedAdamW:
    """AdamW over fp32 ``params`` with the bf16 copy emitted chunk by chunk, fused into the step.

    Every tensor is cut into contiguous chunks of ``chunk_bytes`` (fp32); for each chunk,
    ``torch._fused_adamw_`` (the kernel of ``torch.optim.AdamW(fused=True)``, elementwise, so
    chunking changes no bit) updates parameter and moments, then the chunk's bf16 copy is written
    while it is still in cache. ``out``: the bf16 tensors (same shapes as ``params``).
    """

    def __init__(self, params, chunk_bytes: int, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD):
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.params = [p.detach() for p in params]
        self.grads = [p.grad for p in params]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.out = [torch.empty_like(p, dtype=torch.bfloat16) for p in self.params]
        self.step_t = torch.zeros((), dtype=torch.float32)
        n = max(1, chunk_bytes // 4)
        self.chunks = []
        for p, g, m, v, o in zip(self.params, self.grads, self.m, self.v, self.out):
            views = [t.view(-1).split(n) for t in (p, g, m, v, o)]
            self.chunks.extend(zip(*views))

    def step(self) -> None:
        self.step_t += 1
        b1, b2 = self.betas
        for p, g, m, v, o in self.chunks:
            torch._fused_adamw_([p], [g], [m], [v], [], [self.step_t], amsgrad=False, lr=self.lr, beta1=b1,
                                beta2=b2, weight_decay=self.wd, eps=self.eps, maximize=False,
                                grad_scale=None, found_inf=None)
            o.copy_(p)


class CompiledAdamWBf16:
    """AdamW (decoupled weight decay, bias-corrected, as ``torch.optim.AdamW``) with the bf16 copy
    written in the same loop: one ``torch.compile``d (inductor) kernel per tensor. Scalars are
    0-d tensors so the kernel compiles once (``dynamic=True`` for the shapes)."""

    def __init__(self, params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD):
        self.params = [p.detach() for p in params]
        self.grads = [p.grad for p in params]
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.out = [torch.empty_like(p, dtype=torch.bfloat16) for p in self.params]
        self.lr, self.betas, self.eps, self.wd, self.n = lr, betas, eps, weight_decay, 0
        self.fn = torch.compile(_adamw_bf16_kernel, dynamic=True)

    def step(self) -> None:
        self.n += 1
        b1, b2 = self.betas
        sc = torch.tensor([1.0 - self.lr * self.wd, b1, 1.0 - b1, b2, 1.0 - b2,
                           self.lr / (1.0 - b1 ** self.n), math.sqrt(1.0 - b2 ** self.n), self.eps])
        for p, g, m, v, o in zip(self.params, self.grads, self.m, self.v, self.out):
            self.fn(p, g, m, v, o, sc)


def _adamw_bf16_kernel(p, g, m, v, o, sc):
    m_new = m * sc[1] + g * sc[2]
    v_new = v * sc[3] + g * g * sc[4]
    p_new = p * sc[0] - sc[5] * m_new / (v_new.sqrt() / sc[6] + sc[7])
    m.copy_(m_new)
    v.copy_(v_new)
    p.copy_(p_new)
    o.copy_(p_new.to(torch.bfloat16))


def check_equal(n_params: int, layout: str, chunk_bytes: int, compile_: bool) -> dict:
    """Three steps from the same start: max |difference| of the masters and bf16 copies of the
    fused-by-chunks and compiled variants against AdamW(fused=True) + ``_foreach_copy_``."""
    ref = make_params(n_params, layout)
    opt = torch.optim.AdamW(ref, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    for _ in range(3):
        opt.step()
    ref_bf = [p.detach().to(torch.bfloat16) for p in ref]
    out = {}
    variants = [("chunked", lambda ps: ChunkedFusedAdamW(ps, chunk_bytes))]
    if compile_:
        variants.append(("compiled", CompiledAdamWBf16))
    for name, mk in variants:
        try:
            o = mk(make_params(n_params, layout))
            for _ in range(3):
                o.step()
            dp = max(float((a - b.detach()).abs().max()) for a, b in zip(o.params, ref))
            db = max(float((a.float() - b.float()).abs().max()) for a, b in zip(o.out, ref_bf))
            out[name] = {"max_abs_diff_master": dp, "max_abs_diff_bf16": db}
        except Exception as e:  # noqa: BLE001 - reported
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


# ----------------------------------------------------------------------------- variants
def variants(n_params: int, layout: str, chunk_kib: list[int], compile_: bool):
    """``[(name, setup)]``: ``setup()`` returns the function timed (one step)."""
    def adamw(**kw):
        def setup():
            ps = make_params(n_params, layout)
            opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
            return opt.step
        return setup

    def emit(kind):
        def setup():
            masters = [p.detach() for p in make_params(n_params, layout)]
            bufs = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]
            if kind == "to":
                return lambda: [m.to(torch.bfloat16) for m in masters]
            if kind == "copy":
                def into():
                    for b, m in zip(bufs, masters):
                        b.copy_(m)
                return into
            return lambda: torch._foreach_copy_(bufs, masters)
        return setup

    def step_then_copy():
        ps = make_params(n_params, layout)
        opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
        masters = [p.detach() for p in ps]
        bufs = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]

        def f():
            opt.step()
            torch._foreach_copy_(bufs, masters)
        return f

    out = [("AdamW fused=True", adamw(fused=True)),
           ("AdamW foreach=True", adamw(foreach=True)),
           ("AdamW foreach=False (for-loop)", adamw(foreach=False)),
           ("bf16 copy: m.to(bf16) per tensor (trainer)", emit("to")),
           ("bf16 copy: buf.copy_(m) preallocated", emit("copy")),
           ("bf16 copy: _foreach_copy_ preallocated", emit("foreach")),
           ("step+bf16: fused, then _foreach_copy_", step_then_copy)]
    for c in chunk_kib:
        out.append((f"step+bf16: fused per {c} KiB chunk + copy", lambda c=c: ChunkedFusedAdamW(
            make_params(n_params, layout), c * 1024).step))
    if compile_:
        out.append(("step+bf16: torch.compile one kernel", lambda: CompiledAdamWBf16(make_params(n_params, layout)).step))
    return out


def _pair_child(rank, core, n_params, layout, threads, reps, barrier, q, pin):
    if pin:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)
    ps = make_params(n_params, layout, seed=rank)
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    masters = [p.detach() for p in ps]
    bufs = [torch.empty_like(m, dtype=torch.bfloat16) for m in masters]

    def f():
        opt.step()
        torch._foreach_copy_(bufs, masters)
    f()
    f()
    barrier.wait()
    q.put((rank, timed(f, reps, warmup=0)))


def run_procs(n_procs: int, n_params, layout, threads, reps, cores, pin) -> list[float]:
    """Fused step + emission in ``n_procs`` spawned processes started together; s/step of each."""
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(n_procs), ctx.Queue()
    ps = [ctx.Process(target=_pair_child, args=(r, core_for(r, cores), n_params, layout, threads, reps,
                                                barrier, q, pin)) for r in range(n_procs)]
    for p in ps:
        p.start()
    res = dict(q.get(timeout=3600) for _ in ps)
    for p in ps:
        p.join()
    return [res[r] for r in range(n_procs)]


# ----------------------------------------------------------------------------- one pass (default)
#: bytes moved per parameter by each path (gradient in, master + moments read and written, copy out)
ONEPASS_BYTES = {"same-traffic limit": 28, "add_ limit": 28, "copy limit": 28, "project, bf16 grad": 28,
                 "project, fp32 grad": 30, "old path, bf16 grad": 52, "torch fused, fp32 grad": 28}
#: the limit the "of limit" column divides by
LIMIT = "same-traffic limit"


def onepass_paths(n: int, threads: int):
    """``[(name, fn)]``: each fn runs one update of the three tensors and returns the seconds it took."""
    from npu_train.optim.onepass import adamw_onepass, kernel_status, stream_probe

    if not kernel_status().ok:
        print(f"note: no one-pass kernel ({kernel_status().reason}): 'project' is the torch fallback")
    g = torch.Generator().manual_seed(0)
    rows = max(1, n // 3 // 4096)
    ps = [torch.randn(rows, 4096, generator=g) * 0.02 for _ in range(3)]
    g32 = [torch.randn(rows, 4096, generator=g) * 1e-3 for _ in range(3)]
    g16 = [x.to(torch.bfloat16) for x in g32]
    opt = torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    half = sum(p.numel() for p in ps) // 2
    a, b = torch.ones(half), torch.full((half,), 1e-9)
    # the probe's own master and moments (it adds to them): the same sizes as the update's
    probe_p = [torch.zeros_like(p) for p in ps]
    probe_m = [torch.zeros_like(p) for p in ps]
    probe_v = [torch.zeros_like(p) for p in ps]
    g_tiny = [torch.full_like(x, 1e-30) for x in g16]

    def same_traffic():
        for p, m, v, gr in zip(probe_p, probe_m, probe_v, g_tiny):
            stream_probe(p, m, v, gr, torch.empty(p.shape, dtype=torch.bfloat16), threads=threads)

    def clock(fn):
        def run():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return run

    def torch_fused():
        for p, gr in zip(ps, g32):
            p.grad = gr
        opt.step()
        for p in ps:
            p.grad = None

    return sum(p.numel() for p in ps), [
        ("same-traffic limit", clock(same_traffic)),
        ("add_ limit", clock(lambda: a.add_(b))),
        ("copy limit", clock(lambda: a.copy_(b))),
        ("project, bf16 grad", clock(lambda: adamw_onepass(opt, ps, g16, 0.5, torch.bfloat16, threads=threads))),
        ("project, fp32 grad", clock(lambda: adamw_onepass(opt, ps, g32, 0.5, torch.bfloat16, threads=threads))),
        ("old path, bf16 grad", clock(lambda: adamw_onepass(opt, ps, g16, 0.5, torch.bfloat16, use_kernel=False))),
        ("torch fused, fp32 grad", clock(torch_fused)),
    ]


def onepass_main(args) -> dict:
    """The default comparison (module docstring); returns the JSON record."""
    from npu_train.hostmem import keep_freed_memory

    keep_freed_memory()  # as in a card process: the copies out reuse heap pages
    out: dict = {"rows": []}
    for t in args.threads:
        n, paths = onepass_paths(int(args.params), t)
        per: dict[str, list] = {name: [] for name, _ in paths}
        for _ in range(2):  # warm-up: moments allocated, kernel loaded, pages touched
            for _, fn in paths:
                fn()
        for rnd in range(args.rounds):
            k = rnd % len(paths)
            for name, fn in paths[k:] + paths[:k]:
                # add_ / copy_ move 12 B / 8 B (copy_ counted without the write-allocate read) per element of
                # half the params: their times scaled to 28 B/param; the same-traffic probe moves 28 B/param
                s = fn()
                scale = {"add_ limit": 28 / 12 * 2, "copy limit": 28 / 8 * 2}.get(name, 1.0)
                per[name].append(s * scale)
        rate = {name: spread([n / x for x in xs]) for name, xs in per.items()}
        lim, fused = rate[LIMIT]["median"], rate["torch fused, fp32 grad"]["median"]
        load = os.getloadavg()
        print(f"\nthreads {t} ({n / 1e6:.0f} M params, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
              f"{LIMIT} {lim * 28 / 1e9:.1f} GB/s = {lim / 1e6:.0f} M params/s at 28 B/param)")
        print(f"  {'path':<24} {'B/param':>7} {'M params/s':>10} {'[min-max]':>13} {'of limit':>8} {'vs fused':>8}")
        for name, _ in paths:
            r = rate[name]
            print(f"  {name:<24} {ONEPASS_BYTES[name]:7d} {r['median'] / 1e6:10.0f} "
                  f"{r['min'] / 1e6:6.0f}-{r['max'] / 1e6:<6.0f} {r['median'] / lim:8.0%} {r['median'] / fused:7.2f}x")
            out.setdefault("load_average", {})[t] = list(load)
            out["rows"].append({"threads": t, "path": name, "bytes_per_param": ONEPASS_BYTES[name],
                                "params_per_s": r, "of_limit": r["median"] / lim, "vs_fused": r["median"] / fused})
        del paths
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", action="store_true", help="the older comparison of torch variants (docstring)")
    ap.add_argument("--params", type=float, default=None, help="default 176e6 (50e6 with --variants)")
    ap.add_argument("--threads", type=int, nargs="*", default=sorted({1, len(usable_cores())}))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layout", choices=("model", "uniform"), default="model")
    ap.add_argument("--chunk-kib", type=int, nargs="*", default=[256, 2048])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--pair-threads", type=int, default=1, help="threads per process in the two-process runs")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2M params, 1 round, 2 reps, 1 thread")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.params is None:
        args.params = 50e6 if args.variants else 176e6
    if args.quick:
        args.params, args.rounds, args.reps, args.threads = 2e6, 1, 2, [1]
    info = machine_info()
    print_machine(info)
    if not args.variants:
        print("(a shared machine gives figures that vary between runs: compare the ratios within one run)")
        res = onepass_main(args)
        write_json(args.json, {"machine": info, "args": vars(args), **res})
        return 0
    cores = usable_cores()
    n = int(args.params)
    print(f"{args.params / 1e6:.0f}M fp32 params ({args.layout} layout), median of {args.reps} steps per round, "
          f"{args.rounds} round(s)")
    eq = check_equal(min(n, int(2e6)), args.layout, args.chunk_kib[0] * 1024 if args.chunk_kib else 256 * 1024,
                     not args.no_compile)
    print("check (3 steps vs AdamW fused + bf16 copy, max |diff|): " + ", ".join(
        f"{k}: " + (v["error"] if "error" in v else f"master {v['max_abs_diff_master']:.1e}, bf16 "
                    f"{v['max_abs_diff_bf16']:.1e}") for k, v in eq.items()))
    results: dict = {"machine": info, "args": vars(args), "check": eq, "single": [], "pair": []}
    for t in args.threads:
        torch.set_num_threads(t)
        vs = variants(n, args.layout, args.chunk_kib, not args.no_compile)
        per: dict[str, list] = {name: [] for name, _ in vs}
        errors: dict[str, str] = {}
        for rnd in range(args.rounds):
            k = rnd % len(vs)
            for name, setup in vs[k:] + vs[:k]:
                if name in errors:
                    continue
                try:
                    per[name].append(timed(setup(), args.reps))
                except Exception as e:  # noqa: BLE001 - e.g. no compiler for torch.compile
                    errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        base = spread(per["AdamW fused=True"])["median"]
        print(f"\nthreads {t} (load {os.getloadavg()[0]:.2f})")
        print(f"  {'variant':<46} {'s/step median':>13} {'[min-max]':>17} {'M params/s':>10} {'vs fused':>8}")
        for name, _ in vs:
            s = spread(per[name])
            rec = {"threads": t, "variant": name, "s": s, "errors": errors.get(name)}
            if s["n"]:
                rec["vs_fused"] = s["median"] / base
                print(f"  {name:<46} {s['median']:13.4f} {s['min']:8.4f}-{s['max']:<8.4f} "
                      f"{n / s['median'] / 1e6:10.0f} {s['median'] / base:7.2f}x")
            else:
                print(f"  {name:<46} failed: {errors.get(name)}")
            results["single"].append(rec)

    pin = not args.no_pin
    pcores = [core_for(r, cores) for r in range(2)]
    print(f"\ntwo processes at once: fused step + _foreach_copy_ bf16, {args.pair_threads} thread(s) each, "
          f"pinned to cores {pcores if pin else 'none'}" + (" (one usable core: both share it)" if len(cores) < 2 else ""))
    alone, pair = [], []
    for rnd in range(args.rounds):
        for kind in (("alone", "pair") if rnd % 2 == 0 else ("pair", "alone")):
            r = run_procs(1 if kind == "alone" else 2, n, args.layout, args.pair_threads, args.reps, cores, pin)
            (alone if kind == "alone" else pair).append(r)
    sa = spread([r[0] for r in alone])
    sp = spread([max(r) for r in pair])
    agg = spread([2 * n / max(r) for r in pair])
    print(f"  one process alone:            {sa['median']:.4f} s/step [{sa['min']:.4f}-{sa['max']:.4f}], "
          f"{n / sa['median'] / 1e6:.0f} M params/s")
    print(f"  two at once (slower of two):  {sp['median']:.4f} s/step [{sp['min']:.4f}-{sp['max']:.4f}], "
          f"{sp['median'] / sa['median']:.2f}x the time alone; both together {agg['median'] / 1e6:.0f} M params/s")
    results["pair"] = {"alone_s": alone, "pair_s": pair, "alone": sa, "pair_slower": sp, "aggregate_params_per_s": agg}
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
