"""Calibration: measure the :class:`~npu_train.optim.placement.Rates` of a card kind on this machine.

``python launch/run.py calibrate=true`` ends up in :func:`main_calibrate`, which measures every
card kind of the job with :func:`calibrate`, prints a table and writes one profile per kind with
:func:`save_profile` (default ``~/.cache/npu-train/calibration/<kind>.json``, the file
:func:`~npu_train.optim.placement.load_rates` reads; ``placement.profile=<path>`` selects another).

What is measured, through the card's backend (:func:`npu_train.backends.make_backend`), each in a
time-bounded loop (about 0.6 s per figure, at most 3 s; the median of the repetitions is kept, so
a short burst of other load on a shared machine does not decide the figure; a whole cpu
calibration takes ~25 s on 2 cores):

- ``device_flops``: *sustained training* FLOP/s = forward + backward of one
  :class:`npu_train.model.llama.DecoderLayer` (the trainer's own layer, in the planner's compute
  dtype: fp32 on cpu, bf16 on cuda/furiosa; fp32 and bf16 both go to ``flops_by_dtype``) on
  ``b*s`` tokens (cpu 2x128 as the default job, accelerators 1x512), counted as the placement
  model counts them (``6 * tokens * params + 12 * s * heads*head_dim * tokens``). The layer has
  the shapes of the model being calibrated for (``model_path``) when one repetition stays within
  ``_FLOP_BUDGET``, else a reference Llama layer. A bare matmul runs faster (about 100 vs 85
  GFLOP/s fp32 per core on an AMD EPYC Zen 4) because a training step also spends time in norms,
  RoPE, SwiGLU, attention and autograd; the planner divides training FLOPs by this rate, so it
  must be the training rate. The bare square-matmul FLOP/s are recorded too
  (``matmul_flops_by_dtype``, not used by the planner).
- ``head_flops_ratio``: FLOP/s of final norm + ``lm_head`` + ``causal_lm_loss_sum`` forward +
  backward (the model's vocabulary and width when given) divided by ``device_flops``: about 0.8
  for SmolLM2 on a CPU core (the ``V x H`` GEMMs have one small dimension; the fp32 log-softmax
  spans the vocabulary).
- ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``: ``backend.upload`` / ``backend.download`` of one
  117 MB tensor (the size of the earlier RNGD reference measurement) + ``synchronize``; on cpu that
  is a clone into freshly allocated memory (page faults included), as in the trainer.
- ``host_adamw_params_per_s``: ``torch.optim.AdamW(fused=True)`` on the CPU over ~20M fp32
  params (8 tensors), gradients set, after two warm-up steps (the first allocates the moments).
- ``device_adamw_params_per_s``: ``StageOptimizer.step`` over resident parameters on the card,
  i.e. the trainer's own device-optimizer path: gradient scaling into the fp32 masters, AdamW as
  the trainer configures it for the device (cpu: the same fused CPU AdamW as the host's; cuda:
  fused; furiosa: ``foreach=False``) and the refresh of the compute-dtype weights.
- ``process_baseline_bytes`` (cpu only): RSS of a fresh subprocess that does what a card process
  does before it allocates model state: imports torch and the trainer's modules, sets up the cpu
  backend, a ZeroMQ context and a one-rank gloo process group, and (with ``model_path``) opens the
  model file with the trainer's loader; a GGUF reader stays cached in the card process with its
  parsed metadata and memory-mapped file, so its pages are touched too (an upper bound: a stage
  touches only its own tensors' pages).

Threads: on cpu the figures depend on the torch thread count, and the launcher gives each cpu
card process ``max(1, cores // number of cpu cards)`` threads (``runtime.threads``). Calibration
measures every count in ``{1, 2, 4, ..., cores}`` (``torch.set_num_threads(n)`` around the
measurement); the profile's top level holds the figures for ``cores`` threads and ``by_threads``
the others, and the planner picks the entry of the job's thread count (see
:meth:`npu_train.optim.placement.Rates.resolve`). Multi-thread figures collapse while another
process holds a core (an OpenMP team waits for its descheduled thread: 5-40 instead of 145
GFLOP/s on 2 cores), so the largest count is measured first, a count that comes out slower than
a smaller one is re-measured (best of up to 4 per figure), and if it stays slower the smaller
count's figures are used (a lower bound) and a warning is printed and saved: calibrate on a quiet
machine.

``quick=True`` shrinks every size (for tests): positive, finite, but not meaningful figures.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Callable, Optional, Union

from npu_train.optim.placement import (
    DEFAULT_RATES,
    KINDS,
    Rates,
    calibration_path,
    gib,
    load_rates,
)

__all__ = ["calibrate", "save_profile", "main_calibrate", "machine_info", "thread_counts",
           "measure_process_baseline", "COPY_BYTES", "PROFILE_VERSION"]

#: bytes of the copy-bandwidth test tensor (the earlier RNGD reference measurement used 117 MB)
COPY_BYTES = 117_000_000
PROFILE_VERSION = 1

# reference decoder layer for the training-FLOP/s measurement: (hidden, intermediate, heads,
# kv_heads, micro_batch, seq_len) per kind; cpu is Llama-like at 256 tokens per micro-batch (the
# default job's b*s), accelerators a Llama-3.1-8B layer at S=512.
_LAYER = {
    "cpu": (1024, 2816, 16, 4, 2, 128),
    "cuda": (4096, 14336, 32, 8, 1, 512),
    "furiosa": (4096, 14336, 32, 8, 1, 512),
}
_LAYER_QUICK = (128, 352, 4, 2, 1, 32)
# reference lm_head (vocab, hidden) when no model is given
_HEAD = {"cpu": (32000, 1024), "cuda": (128256, 4096), "furiosa": (128256, 4096)}
_HEAD_QUICK = (1000, 128)
# most FLOPs one repetition of the layer / head benchmark may take (the model's own dims are used
# when they fit, else the reference ones): ~0.2 s on one CPU core, milliseconds on accelerators
_FLOP_BUDGET = {"cpu": 20e9, "cuda": 2e12, "furiosa": 2e12}
_MATMUL_N = {"cpu": 1024, "cuda": 8192, "furiosa": 4096}
_ADAMW_PARAMS = 20_000_000
_RETRIES = 3  # re-measurements of a thread count disturbed by other load


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _planner_dtype(kind: str) -> str:
    """The compute dtype ``train.dtype=auto`` picks for ``kind`` (fp32 on cpu, bf16 elsewhere)."""
    return "fp32" if kind == "cpu" else "bf16"


def _timed(fn: Callable[[], None], sync: Callable[[], None], *, min_time: float,
           max_reps: int, min_reps: int = 3, warmup: int = 1, max_time: Optional[float] = None) -> float:
    """Median seconds of ``fn`` (``sync`` after each call), repeated until ``min_time`` has passed
    (at least ``min_reps``, at most ``max_reps`` repetitions), but never past ``max_time``
    (default ``5 * min_time``) once one repetition is done."""
    max_time = 5 * min_time if max_time is None else max_time
    t_start = time.perf_counter()
    for _ in range(warmup):
        fn()
        sync()
    times: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > max_time:
            break
    return median(times)


def thread_counts(cores: Optional[int] = None) -> list[int]:
    """cpu thread counts calibration measures: ``{1, 2, 4, ...} <= cores``, plus ``cores``."""
    cores = int(cores or os.cpu_count() or 1)
    out, t = set(), 1
    while t <= cores:
        out.add(t)
        t *= 2
    out.add(cores)
    return sorted(out)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(kind: Optional[str] = None, backend=None) -> dict:
    """Facts recorded with a profile: cpu model, cores, RAM, torch / python versions, date,
    load average, and the device name for cuda."""
    import psutil
    import torch

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": _cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "ram_bytes": int(psutil.virtual_memory().total),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["npu_train"] = version("npu-train")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        pass
    if kind == "cuda":
        try:
            info["device"] = torch.cuda.get_device_name(backend.index if backend else 0)
        except Exception:  # noqa: BLE001
            pass
    if kind == "furiosa":
        try:
            info["device"] = str(backend.device()) if backend is not None else "furiosa"
        except Exception:  # noqa: BLE001
            pass
    return info


# ------------------------------------------------------------------------------------------------
# measurements
# ------------------------------------------------------------------------------------------------
def _layer_flops(backend, dtype_name: str, dims, min_time: float, max_reps: int) -> float:
    """Sustained training FLOP/s of one DecoderLayer forward + backward on the card."""
    import torch

    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import DecoderLayer, rope_cos_sin

    H, I, heads, kv, b, S = dims
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=I, num_layers=1,
                      num_heads=heads, num_kv_heads=kv, name="calibration-layer")
    dt = _dtype(dtype_name)
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

    sec = _timed(step, backend.synchronize, min_time=min_time, max_reps=max_reps, warmup=2)
    tok = b * S
    flops = 6.0 * tok * cfg.params_per_layer() + 12.0 * S * tok * heads * cfg.head_dim
    return flops / sec


def _head_flops(backend, dtype_name: str, vocab: int, hidden: int, tokens: int, min_time: float,
                max_reps: int) -> float:
    """Sustained FLOP/s (``6 * tokens * V * H``) of the trainer's head path: final RMSNorm,
    ``lm_head`` and ``causal_lm_loss_sum`` (fp32 log-softmax + NLL), forward + backward."""
    import torch

    from npu_train.model.llama import RMSNorm, causal_lm_loss_sum

    dt = _dtype(dtype_name)
    dev = backend.device()
    with backend.alloc_lock():
        norm = RMSNorm(hidden).to(dtype=dt).to(dev)
        head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype=dt).to(dev)
        x = torch.randn(1, tokens, hidden, dtype=dt, device=dev, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens), device=dev)

    def step() -> None:
        with backend.alloc_lock():
            loss, _ = causal_lm_loss_sum(head(norm(x)).float(), labels)
            loss.backward()

    sec = _timed(step, backend.synchronize, min_time=min_time, max_reps=max_reps, warmup=2)
    return 6.0 * tokens * vocab * hidden / sec


def _matmul_flops(backend, dtype_name: str, n: int, min_time: float, max_reps: int) -> float:
    import torch

    dt = _dtype(dtype_name)
    dev = backend.device()
    with backend.alloc_lock():
        a = torch.randn(n, n, dtype=dt, device=dev)
        b = torch.randn(n, n, dtype=dt, device=dev)

    def mm() -> None:
        with backend.alloc_lock():
            a @ b

    sec = _timed(mm, backend.synchronize, min_time=min_time, max_reps=max_reps, warmup=2)
    return 2.0 * n ** 3 / sec


def _copy_bandwidth(backend, dtype_name: str, nbytes: int, min_time: float,
                    max_reps: int) -> tuple[float, float]:
    """(host->device, device->host) bytes/s for one ``nbytes`` tensor."""
    import torch

    dt = _dtype(dtype_name)
    elem = torch.empty((), dtype=dt).element_size()
    host = torch.randn(max(1, nbytes // elem), dtype=torch.float32).to(dt)
    nb = host.numel() * elem
    dev_t = [backend.upload(host)]
    backend.synchronize()

    def up() -> None:
        dev_t[0] = backend.upload(host)  # the previous copy is freed, as in the trainer

    def down() -> None:
        backend.download(dev_t[0])

    t_up = _timed(up, backend.synchronize, min_time=min_time, max_reps=max_reps)
    t_down = _timed(down, backend.synchronize, min_time=min_time, max_reps=max_reps)
    return nb / t_up, nb / t_down


def _adamw_rate(device, n_params: int, min_time: float, max_reps: int, backend=None) -> float:
    """fp32 AdamW params/s: fused on cpu/cuda, one tensor at a time elsewhere (as StageOptimizer)."""
    import torch

    n_t = 8
    per = max(1, n_params // n_t)
    lock = backend.alloc_lock if backend is not None else None
    with (lock() if lock else _null()):
        params = [torch.nn.Parameter(torch.randn(per, device=device)) for _ in range(n_t)]
        for p in params:
            p.grad = torch.randn(per, device=device) * 1e-3
    kw = {"fused": True} if torch.device(device).type in ("cpu", "cuda") else {"foreach": False}
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **kw)
    sync = backend.synchronize if backend is not None else (lambda: None)

    def step() -> None:
        with (lock() if lock else _null()):
            opt.step()

    sec = _timed(step, sync, min_time=min_time, max_reps=max_reps, warmup=2)
    return per * n_t / sec


def _stage_optimizer_rate(backend, n_params: int, min_time: float, max_reps: int) -> float:
    """params/s of ``StageOptimizer.step`` over resident parameters on the card: the trainer's
    device-optimizer path (gradient scaling, AdamW as the trainer configures it for the device,
    refresh of the compute weights; fp32 weights as on cpu, the planner dtype elsewhere)."""
    import torch

    from npu_train.optim.adamw import StageOptimizer

    n_t = 8
    per = max(1, n_params // n_t)
    dt = _dtype(_planner_dtype(backend.kind))
    masters = {f"w{i}": torch.randn(per // 64 or 1, 64) for i in range(n_t)}
    params = {}
    with backend.alloc_lock():
        for n, m in masters.items():
            params[n] = torch.nn.Parameter(backend.upload(m.to(dt)))
            params[n].grad = backend.upload((m * 1e-3).to(dt))
    opt = StageOptimizer(params, masters, list(params), backend, lr=1e-4)
    secs: list[float] = []

    def step() -> None:
        secs.append(opt.step(1e-4, 0.5)["device_optimizer"])

    _timed(step, lambda: None, min_time=min_time, max_reps=max_reps, warmup=2)
    return sum(m.numel() for m in masters.values()) / median(secs[2:] or secs)


#: figures that must not drop when threads are added (else the measurement was disturbed)
_MONOTONE = ("device_flops", "head_flops", "host_adamw_params_per_s", "device_adamw_params_per_s")


def _slower(m: dict, lower: dict) -> list[str]:
    """Names of the compute-bound figures of ``m`` below those of ``lower`` (fewer threads)."""
    return [k for k in _MONOTONE if m[k] < lower[k]]


def _best_of(a: dict, b: dict, kind: str, only=None) -> dict:
    """Per-figure maximum of two measurements at the same thread count (``only``: just these,
    plus what derives from them)."""
    out = dict(a)
    keys = only or (*_MONOTONE, "h2d_bytes_per_s", "d2h_bytes_per_s")
    for k in keys:
        out[k] = max(a[k], b[k])
    if only is None or "device_flops" in only:
        out["flops_by_dtype"] = {d: max(v, b["flops_by_dtype"].get(d, 0.0))
                                 for d, v in a["flops_by_dtype"].items()}
        out["flops_by_dtype"][_planner_dtype(kind)] = out["device_flops"]
    out["head_flops_ratio"] = out["head_flops"] / out["device_flops"]
    return out


def _note_load(m: dict) -> None:
    try:
        m["loadavg_1"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_BASELINE_CODE = r"""
