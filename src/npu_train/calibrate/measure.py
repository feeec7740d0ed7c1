"""The benchmarks behind ``calibrate=true`` (:func:`measure_at`): each :class:`~npu_train.planner.rates.Rates`
figure timed through a card's backend at the current torch thread count (figures: :mod:`.profile`).
"""
from __future__ import annotations

import os
import time
from contextlib import nullcontext
from statistics import median
from typing import Callable, Optional

from npu_train.calibrate.splitcost import split_backward_ratio
from npu_train.calibrate.timing import FULL, QUICK, LoopBounds, planner_dtype, timed, timed_pairs, torch_dtype
from npu_train.planner.rates import reference_shapes, shape_signature

__all__ = ["COPY_BYTES", "RETRIES", "measure_at", "slower", "best_of", "note_load", "rate_fields", "head_vs_layer",
           "layer_train_step"]

#: bytes of the copy-bandwidth test tensor (the earlier RNGD reference measurement used 117 MB)
COPY_BYTES = 117_000_000

_MATMUL_N = {"cpu": 1024, "cuda": 8192, "furiosa": 4096}
_ADAMW_PARAMS = 20_000_000
RETRIES = 3  # re-measurements of a thread count disturbed by other load


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def _layer_flops(backend, dtype_name: str, dims, loop: LoopBounds) -> float:
    """Sustained training FLOP/s of one DecoderLayer forward + backward on the card."""
    step, flops = _layer_step(backend, dtype_name, dims)
    return flops / timed(step, backend.synchronize, loop)


def layer_train_step(backend, dtype_name: str, dims) -> tuple[Callable[[], None], float]:
    """``(step, flops)``: ``step()`` runs one DecoderLayer forward + backward of ``dims`` = (hidden,
    intermediate, heads, kv heads, micro-batch, sequence length) in ``dtype_name`` (``fp32`` | ``bf16``) on
    ``backend``'s device, gradients accumulating as the trainer's do; ``flops`` = its FLOPs as the planner
    counts them (6 x tokens x layer parameters + attention)."""
    return _layer_step(backend, dtype_name, dims)


def _layer_step(backend, dtype_name: str, dims) -> tuple[Callable[[], None], float]:
    """(one DecoderLayer forward + backward of shape ``dims``, its FLOPs as the planner counts them)."""
    import torch

    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import DecoderLayer, rope_cos_sin

    H, I, heads, kv, b, S = dims
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=I, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, name="calibration-layer")
    dt = torch_dtype(dtype_name)
    dev = backend.device()
    with backend.alloc_lock():
        layer = DecoderLayer(cfg, 0).to(dtype=dt).to(dev)
        cos, sin = rope_cos_sin(cfg, S, dev, dt)
        x = torch.randn(b, S, H, dtype=dt, device=dev, requires_grad=True)
        g = torch.randn(b, S, H, dtype=dt, device=dev)

    def step() -> None:
        with backend.alloc_lock():
            layer(x, cos, sin).backward(g)
            # like the trainer: gradients accumulate into .grad between optimizer steps

    tok = b * S
    return step, 6.0 * tok * cfg.params_per_layer() + 12.0 * S * tok * heads * cfg.head_dim


#: rounds of the interleaved head-vs-layer timing (:func:`head_vs_layer`; 5, not 3: experiments/2026-12-02-head.md)
HEAD_ROUNDS = 5


def head_vs_layer(backend, dtype_name: str, dims, head_shape, loop: LoopBounds,
                   rounds: int = HEAD_ROUNDS) -> tuple[float, float]:
    """``(head FLOP/s, head_flops_ratio)``: the ratio is the median over ``rounds`` of head / layer timed back
    to back, so the machine's drift cancels (timed apart it swung 0.66-1.02: experiments/2026-12-01-bench-run5.md)."""
    layer, lflops = _layer_step(backend, dtype_name, dims)
    head, hflops = _head_step(backend, dtype_name, *head_shape)
    ratios, heads = [], []
    for t_layer, t_head in timed_pairs(layer, head, backend.synchronize, loop, rounds):
        heads.append(hflops / t_head)
        ratios.append((hflops / t_head) / (lflops / t_layer))
    return median(heads), median(ratios)


