"""Host AdamW of offloaded layers (ZeRO-Offload, Ren et al. 2021), per layer in forward order.

:class:`HostUpdater` downloads each final gradient, runs AdamW on the fp32 host masters and uploads
the cast weights: inline, ``overlap`` (one background thread, bit-identical) or ``delayed`` (DPU, one
update stale, no resume). The update of each tensor is one pass over memory (gradient in, clip, AdamW,
compute-dtype copy out: :mod:`npu_train.optim.onepass`). Modes, invariants and threads: docs/design.md §17.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from npu_train.hardware import HOST_MEMORY_KINDS
from npu_train.optim.onepass import adamw_onepass, kernel_status


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


#: elements per row of :func:`squared_sum`'s per-row norms (accurate fp32 reductions, see there)
SQ_ROW = 512
#: device types where :func:`squared_sum` takes the per-row route (eager kernels; other kinds run
#: compiled graphs, which keep the plain reduction their warm-up compiled, npu_train.runtime.warmup)
SQ_ROW_DEVICES = ("cpu", "cuda")


def squared_sum(t: torch.Tensor) -> torch.Tensor:
    """``sum(t**2)`` of ``t`` (any shape/float dtype), a 0-dim fp32 tensor on ``t``'s device. On cpu/cuda:
    512-element row norms summed in fp64, ~5x faster than ``pow(2).sum()``, relative error <= 7e-8
    (experiments/2026-12-01-bench-run8.md)."""
    t = t.detach()
    if t.device.type not in SQ_ROW_DEVICES:
        return t.float().pow(2).sum()
    f = t.reshape(-1)
    if f.dtype != torch.float32:
        f = f.float()
    m = f.numel() // SQ_ROW * SQ_ROW
    tail = f[m:]
    total = torch.dot(tail, tail).double()
    if m:
        total = total + torch.linalg.vector_norm(f[:m].view(-1, SQ_ROW), dim=1).double().square().sum()
    return total.float()


class HostUpdater:
    """Host AdamW + upload of a stage's offloaded parameters. ``params``: ``{hf_name: card parameter}``;
    ``groups``: ``[(layer_key, [hf_name, ...])]`` in forward order; ``optimizers``: ``{layer_key: _Group}``
    (fp32 CPU masters); ``delayed`` needs ``overlap``."""

    def __init__(self, params: dict, groups: list, optimizers: dict, backend, *, overlap: bool,
                 delayed: bool = False):
        self.params, self.groups, self.optimizers, self.backend = params, groups, optimizers, backend
        self.overlap, self.delayed = bool(overlap), bool(delayed) and bool(overlap)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="host-adamw") if self.overlap else None
        #: the update takes an fp32 gradient on a host-memory card itself, not a copy (why safe: docs/design.md §17)
        self.in_place = getattr(backend, "kind", None) in HOST_MEMORY_KINDS and not self.delayed
        self._dl: dict[str, tuple] = {}  # name -> (future of (host fp32 grad | None, sq), (data_ptr, version))
        self._layer: dict[str, Future] = {}  # layer key -> its pending update
        self._staged: dict[str, torch.Tensor] = {}  # delayed: name -> compute-dtype host weights to upload
        self.timeline: list = []  # the last finished update: [(layer, start, adamw_end, upload_end)] perf_counter s
        self.update_start = self._next_start = 0.0  # perf_counter s: the collected / the queued update
        self.wait_s = 0.0  # seconds the main thread blocked on pending updates since the last take_stats()
        if groups:
            kernel_status()  # compile the one-pass kernel now (once per machine), not inside the first step

    def _submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            return _done(fn(*args))
        return self._pool.submit(fn, *args)

    # ------------------------------------------------------------------ gradients
    def _fetch(self, g: Optional[torch.Tensor]):
        """Download ``g`` -> (host copy, fp32 or bf16 as on the card (other dtypes: fp32), its fp32 squared sum);
        :attr:`in_place`: an fp32 CPU ``g`` itself."""
        if g is None:
            return None, torch.zeros((), dtype=torch.float32)
        if self.in_place and g.dtype == torch.float32 and g.device.type == "cpu":
            hg = g.detach()
            return hg, squared_sum(hg)
        hg = self.backend.download(g.detach())
        if hg.data_ptr() == g.data_ptr():  # never alias the card's accumulator (reused next step)
            hg = hg.clone()
        if hg.dtype not in (torch.float32, torch.bfloat16):  # the one pass reads these two
            hg = hg.float()
        return hg, squared_sum(hg)

    def grad_final(self, name: str, g: Optional[torch.Tensor]) -> None:
        """Queue the download + squared norm of ``name``'s final gradient ``g``."""
        key = None if g is None else (g.data_ptr(), g._version)
        self._dl[name] = (self._submit(self._fetch, g), key)

    def queued(self) -> list[str]:
        """Names whose gradient download is queued or done this step (in queuing order)."""
        return list(self._dl)

    def collect(self, grads: dict) -> dict:
        """Wait for the downloads of ``grads`` (``{name: gradient or None}``), requeueing changed ones; returns
        ``{name: fp32 squared sum}``."""
        for n, g in grads.items():
            got = self._dl.get(n)
            if got is None or got[1] != (None if g is None else (g.data_ptr(), g._version)):
                self.grad_final(n, g)
        return {n: self._dl[n][0].result()[1] for n in grads}

    def discard(self) -> None:
        """Forget the step's downloaded gradients (skipped step, or after the update consumed them)."""
        for f, _ in self._dl.values():
            f.result()
        self._dl.clear()

    # ------------------------------------------------------------------ update
    def _layer_task(self, key: str, names: list, lr: float, clip_coef: float, grads: dict) -> tuple:
        """Update and upload layer ``key``'s tensors one by one (one compute-dtype copy alive at a time); returns
        ``(key, start, start + seconds of AdamW, end)`` (perf_counter s)."""
        t0 = time.perf_counter()
        opt = self.optimizers[key]
        opt.set_lr(lr)
        lock = getattr(self.backend, "alloc_lock", None)  # RNGD: process-wide memory-type flag
        adamw_s = 0.0
        for n in names if opt.opt is not None else ():
            ta = time.perf_counter()
            # one pass: gradient (fp32/bf16) x clip_coef, AdamW of master + moments, the compute-dtype copy
            w = adamw_onepass(opt.opt, [opt.masters[n]], [grads[n]], clip_coef, self.params[n].dtype)[0]
            adamw_s += time.perf_counter() - ta
            if self.delayed:
                self._staged[n] = w
                continue
            with torch.no_grad(), (lock() if lock is not None else contextlib.nullcontext()):
                self.params[n].copy_(self.backend.upload(w))
            del w
        if not self.delayed:
            self.backend.synchronize()
        return key, t0, t0 + adamw_s, time.perf_counter()

    def _apply_staged(self) -> None:
        """Delayed mode, main thread: upload the previous update's weights (its tasks are done)."""
        with torch.no_grad():
            for n, w in self._staged.items():
                p = self.params[n]
                p.copy_(self.backend.upload(w))
        self._staged = {}
        self.backend.synchronize()

    def update(self, lr: float, clip_coef: float, grads: dict) -> None:
        """Queue the step's host AdamW with gradients scaled by ``clip_coef`` (delayed: upload the previous first)."""
        self.collect(grads)
        host_grads = {n: self._dl[n][0].result()[0] for n in grads}  # this update's own (tasks get it)
        self.discard()
        self.wait_all()  # the previous update (done by now unless delayed): records its timeline
        if self.delayed:
            self._apply_staged()
        self._next_start = time.perf_counter()
        self._layer = {key: self._submit(self._layer_task, key, names, lr, clip_coef, host_grads)
                       for key, names in self.groups}

    def wait_layer(self, key: str) -> None:
        """Block until layer ``key``'s pending update is on the card (no wait in delayed mode)."""
        if self.delayed:
            return
        f = self._layer.get(key)
        if f is not None and not f.done():
            t0 = time.perf_counter()
            f.result()
            self.wait_s += time.perf_counter() - t0
        elif f is not None:
            f.result()  # re-raise a background error

    def wait_all(self) -> None:
        """Block until every queued task is done, record its :attr:`timeline`; re-raises a background error."""
        t0 = time.perf_counter()
        pending = [f for f in self._layer.values() if not f.done()]
        if self._layer:
            self.timeline = [self._layer[k].result() for k, _ in self.groups if k in self._layer]
            self.update_start = self._next_start
            self._layer = {}
        if pending:
            self.wait_s += time.perf_counter() - t0

    def take_stats(self) -> dict:
        """The last collected update, seconds: ``update_s``, ``wait_s`` (main thread blocked), ``overlap_s``,
        ``hidden`` (share), ``start`` (``perf_counter``), ``timeline`` ``[[layer, start, adamw_end, upload_end]]``."""
        tl = [[k, a - self.update_start, b - self.update_start, c - self.update_start]
              for k, a, b, c in self.timeline]
        upd = sum(c - a for _, a, _, c in tl)
        wait, self.wait_s = self.wait_s, 0.0
        ov = max(0.0, upd - wait) if self.overlap else 0.0
        return {"update_s": upd, "wait_s": wait, "overlap_s": ov, "hidden": ov / upd if upd > 0 else 0.0,
                "start": self.update_start, "timeline": tl}

    def close(self) -> None:
        """Finish the queued tasks and stop the thread (a delayed update's staged weights stay off the card)."""
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
