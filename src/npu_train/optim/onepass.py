"""One-pass host AdamW of offloaded tensors: gradient (fp32 or bf16) in, clip, AdamW, compute-dtype copy out.

:func:`adamw_onepass` updates a ``torch.optim.AdamW``'s fp32 parameters and state in place with the C kernel
``host_adamw.c`` (one sweep, 28 B/param with bf16 gradient and copy; experiments/2026-12-06-host-optimizer.md),
bit-identical to ``torch.optim.AdamW(fused=True)`` on an AVX2/AVX512 build of torch applied to
``grad.float() * clip`` (``tests/unit/test_onepass_adamw.py``). The kernel is compiled at first use with the
system C compiler (``$CC``, else ``cc``) into ``cache_dir("kernels")`` and loaded with ctypes; without a
compiler the same call runs the old steps (conversion, clip, torch's fused AdamW, cast): exact, about half
the speed, said once in a warning (:func:`kernel_status`).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch

from npu_train.env import cache_dir

__all__ = ["adamw_onepass", "stream_probe", "kernel_status", "KernelStatus", "SOURCE", "CFLAGS", "OUT_KINDS"]

#: the kernel's source file, shipped as package data (pyproject ``[tool.setuptools.package-data]``)
SOURCE = "host_adamw.c"
#: compiler flags: only the source's explicit fmaf calls fuse (torch's operation order, see the source)
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread")
#: extra flags tried in this order until the compiler accepts them: this CPU's vector units (fmaf in hardware)
#: and no vectorized epilogue loops (a third of the compile time of -O3; the tails are short)
EXTRA_FLAGS = (("-march=native", "--param", "vect-epilogues-nomask=0"), ("-march=native",), ())
#: compute dtype of the copy out -> the kernel's ``out_kind`` (0: no copy, the master is the copy)
OUT_KINDS = {torch.bfloat16: 1, torch.float32: 0}
#: torch CPU builds with fma whose fused AdamW the kernel matches bit for bit -> (float vector width, width of
#: the compiler's vectorized epilogue in torch's scalar tail, which rounds like the body; 0: none)
_FMA_BUILDS = {"AVX512": (16, 8), "AVX2": (8, 0)}


def scalar_tail_from(n: int, capability: str) -> int:
    """Index from which torch's fused CPU AdamW of ``n`` elements takes its scalar-tail rounding on a torch build
    of ``capability`` (``torch.backends.cpu.get_cpu_capability()``): the last ``n % width`` elements, less an
    epilogue of ``8`` on AVX512 when the tail has 8 or more (measured: ``tests/unit/test_onepass_adamw.py``);
    ``n`` on builds without fma (every element rounds alike there)."""
    if capability not in _FMA_BUILDS:
        return n
    width, epi = _FMA_BUILDS[capability]
    tail = n % width
    return n - tail + (epi if epi and tail >= epi else 0)

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGTYPES = [_P, _P, _P, _P, _I, _P, _I, _L, _F, _I, _F, _I, _F, _F, _F, _F, _F, _F, _L, _I, _I]


@dataclass(frozen=True)
class KernelStatus:
    """Whether the one-pass kernel is in use: ``path`` of the loaded library, or ``None`` and ``reason``."""

    path: Optional[Path]
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.path is not None


_lock = threading.Lock()
_loaded: dict = {}  # "status" -> KernelStatus, "fn" -> ctypes function


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _library_path(src: bytes, cc: list[str]) -> Path:
    key = hashlib.sha256(b"\0".join([src, " ".join(cc).encode(), " ".join(CFLAGS).encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir("kernels") / f"host_adamw-{key}.so"


def _compile(src_path: Path, out: Path, cc: list[str]) -> None:
    """Compile ``src_path`` to ``out`` (atomic rename: card processes may race); raises OSError/CalledProcessError."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem, suffix=".so.tmp", dir=out.parent)
    os.close(fd)
    try:
        err = ""
        for extra in EXTRA_FLAGS:
            r = subprocess.run([*cc, *CFLAGS, *extra, "-o", tmp, str(src_path), "-lm"],
                               capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(tmp, out)
                return
            err = (r.stderr or r.stdout).strip().splitlines()[-1:] or [f"exit {r.returncode}"]
            err = err[0]
        raise OSError(f"{' '.join(cc)} failed: {err}")
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load() -> KernelStatus:
    src_file = resources.files("npu_train.optim").joinpath(SOURCE)
    cc = _compiler()
    try:
        src = src_file.read_bytes()
        path = _library_path(src, cc)
        if not path.is_file():
            with resources.as_file(src_file) as sp:
                _compile(Path(sp), path, cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return KernelStatus(None, f"{type(exc).__name__}: {exc}")
    fn = lib.npt_adamw_onepass
    fn.argtypes, fn.restype = _ARGTYPES, _I
    _loaded["fn"] = fn
    probe = lib.npt_stream_probe
    probe.argtypes, probe.restype = [_P, _P, _P, _P, _I, _P, _I, _L, _I], _I
    _loaded["probe"] = probe
    return KernelStatus(path)


def kernel_status() -> KernelStatus:
    """The one-pass kernel, compiled (once per machine, compiler and source) and loaded on the process's first
    call; without it one warning says the update falls back to torch's fused AdamW and runs slower."""
    with _lock:
        st = _loaded.get("status")
        if st is None:
            st = _load()
            if not st.ok:
                warnings.warn(f"host AdamW: the one-pass C kernel is not available ({st.reason}); using "
                              "torch's fused AdamW with separate conversion, clip and cast passes (same "
                              "results, about half the speed); fix: install a C compiler (cc, or set CC)",
                              RuntimeWarning, stacklevel=3)
            _loaded["status"] = st
        return st


def _f32(x: float) -> float:
    """``x`` rounded to float32 (as torch's kernel casts its double scalars)."""
    return ctypes.c_float(x).value


def _state(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict:
    """``opt``'s state of ``p``, created as ``torch.optim.AdamW(fused=True)`` creates it in its first step."""
    st = opt.state[p]
    if not st:
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def _kernel_ok(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    d = opt.defaults
    if d.get("amsgrad") or d.get("maximize") or d.get("differentiable"):
        return False
    return all(p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() for p in params)


def _grad_for_kernel(g: Optional[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    if g is None:
        return torch.zeros_like(p)
    g = g.detach().to("cpu")
    if g.dtype not in (torch.float32, torch.bfloat16):
        g = g.float()
    if g.numel() != p.numel():
        raise ValueError(f"adamw_onepass: gradient of {g.numel()} elements for a parameter of {p.numel()}")
    return g.contiguous().view(-1)


def _kernel_step(fn, group: dict, p: torch.Tensor, st: dict, g: torch.Tensor, clip: float,
                 out: Optional[torch.Tensor], threads: int) -> None:
    """One tensor's update; the scalars exactly as torch's fused CPU kernel computes them (double, then float)."""
    lr, (b1, b2), eps, wd = float(group["lr"]), group["betas"], float(group["eps"]), float(group["weight_decay"])
    st["step"] += 1
    step = float(st["step"].item())
    bc1, bc2 = 1 - math.pow(b1, step), 1 - math.pow(b2, step)
    n = p.numel()
    cap = torch.backends.cpu.get_cpu_capability()
    rc = fn(p.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(), g.data_ptr(),
            int(g.dtype == torch.bfloat16), None if out is None else out.data_ptr(),
            0 if out is None else OUT_KINDS[out.dtype], n, _f32(clip), int(clip != 1.0), _f32(1 - lr * wd),
            int(wd != 0), _f32(1 - b1), _f32(b2), _f32(1 - b2), _f32(math.sqrt(bc2)), _f32(eps),
            -_f32(lr / bc1), scalar_tail_from(n, cap), int(cap in _FMA_BUILDS), max(1, int(threads)))
    if rc != 0:  # threads that could not start: their share ran on the calling thread (still correct)
        warnings.warn("host AdamW: could not start worker threads; ran on one", RuntimeWarning, stacklevel=3)


def _torch_step(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                clip: float, out_dtype: torch.dtype) -> list[torch.Tensor]:
    """The steps the kernel replaces: fp32 gradient, clip (skipped at 1.0: x * 1.0 == x), AdamW, cast."""
    for p, g in zip(params, grads):
        if g is None:
            p.grad = torch.zeros_like(p)
            continue
        g = g.detach().float()  # no copy when already fp32 (the caller hands over its gradient)
        p.grad = g.mul_(clip) if clip != 1.0 else g
    opt.step()
    outs = []
    for p in params:
        p.grad = None
        outs.append(p.detach().to(out_dtype))
    return outs


def adamw_onepass(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                  clip_coef: float, out_dtype: torch.dtype, threads: Optional[int] = None,
                  use_kernel: Optional[bool] = None) -> list[torch.Tensor]:
    """One AdamW step of ``params`` (fp32 CPU tensors of ``opt``, a ``torch.optim.AdamW``) with gradients ``grads``
    (fp32 or bf16, any device, ``None``: zeros) times ``clip_coef``; returns each updated parameter in
    ``out_dtype`` (``torch.float32``: the parameter itself). ``opt``'s state (``step``, ``exp_avg``,
    ``exp_avg_sq``) is created and advanced as ``torch.optim.AdamW(fused=True)`` does it, so checkpoints and a
    later ``opt.step()`` see no difference. ``threads``: the kernel's threads (default
    ``torch.get_num_threads()``). ``use_kernel``: False forces the torch path (None: the kernel when
    :func:`kernel_status` is ok and the group is plain fp32 AdamW). An fp32 CPU gradient may be scaled in place
    (torch path, clip != 1)."""
    params, grads = list(params), list(grads)
    if len(params) != len(grads):
        raise ValueError(f"adamw_onepass: {len(params)} parameters, {len(grads)} gradients")
    if use_kernel and not kernel_status().ok:
        raise RuntimeError(f"adamw_onepass: use_kernel=True but the kernel is not available ({kernel_status().reason})")
    want = kernel_status().ok if use_kernel is None else bool(use_kernel)
    if not (want and out_dtype in OUT_KINDS and _kernel_ok(opt, params)):
        return _torch_step(opt, params, grads, float(clip_coef), out_dtype)
    fn = _loaded["fn"]
    group_of = {id(p): grp for grp in opt.param_groups for p in grp["params"]}
    nthreads = torch.get_num_threads() if threads is None else int(threads)
    outs = []
    with torch.no_grad():
        for p, g in zip(params, grads):
            grp = group_of.get(id(p))
            if grp is None:
                raise ValueError("adamw_onepass: a parameter is not in the optimizer's groups")
            out = None if out_dtype == torch.float32 else torch.empty(p.shape, dtype=out_dtype)
            _kernel_step(fn, grp, p, _state(opt, p), _grad_for_kernel(g, p), float(clip_coef), out, nthreads)
            outs.append(p if out is None else out)
    return outs


def stream_probe(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, out: Optional[torch.Tensor],
                 threads: int = 1) -> None:
    """The memory traffic of one :func:`adamw_onepass` update of ``p`` without its arithmetic, through the same
    kernel's threads: ``g`` (fp32 or bf16) read, ``p``, ``m``, ``v`` (fp32, contiguous, ``g``'s element count)
    read and written in place (each ``+= g``), ``out`` (bf16 or fp32, or None) written. Its seconds are the
    bandwidth limit of that update on this host: 28 B/param with a bf16 gradient and copy, as the update's.
    Raises RuntimeError without the kernel (:func:`kernel_status`)."""
    if not kernel_status().ok:
        raise RuntimeError(f"stream_probe: the kernel is not available ({kernel_status().reason})")
    n = p.numel()
    for t in (p, m, v):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != n or t.device.type != "cpu":
            raise ValueError("stream_probe: p, m and v must be contiguous fp32 CPU tensors of one size")
    if g.dtype not in (torch.float32, torch.bfloat16) or not g.is_contiguous() or g.numel() != n:
        raise ValueError("stream_probe: g must be a contiguous fp32 or bf16 tensor of p's size")
    if out is not None and (out.dtype not in OUT_KINDS or not out.is_contiguous() or out.numel() != n):
        raise ValueError("stream_probe: out must be a contiguous bf16 or fp32 tensor of p's size")
    kind = 0 if out is None else (1 if out.dtype == torch.bfloat16 else 2)
    _loaded["probe"](p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), int(g.dtype == torch.bfloat16),
                     None if out is None else out.data_ptr(), kind, n, max(1, int(threads)))