import gc, json, os, socket, sys
import psutil
import torch
torch.set_num_threads(int(sys.argv[1]))
import msgpack, zmq
import torch.distributed as dist
import npu_train.runtime.worker, npu_train.backends, npu_train.optim.adamw, npu_train.pipeline.stage
import npu_train.model.llama, npu_train.model.loading, npu_train.data.dataset
import npu_train.checkpoint.store, npu_train.transport
from npu_train.backends import make_backend
be = make_backend("cpu"); be.setup()
x = torch.ones(64, 64); (x @ x).sum()             # first op: thread pools, kernels
ctx = zmq.Context(); s = ctx.socket(zmq.DEALER)
with socket.socket() as so:
    so.bind(("127.0.0.1", 0)); port = so.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.ones(4); dist.all_reduce(t)
path = sys.argv[2] if len(sys.argv) > 2 else ""
touched = 0
if path:
    from npu_train.model.loading import load_config, resolve_model_path, _gguf_reader, _is_gguf_path
    p = resolve_model_path(path)
    load_config(p)
    if _is_gguf_path(p):
        import numpy as np
        data = _gguf_reader(p).data                # np.memmap of the whole file, kept cached
        step = data[::4096]
        touched = int(step.size) * 4096 if int(np.add.reduce(step, dtype=np.uint64)) >= 0 else 0