def _head_step(backend, dtype_name: str, vocab: int, hidden: int, tokens: int) -> tuple[Callable[[], None], float]:
    """(the trainer's head forward + backward on ``tokens`` tokens, fused on FUSED_HEAD_KINDS; 6 tokens V H FLOPs)."""
    import torch
    from npu_train.hardware import FUSED_HEAD_KINDS
    from npu_train.model.headops import HeadLinear
    from npu_train.model.llama import RMSNorm, causal_lm_loss_sum

    dt = torch_dtype(dtype_name)
    dev = backend.device()
    fused = backend.kind in FUSED_HEAD_KINDS
    with backend.alloc_lock():
        norm = RMSNorm(hidden).to(dtype=dt).to(dev)
        head = HeadLinear(hidden, vocab).to(dtype=dt).to(dev)
        head.fused_grad = fused
        x = torch.randn(1, tokens, hidden, dtype=dt, device=dev, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens), device=dev)

    def step() -> None:
        with backend.alloc_lock():
            causal_lm_loss_sum(head(norm(x)).float(), labels, fused=fused)[0].backward()

    return step, 6.0 * tokens * vocab * hidden


def _matmul_flops(backend, dtype_name: str, n: int, loop: LoopBounds) -> float:
    import torch

    dt = torch_dtype(dtype_name)
    dev = backend.device()
    with backend.alloc_lock():
        a = torch.randn(n, n, dtype=dt, device=dev)
        b = torch.randn(n, n, dtype=dt, device=dev)

    def mm() -> None:
        with backend.alloc_lock():
            a @ b

    sec = timed(mm, backend.synchronize, loop)
    return 2.0 * n ** 3 / sec


def _copy_bandwidth(backend, dtype_name: str, nbytes: int, loop: LoopBounds) -> tuple[float, float]:
    """(host->device, device->host) bytes/s for one ``nbytes`` tensor."""
    import torch

    dt = torch_dtype(dtype_name)
    elem = torch.empty((), dtype=dt).element_size()
    host = torch.randn(max(1, nbytes // elem), dtype=torch.float32).to(dt)
    nb = host.numel() * elem
    dev_t = [backend.upload(host)]
    backend.synchronize()

    def up() -> None:
        dev_t[0] = backend.upload(host)  # the previous copy is freed, as in the trainer

    def down() -> None:
        backend.download(dev_t[0])

    t_up = timed(up, backend.synchronize, loop)
    t_down = timed(down, backend.synchronize, loop)
    return nb / t_up, nb / t_down


def _adamw_rate(device, n_params: int, loop: LoopBounds, backend=None) -> float:
    """fp32 AdamW params/s: fused on cpu/cuda, one tensor at a time elsewhere (as StageOptimizer)."""
    import torch

    n_t = 8
    per = max(1, n_params // n_t)
    lock = backend.alloc_lock if backend is not None else None
    with (lock() if lock else nullcontext()):
        params = [torch.nn.Parameter(torch.randn(per, device=device)) for _ in range(n_t)]
        for p in params:
            p.grad = torch.randn(per, device=device) * 1e-3
    kw = {"fused": True} if torch.device(device).type in ("cpu", "cuda") else {"foreach": False}
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **kw)
    sync = backend.synchronize if backend is not None else (lambda: None)

    def step() -> None:
        with (lock() if lock else nullcontext()):
            opt.step()

    sec = timed(step, sync, loop)
    return per * n_t / sec


def _onepass_rate(n_params: int, loop: LoopBounds) -> float:
    """params/s of one host thread running the accelerator cards' host update (:mod:`npu_train.optim.onepass`:
    fp32 gradient in, clip 0.5, AdamW with decay, bf16 copy out; the torch fallback without a C compiler)."""
    import torch

    from npu_train.optim.onepass import adamw_onepass

    n_t = 4
    per = max(1, n_params // n_t)
    ps = [torch.randn(per) for _ in range(n_t)]
    gs = [torch.randn(per) * 1e-3 for _ in range(n_t)]
    opt = torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sec = timed(lambda: adamw_onepass(opt, ps, gs, 0.5, torch.bfloat16, threads=1), lambda: None, loop)
    finally:
        torch.set_num_threads(old)
    return per * n_t / sec


def host_memory_bandwidth(n_bytes: int, loop: LoopBounds) -> float:
    """B/s of ``a.add_(b)`` on fp32 tensors of ``n_bytes / 2`` each with every usable core (12 B an element: two
    streams read, one written in place, as the host update's are): the host memory bandwidth the card
    processes share (``Rates.host_bytes_per_s``)."""
    import torch

    from npu_train.planner.threads import usable_cores

    n = max(1, int(n_bytes) // 8)
    a, b = torch.ones(n), torch.full((n,), 1e-9)
    old = torch.get_num_threads()
    torch.set_num_threads(usable_cores())
    try:
        sec = timed(lambda: a.add_(b), lambda: None, loop)
    finally:
        torch.set_num_threads(old)
    return 12.0 * n / sec


def _stage_optimizer_rate(backend, n_params: int, loop: LoopBounds) -> float:
    """params/s of ``StageOptimizer.step`` over resident parameters on the card (the trainer's device path)."""
    import torch

    from npu_train.optim.adamw import StageOptimizer

    n_t = 8
    per = max(1, n_params // n_t)
    dt = torch_dtype(planner_dtype(backend.kind))
    masters = {f"w{i}": torch.randn(per // 64 or 1, 64) for i in range(n_t)}
    params, grads = {}, {}
    with backend.alloc_lock():
        for n, m in masters.items():
            params[n] = torch.nn.Parameter(backend.upload(m.to(dt)))
            grads[n] = backend.upload((m * 1e-3).to(dt))
    opt = StageOptimizer(params, masters, list(params), backend, lr=1e-4)
    secs: list[float] = []

    def step() -> None:  # a fresh step gradient each time, as after a backward (not timed)
        with backend.alloc_lock():
            for n, p in params.items():
                p.grad = grads[n].clone()
        secs.append(opt.step(1e-4, 0.5)["device_optimizer"])

    timed(step, lambda: None, loop)
    return sum(m.numel() for m in masters.values()) / median(secs[loop.warmup:] or secs)


#: figures that must not drop when threads are added (else the measurement was disturbed)
_MONOTONE = ("device_flops", "head_flops", "host_adamw_params_per_s", "device_adamw_params_per_s")


def slower(m: dict, lower: dict) -> list[str]:
    """Names of the compute-bound figures of ``m`` below those of ``lower`` (fewer threads)."""
    return [k for k in _MONOTONE if m[k] < lower[k]]


def best_of(a: dict, b: dict, kind: str, only=None) -> dict:
    """Per-figure maximum of two measurements (``only``: just these and what derives from them); the
    ``head_flops_ratio`` stays the one measured with the kept head figure."""
    out = dict(a)
    keys = only or (*_MONOTONE, "h2d_bytes_per_s", "d2h_bytes_per_s")
    for k in keys:
        out[k] = max(a[k], b[k])
    if only is None or "device_flops" in only:
        out["flops_by_dtype"] = {d: max(v, b["flops_by_dtype"].get(d, 0.0))
                                 for d, v in a["flops_by_dtype"].items()}
        out["flops_by_dtype"][planner_dtype(kind)] = out["device_flops"]
    out["head_flops_ratio"] = (b if "head_flops" in keys and b["head_flops"] > a["head_flops"] else a)["head_flops_ratio"]
    have = [m["split_backward_ratio"] for m in (a, b) if "split_backward_ratio" in m]
    if have:  # a ratio: the one timed with the layer figure kept, else whichever was measured
        src = b if "device_flops" in keys and b["device_flops"] > a["device_flops"] else a
        out["split_backward_ratio"] = src.get("split_backward_ratio", have[0])
    return out


def note_load(m: dict) -> None:
    """Record the 1-minute load average in ``m["loadavg_1"]`` (when the platform has one)."""
    try:
        m["loadavg_1"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass


def measure_at(kind: str, backend, quick: bool, model_cfg=None, *, loop: Optional[LoopBounds] = None,
               dtypes: Optional[tuple] = None, matmul: bool = True,
               batch_seq: Optional[tuple[int, int]] = None,
               adamw_params: Optional[int] = None) -> dict:
    """The rate figures of ``kind`` at the current torch thread count. ``quick``: tiny sizes (tests);
    ``loop``: timing bounds (:data:`QUICK` / :data:`FULL`); ``dtypes``: compute dtypes timed (default: the
    planner's and the other); ``matmul``: also bare matmul FLOP/s; ``batch_seq``: the job's (micro-batch,
    seq len); ``adamw_params``: AdamW benchmark size (20M; quick 200k). Sets this process's malloc to keep
    freed memory, as card processes do (:func:`npu_train.hostmem.keep_freed_memory`)."""
    import torch

    from npu_train.hostmem import card_mmap_threshold, keep_freed_memory

    threshold = card_mmap_threshold(kind)  # as the card processes of ``kind`` do by default
    if threshold is not None:
        keep_freed_memory(mmap_threshold=threshold)
    loop = loop or (QUICK if quick else FULL)
    dims, head_shape, what = reference_shapes(kind, quick, model_cfg, batch_seq)
    n_mm = 128 if quick else _MATMUL_N[kind]
    nbytes = 1_000_000 if quick else COPY_BYTES
    n_adamw = 200_000 if quick else int(adamw_params or _ADAMW_PARAMS)
    main = planner_dtype(kind)
    dts = tuple(dtypes) if dtypes else (main, "bf16" if main == "fp32" else "fp32")
    out: dict = {"flops_by_dtype": {}, "matmul_flops_by_dtype": {},
                 "shapes": {"layer_H_I_heads_kv_b_s": list(dims),
                            "head_V_H_tokens": list(head_shape), "source": what,
                            "signature": shape_signature(dims, head_shape)}}
    secs: dict = {}
    out["seconds"] = secs  # wall seconds per figure, set-up included

    def lap(name: str, t0: float) -> None:
        secs[name] = round(time.perf_counter() - t0, 3)

    for dt in dts:
        try:
            t0 = time.perf_counter()
            out["flops_by_dtype"][dt] = _layer_flops(backend, dt, dims, loop)
            lap(f"layer_{dt}", t0)
            if dt == dts[0]:  # the planner dtype's layer (the other dtype may fail): B + W vs backward
                t0 = time.perf_counter()
                try:
                    out["split_backward_ratio"] = split_backward_ratio(backend, dt, dims, loop)
                except Exception as exc:  # noqa: BLE001 - optional figure: the planner assumes 1.0
                    out.setdefault("errors", {})["split_backward_ratio"] = f"{type(exc).__name__}: {exc}"[:300]
                lap("split_backward", t0)
            if matmul:
                out["matmul_flops_by_dtype"][dt] = _matmul_flops(backend, dt, n_mm, loop)
        except Exception as exc:  # noqa: BLE001 - the second dtype is optional (e.g. fp32 on RNGD)
            if dt == dts[0]:
                raise
            out.setdefault("errors", {})[dt] = f"{type(exc).__name__}: {exc}"[:300]
    first = main if main in out["flops_by_dtype"] else dts[0]
    out["device_flops"] = out["flops_by_dtype"][first]
    t0 = time.perf_counter()
    head, ratio = head_vs_layer(backend, first, dims, head_shape, loop)
    lap("head", t0)
    out["head_flops"] = head
    out["head_flops_ratio"] = ratio
    t0 = time.perf_counter()
    out["h2d_bytes_per_s"], out["d2h_bytes_per_s"] = _copy_bandwidth(backend, first, nbytes, loop)
    lap("copies", t0)
    t0 = time.perf_counter()
    # a cpu card's optimizer is torch's fused AdamW at the card's threads; an accelerator's host update is the
    # one-pass kernel, measured on one thread (the planner scales it by threads up to the bandwidth below)
    out["host_adamw_params_per_s"] = (_adamw_rate(torch.device("cpu"), n_adamw, loop) if kind == "cpu"
                                      else _onepass_rate(n_adamw, loop))
    lap("host_adamw", t0)
    if kind != "cpu":
        t0 = time.perf_counter()
        out["host_bytes_per_s"] = host_memory_bandwidth(2 * nbytes, loop)
        lap("host_bandwidth", t0)
    n_dev = n_adamw if kind != "furiosa" else max(1, n_adamw // 5)
    t0 = time.perf_counter()
    out["device_adamw_params_per_s"] = _stage_optimizer_rate(backend, n_dev, loop)
    lap("device_adamw", t0)
    return out


def rate_fields(m: dict) -> dict:
    """A :func:`measure_at` result's Rates fields as a profile's ``by_threads`` entry."""
    keys = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
            "device_adamw_params_per_s", "head_flops_ratio", "split_backward_ratio", "host_bytes_per_s")
    out = {k: float(m[k]) for k in keys if k in m}
    out["flops_by_dtype"] = {k: float(v) for k, v in m["flops_by_dtype"].items()}
    sig = (m.get("shapes") or {}).get("signature")
    if sig:
        out["shapes"] = str(sig)
    return out