gc.collect()
rss = psutil.Process().memory_info().rss
dist.destroy_process_group()
print(json.dumps({"rss": rss, "touched": touched}))
"""


def measure_process_baseline(model_path: Optional[str] = None, threads: int = 1,
                             timeout: float = 120.0) -> int:
    """RSS (bytes) of a fresh card-like process before model state (see the module docstring).

    Runs ``sys.executable`` with ``src`` on ``PYTHONPATH``; raises ``RuntimeError`` with the
    subprocess's stderr when it fails.
    """
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src] + [p for p in [env.get("PYTHONPATH")] if p])
    args = [sys.executable, "-c", _BASELINE_CODE, str(int(threads))]
    if model_path:
        args.append(str(model_path))
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"process-baseline measurement failed (exit {out.returncode}): "
                           f"{out.stderr.strip()[-2000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return int(json.loads(line)["rss"])


# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
def _reference_shapes(kind: str, quick: bool, model_cfg) -> tuple[tuple, tuple, str]:
    """(layer dims, (vocab, hidden, tokens) of the head, description) for the FLOP/s benchmarks:
    the model's own layer and head when ``model_cfg`` is given and one repetition stays within
    ``_FLOP_BUDGET``, else the per-kind reference."""
    if quick:
        H, I, a, kv, b, S = _LAYER_QUICK
        return _LAYER_QUICK, (_HEAD_QUICK[0], _HEAD_QUICK[1], b * S), "quick"
    H, I, a, kv, b, S = _LAYER[kind]
    tok = b * S
    layer, head, what = _LAYER[kind], (_HEAD[kind][0], _HEAD[kind][1], tok), "reference"
    if model_cfg is not None:
        m = model_cfg
        if 6.0 * tok * m.params_per_layer() <= _FLOP_BUDGET[kind] and m.head_dim * m.num_heads > 0:
            layer = (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, b, S)
            what = f"model {m.name}"
        if 6.0 * tok * m.vocab_size * m.hidden_size <= 4 * _FLOP_BUDGET[kind]:
            head = (m.vocab_size, m.hidden_size, tok)
    return layer, head, what


def _measure_at(kind: str, backend, quick: bool, model_cfg=None) -> dict:
    """All rate figures of ``kind`` at the current torch thread count."""
    import torch

    min_time = 0.02 if quick else 0.6
    max_reps = 3 if quick else 50
    dims, head_shape, what = _reference_shapes(kind, quick, model_cfg)
    n_mm = 128 if quick else _MATMUL_N[kind]
    nbytes = 1_000_000 if quick else COPY_BYTES
    n_adamw = 200_000 if quick else _ADAMW_PARAMS
    main = _planner_dtype(kind)
    out: dict = {"flops_by_dtype": {}, "matmul_flops_by_dtype": {},
                 "shapes": {"layer_H_I_heads_kv_b_s": list(dims),
                            "head_V_H_tokens": list(head_shape), "source": what}}
    for dt in (main, "bf16" if main == "fp32" else "fp32"):
        try:
            out["flops_by_dtype"][dt] = _layer_flops(backend, dt, dims, min_time, max_reps)
            out["matmul_flops_by_dtype"][dt] = _matmul_flops(backend, dt, n_mm, min_time, max_reps)
        except Exception as exc:  # noqa: BLE001 - the second dtype is optional (e.g. fp32 on RNGD)
            if dt == main:
                raise
            out.setdefault("errors", {})[dt] = f"{type(exc).__name__}: {exc}"[:300]
    out["device_flops"] = out["flops_by_dtype"][main]
    head = _head_flops(backend, main, *head_shape, min_time=min_time, max_reps=max_reps)
    out["head_flops"] = head
    out["head_flops_ratio"] = head / out["device_flops"]
    out["h2d_bytes_per_s"], out["d2h_bytes_per_s"] = _copy_bandwidth(
        backend, main, nbytes, min_time, max_reps)
    out["host_adamw_params_per_s"] = _adamw_rate(torch.device("cpu"), n_adamw, min_time, max_reps)
    n_dev = n_adamw if kind != "furiosa" else max(1, n_adamw // 5)
    out["device_adamw_params_per_s"] = _stage_optimizer_rate(backend, n_dev, min_time, max_reps)
    return out


def calibrate(kind: str, index: Optional[int] = None, *, quick: bool = False,
              model_path: Optional[str] = None, threads: Optional[list[int]] = None) -> Rates:
    """Measure :class:`Rates` of card kind ``kind`` (``"cpu"``, ``"cuda"``, ``"furiosa"``) on this
    machine, through the backend of card ``index`` (default 0; ignored for cpu).

    Args:
        quick: tiny sizes and few repetitions (tests); figures are positive but not meaningful.
        model_path: the model the profile is for. Its decoder layer and lm_head shapes are used
            for the FLOP/s benchmarks when one repetition stays small (else reference shapes), and
            on cpu opening its file (as a card process does) is part of
            ``process_baseline_bytes``. ``None``: reference shapes, imports/runtime only.
        threads: cpu only: torch thread counts to measure (default :func:`thread_counts`); the
            largest goes to the top level, the others to ``by_threads``.

    Returns:
        The measured :class:`Rates`. Its attribute ``calibration`` (not a dataclass field) holds
        the details :func:`save_profile` records: per-thread figures, matmul FLOP/s, machine info,
        seconds spent.
    """
    import torch

    from npu_train.backends import make_backend

    if kind == "rngd":
        kind = "furiosa"
    if kind not in KINDS:
        raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")
    t0 = time.perf_counter()
    entry = "cpu" if kind == "cpu" else f"{kind}:{0 if index is None else int(index)}"
    backend = make_backend(entry)
    backend.setup()
    details: dict = {"kind": kind, "card": backend.name, "quick": bool(quick),
                     "planner_dtype": _planner_dtype(kind)}
    model_cfg = None
    if model_path:
        from npu_train.model.loading import load_config, resolve_model_path

        model_cfg = load_config(resolve_model_path(model_path))
        details["model"] = {"path": str(model_path), "name": model_cfg.name}
    if kind == "cpu":
        counts = sorted({int(t) for t in (threads or thread_counts())})
        if quick:
            counts = counts[:1] if threads is None else counts
        old = torch.get_num_threads()
        per: dict[int, dict] = {}
        try:
            # most threads first: they suffer most from other load (an OpenMP team stalls
            # when one of its threads is descheduled), so they go first, right after start-up
            for t in sorted(counts, reverse=True):
                torch.set_num_threads(t)
                per[t] = _measure_at(kind, backend, quick, model_cfg)
                _note_load(per[t])
            for t in counts:
                prev = [u for u in per if u < t]
                if not prev or quick:
                    continue
                lower = per[max(prev)]
                if not _slower(per[t], lower):
                    continue
                # more threads but slower: disturbed by other load. The figures wanted are what
                # the machine does for the job alone: re-measure a few times, keep the best of
                # each figure.
                torch.set_num_threads(t)
                for _ in range(_RETRIES):
                    time.sleep(2.0)
                    again = _measure_at(kind, backend, quick, model_cfg)
                    _note_load(again)
                    per[t] = _best_of(per[t], again, kind)
                    if not _slower(per[t], lower):
                        break
                bad = _slower(per[t], lower)
                if bad:
                    # keep a lower bound instead: t threads are at least as fast as fewer
                    details.setdefault("warnings", []).append(
                        f"{t} threads measured slower than {max(prev)} for {', '.join(bad)} "
                        "(other load on the machine?): the lower thread count's figures are used "
                        "for those (a lower bound); rerun calibration on an idle machine")
                    per[t] = _best_of(per[t], lower, kind, only=bad)
                    per[t]["disturbed"] = bad
        finally:
            torch.set_num_threads(old)
        top_t = max(per)
        top = per[top_t]
        baseline_threads = min(counts)
        try:
            baseline = measure_process_baseline(model_path, baseline_threads)
            details["process_baseline"] = {"model_path": model_path, "threads": baseline_threads,
                                           "rss_bytes": baseline}
        except Exception as exc:  # noqa: BLE001 - keep the other figures, report the failure
            baseline = DEFAULT_RATES["cpu"].process_baseline_bytes
            details["process_baseline"] = {"error": str(exc)[:2000], "used_default": baseline}
        by_threads = {t: _rate_fields(v) for t, v in per.items() if t != top_t}
        details["by_threads"] = {str(t): v for t, v in per.items()}
    else:
        top_t = 0
        top = _measure_at(kind, backend, quick, model_cfg)
        baseline = 0
        by_threads = {}
        details["measured"] = top
    rates = Rates(
        device_flops=top["device_flops"], h2d_bytes_per_s=top["h2d_bytes_per_s"],
        d2h_bytes_per_s=top["d2h_bytes_per_s"],
        host_adamw_params_per_s=top["host_adamw_params_per_s"],
        device_adamw_params_per_s=top["device_adamw_params_per_s"],
        head_flops_ratio=top["head_flops_ratio"],
        process_baseline_bytes=float(baseline), threads=top_t,
        flops_by_dtype=dict(top["flops_by_dtype"]), by_threads=by_threads,
    )
    for k in ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s"):
        v = getattr(rates, k)
        if not (v > 0 and math.isfinite(v)):
            raise RuntimeError(f"calibration of {kind}: {k}={v!r} is not a positive number")
    details["machine"] = machine_info(kind, backend)
    details["seconds"] = round(time.perf_counter() - t0, 2)
    rates.calibration = details  # type: ignore[attr-defined]
    return rates


def _rate_fields(m: dict) -> dict:
    keys = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
            "device_adamw_params_per_s", "head_flops_ratio")
    out = {k: float(m[k]) for k in keys}
    out["flops_by_dtype"] = {k: float(v) for k, v in m["flops_by_dtype"].items()}
    return out


def save_profile(kind: str, rates: Rates, path: Union[str, os.PathLike, None] = None,
                 *, details: Optional[dict] = None) -> Path:
    """Write ``rates`` as a calibration profile that :func:`~npu_train.optim.placement.load_rates`
    reads (``{"rates": {...}}``), with the machine facts and measurement details of
    ``details`` (default: ``rates.calibration`` when :func:`calibrate` made it, else machine info
    only). Atomic (temp file + rename); creates the directory. Returns the path."""
    path = Path(path) if path is not None else calibration_path(kind)
    det = details if details is not None else getattr(rates, "calibration", None)
    if det is None:
        det = {"machine": machine_info(kind)}
    r = {
        "device_flops": rates.device_flops,
        "h2d_bytes_per_s": rates.h2d_bytes_per_s,
        "d2h_bytes_per_s": rates.d2h_bytes_per_s,
        "host_adamw_params_per_s": rates.host_adamw_params_per_s,
        "device_adamw_params_per_s": rates.device_adamw_params_per_s,
        "head_flops_ratio": rates.head_flops_ratio,
        "process_baseline_bytes": int(rates.process_baseline_bytes),
        "threads": int(rates.threads),
        "flops_by_dtype": dict(rates.flops_by_dtype),
        "by_threads": {str(t): v for t, v in rates.by_threads.items()},
    }
    doc = {
        "version": PROFILE_VERSION,
        "kind": kind,
        "created": det.get("machine", {}).get("date")
        or _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "units": {"device_flops": "FLOP/s (forward+backward of a decoder layer)",
                  "*_bytes_per_s": "B/s", "*_params_per_s": "fp32 params/s",
                  "process_baseline_bytes": "B (process RSS)"},
        "rates": r,
        "machine": det.get("machine", {}),
        "details": {k: v for k, v in det.items() if k != "machine"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    return path


def _parse_kind(entry: str) -> tuple[str, Optional[int]]:
    entry = str(entry).strip()
    kind, _, idx = entry.partition(":")
    kind = "furiosa" if kind == "rngd" else kind
    index = int(idx) if idx.isdigit() else None
    return kind, index


def _fmt_rates(kind: str, r: Rates) -> list[str]:
    rows = [f"  {'threads':<26} {r.threads or '-'}"]
    rows.append(f"  {'device_flops':<26} {r.device_flops / 1e9:10.1f} GFLOP/s (training, "
                + ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(r.flops_by_dtype.items())) + ")")
    mm = (getattr(r, "calibration", {}) or {}).get("by_threads", {}).get(str(r.threads)) \
        or (getattr(r, "calibration", {}) or {}).get("measured") or {}
    if mm.get("matmul_flops_by_dtype"):
        rows.append(f"  {'matmul (not used)':<26} "
                    + ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(mm["matmul_flops_by_dtype"].items()))
                    + " GFLOP/s")
    rows += [
        f"  {'head_flops_ratio':<26} {r.head_flops_ratio:10.2f} (lm_head + loss vs layers)",
        f"  {'h2d_bytes_per_s':<26} {r.h2d_bytes_per_s / 1e9:10.2f} GB/s",
        f"  {'d2h_bytes_per_s':<26} {r.d2h_bytes_per_s / 1e9:10.2f} GB/s",
        f"  {'host_adamw_params_per_s':<26} {r.host_adamw_params_per_s / 1e6:10.1f} M params/s",
        f"  {'device_adamw_params_per_s':<26} {r.device_adamw / 1e6:10.1f} M params/s",
    ]
    if kind == "cpu":
        rows.append(f"  {'process_baseline_bytes':<26} {gib(r.process_baseline_bytes):10.3f} GiB")
        for t, e in sorted(r.by_threads.items(), key=lambda kv: int(kv[0])):
            rows.append(f"  at {t} thread(s): {e['device_flops'] / 1e9:.1f} GFLOP/s, h2d "
                        f"{e['h2d_bytes_per_s'] / 1e9:.2f} GB/s, d2h {e['d2h_bytes_per_s'] / 1e9:.2f}"
                        f" GB/s, AdamW {e['host_adamw_params_per_s'] / 1e6:.1f} M params/s")
    return rows


def main_calibrate(kinds: list[str], *, quick: bool = False, model_path: Optional[str] = "embedded",
                   profile: Union[str, os.PathLike, None] = None) -> list[str]:
    """Calibrate every distinct kind in ``kinds`` (``"cpu"``, ``"cuda:1"``, ``"furiosa:0"``...;
    the first index given for a kind is the card measured), print the measured rates and where
    they were saved, and return the saved paths.

    ``model_path`` (default the embedded SmolLM2): the job's ``model.path``; its layer and head
    shapes are benchmarked and its file reader is part of the cpu process baseline (``None``:
    reference shapes, imports only). ``profile``: write to this path instead of the default (only
    with a single kind).
    """
    seen: dict[str, Optional[int]] = {}
    for k in kinds:
        kind, idx = _parse_kind(k)
        if kind not in KINDS:
            raise ValueError(f"card kind must be one of {KINDS}, got {k!r}")
        if kind not in seen or (seen[kind] is None and idx is not None):
            seen[kind] = idx
    if profile is not None and len(seen) > 1:
        raise ValueError(f"one profile path for {len(seen)} kinds ({sorted(seen)}): calibrate one "
                         "kind at a time or use the default paths")
    saved = []
    for kind, idx in seen.items():
        print(f"calibrating {kind}{'' if idx is None else f':{idx}'}"
              f"{' (quick)' if quick else ''} ...", flush=True)
        r = calibrate(kind, idx, quick=quick, model_path=model_path)
        path = save_profile(kind, r, profile)
        det = getattr(r, "calibration", {})
        print(f"{kind}: measured in {det.get('seconds', 0):.1f} s on "
              f"{det.get('machine', {}).get('cpu_model', '?')}"
              + (f" / {det['machine']['device']}" if det.get("machine", {}).get("device") else ""))
        for row in _fmt_rates(kind, r):
            print(row)
        for w in det.get("warnings", []):
            print(f"  warning: {w}")
        if "error" in det.get("process_baseline", {}):
            print(f"  warning: process baseline not measured ({det['process_baseline']['error'][:200]}); "
                  "default used")
        check = load_rates(kind, path)
        assert math.isclose(check.device_flops, r.device_flops)
        print(f"  saved to {path}", flush=True)
        saved.append(str(path))
    return saved
