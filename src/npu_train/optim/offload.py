"""Host AdamW of offloaded layers, overlapped with the card's work (issue 9, item 4).

An *offloaded* parameter keeps its fp32 master and AdamW moments in host RAM (ZeRO-Offload, Ren et
al. 2021). Per optimizer step ``t`` and offloaded parameter: download the accumulated gradient
(D2H), take its squared norm (for the global clip), then, once the clip coefficient ``c_t`` is
known, ``master <- AdamW(master, c_t * grad)`` on the host, cast to the compute dtype and upload.

:class:`HostUpdater` runs these per *layer* (a group of parameter names given in forward order:
embedding, decoder layers in order, final norm + head), in one of three modes:

- ``overlap=False``: every task runs inline on the calling (main) thread, in the order below.
- ``overlap=True``, ``delayed=False`` (exact overlap, the default): the same tasks, in the same
  order, run on one background thread (a FIFO, :class:`concurrent.futures.ThreadPoolExecutor` with
  one worker). A gradient's download + squared norm is queued as soon as the gradient is final
  (:meth:`grad_final`, called from the last micro-batch's backward), so it overlaps the rest of the
  backward; after the clip coefficient is known, :meth:`update` queues the layers' AdamW + upload
  in forward order, and the next step's forward through a layer waits only for that layer
  (:meth:`wait_layer`). Every tensor sees the same ops in the same order as with ``overlap=False``,
  so the results are bit-identical.
- ``delayed=True`` (ZeRO-Offload's delayed parameter update, DPU, section 5.2): with ``m_t`` the
  host masters before step ``t``'s update and ``g_t`` step ``t``'s clipped gradient,
  ``m_{t+1} = AdamW(m_t, g_t)`` as always, but the offloaded layers' card weights during step
  ``t``'s forward/backward are ``cast(m_{max(t-1, 0)})`` instead of ``cast(m_t)``: the update of
  step ``t`` runs on the background thread during step ``t+1``'s forward/backward and its weights
  are uploaded at step ``t+1``'s :meth:`update` call (after step ``t+1``'s backward), so they are
  used from step ``t+2`` on. The gradient ``g_t`` is thus taken at weights one update stale
  (``g_t = grad L_t(cast(m_{t-1}))``). Resident layers are not affected; staleness is per parameter
  copy, so a tied embedding offloaded on one end of the pipeline and resident on the other is used
  at two different ages. A checkpoint holds the masters after every queued update (``m_{t+1}``); the
  stale card weights are not saved, so such a run does not resume (refused at job preparation).

Host-memory cards (:data:`~npu_train.hardware.HOST_MEMORY_KINDS`, ``cpu``): the card's gradient
already lies in host RAM, so outside the delayed mode (:attr:`HostUpdater.in_place`) the update takes
the final fp32 gradient tensor itself (its squared norm is taken from it and the clip scales it in
place) instead of a downloaded copy, the same values through the same ops (bit-identical). The copy
was 4 B per offloaded parameter, made in the last micro-batch's backward and held until the layer's
update, so at the card's memory peak: 0.24 GiB of card 0's 3.35 GiB peak RSS (SmolLM2-135M, fp32,
``cpu,cpu``, layers 10-19 + embedding offloaded; the plan said 3.02 GiB; 3.09-3.20 GiB without the
copy, experiments/2026-12-01-offload-memory.md). Nothing writes the gradient between its last accumulation and the update that consumes it:
a reused fp32 accumulator (bf16 compute) is next written by the next step's backward, which comes
after the forward through every offloaded layer, which waits for that layer's update
(:meth:`HostUpdater.wait_layer`); fp32 compute's ``.grad`` is dropped after the step and allocated
afresh; a skipped step discards its gradients unchanged. The delayed update runs during the next
step's backward, so it keeps the copy.

Threads: the background thread's torch ops use the process's intra-op thread count
(``torch.get_num_threads()``, which the launcher sets per card process from
:func:`npu_train.planner.threads.threads_per_card`); a new OS thread inherits it. On an accelerator
card the main thread mostly queues device work while the host thread computes, so the card's
cores are not oversubscribed; on a ``cpu`` card the two threads share the card's cores while they
overlap (up to twice the thread count for that time: the overlap there only hides waits).
Device allocations and copies made from the background thread (each layer's upload and the copy
into the card's weights) hold the backend's ``alloc_lock`` where it has one (RNGD: the memory-type
flag is process-wide, and the main thread holds the same re-entrant lock around its allocations).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from npu_train.hardware import HOST_MEMORY_KINDS


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
    """``sum(t**2)`` of a gradient ``t`` (any shape, any float dtype) as a 0-dim fp32 tensor on
    ``t``'s device: one term of the global gradient norm.

    On ``cpu`` / ``cuda`` tensors: the Euclidean norms of rows of :data:`SQ_ROW` elements
    (``torch.linalg.vector_norm(dim=1)``), squared and summed in fp64, plus the tail's ``dot``. Why:
    ``t.pow(2).sum()`` makes a temporary of ``t``'s size and reads memory twice: for a
    ``[49152, 576]`` fp32 gradient (SmolLM2's tied embedding) 55 ms against 10-11 ms this way, one
    thread on the 2-core VM; a stage's 67 M layer parameters 37-111 ms against ~20 ms (measured
    2026-12-01, experiments/2026-12-01-bench-run8.md). Whole-tensor ``dot`` or ``vector_norm`` are as
    fast but accumulate in long fp32 runs: relative errors 1.4e-4 and 3e-3 on 28 M elements
    against an fp64 sum. Per 512-element row and summed in fp64: 2e-9 to 7e-8 on fp32 and bf16
    values, as ``pow(2).sum()``; rows of 1024 or 4096 reached 2e-7 / 9e-7 on bf16 values (a
    stage's bf16 gradients under ``train.grad_accum=compute``). Other devices:
    ``t.float().pow(2).sum()``."""
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
    """Host AdamW + card upload of a stage's offloaded parameters, per layer (module docstring).

    Args:
        params: ``{hf_name: parameter}`` on the card (compute dtype) for the offloaded names.
        groups: ``[(layer_key, [hf_name, ...]), ...]`` in forward order; each layer's ``_Group``-like
            optimizer is ``optimizers[layer_key]`` (``.masters``, ``.set_lr(lr)``, ``.step()``).
        optimizers: ``{layer_key: group}``; masters are fp32 CPU tensors.
        backend: the card's backend (``download``/``upload``/``synchronize``).
        overlap, delayed: the mode (module docstring); ``delayed`` needs ``overlap``.
    """

    def __init__(self, params: dict, groups: list, optimizers: dict, backend, *, overlap: bool,
                 delayed: bool = False):
        self.params, self.groups, self.optimizers, self.backend = params, groups, optimizers, backend
        self.overlap, self.delayed = bool(overlap), bool(delayed) and bool(overlap)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="host-adamw") if self.overlap else None
        #: the update takes an fp32 gradient on a host-memory card (``cpu``) itself, not a copy
        self.in_place = getattr(backend, "kind", None) in HOST_MEMORY_KINDS and not self.delayed
        self._dl: dict[str, tuple] = {}  # name -> (future of (host fp32 grad | None, sq), (data_ptr, version))
        self._layer: dict[str, Future] = {}  # layer key -> its pending update
        self._staged: dict[str, torch.Tensor] = {}  # delayed: name -> compute-dtype host weights to upload
        self.timeline: list = []  # the last finished update: [(layer, start, adamw_end, upload_end)] perf_counter s
        self.update_start = self._next_start = 0.0  # perf_counter s: the collected / the queued update
        self.wait_s = 0.0  # seconds the main thread blocked on pending updates since the last take_stats()

    def _submit(self, fn: Callable, *args) -> Future:
        if self._pool is None:
            return _done(fn(*args))
        return self._pool.submit(fn, *args)

    # ------------------------------------------------------------------ gradients
    def _fetch(self, g: Optional[torch.Tensor]):
        """Download gradient ``g`` (card, any float dtype) -> (fp32 host copy, its squared sum fp32).

        On a card whose memory is the host RAM (:data:`~npu_train.hardware.HOST_MEMORY_KINDS`) an
        fp32 ``g`` is returned itself (no copy, see :attr:`in_place`)."""
        if g is None:
            return None, torch.zeros((), dtype=torch.float32)
        if self.in_place and g.dtype == torch.float32 and g.device.type == "cpu":
            hg = g.detach()
            return hg, squared_sum(hg)
        hg = self.backend.download(g.detach())
        if hg.data_ptr() == g.data_ptr():  # never alias the card's accumulator (reused next step)
            hg = hg.clone()
        hg = hg.float()
        return hg, squared_sum(hg)

    def grad_final(self, name: str, g: Optional[torch.Tensor]) -> None:
        """Queue the download + squared norm of ``name``'s final step gradient ``g`` (called when no
        later micro-batch or collective changes it; see :meth:`collect` for the safety net)."""
        key = None if g is None else (g.data_ptr(), g._version)
        self._dl[name] = (self._submit(self._fetch, g), key)

    def queued(self) -> list[str]:
        """Names whose gradient download is queued or done this step (in queuing order)."""
        return list(self._dl)

    def collect(self, grads: dict) -> dict:
        """Wait for every offloaded gradient's download; ``grads``: ``{name: current gradient tensor
        or None}``. A gradient not queued yet, or changed since it was queued (other storage or a
        newer version counter, which views such as ``detach()`` share), is (re)queued now.
        Returns ``{name: squared sum (fp32 scalar)}``."""
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
        t0 = time.perf_counter()
        opt = self.optimizers[key]
        for n in names:
            m = opt.masters[n]
            hg = grads[n]
            m.grad = torch.zeros_like(m) if hg is None else hg.mul_(clip_coef)
        opt.set_lr(lr)
        opt.step()
        t1 = time.perf_counter()
        lock = getattr(self.backend, "alloc_lock", None)  # RNGD: process-wide memory-type flag
        with torch.no_grad(), (lock() if lock is not None else contextlib.nullcontext()):
            for n in names:
                m = opt.masters[n]
                m.grad = None
                if self.delayed:
                    self._staged[n] = m.to(self.params[n].dtype)
                else:
                    p = self.params[n]
                    p.copy_(self.backend.upload(m.to(p.dtype)))
        if not self.delayed:
            self.backend.synchronize()
        return key, t0, t1, time.perf_counter()

    def _apply_staged(self) -> None:
        """Delayed mode, main thread: upload the previous update's weights (its tasks are done)."""
        with torch.no_grad():
            for n, w in self._staged.items():
                p = self.params[n]
                p.copy_(self.backend.upload(w))
        self._staged = {}
        self.backend.synchronize()

    def update(self, lr: float, clip_coef: float, grads: dict) -> None:
        """Queue step's host AdamW with gradients scaled by ``clip_coef``, per layer in forward order.

        ``grads``: as for :meth:`collect` (the downloads are waited for first). Delayed mode: first
        wait for the previous step's update and upload its weights (see the module docstring).
        """
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
        """Block until layer ``key``'s pending update is on the card (exact overlap; the forward
        pre-hook of that layer). Delayed mode: no wait (the card weights are the staged ones)."""
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
        """Block until every queued task is finished (checkpoint save, evaluation, end of training);
        records the finished update's per-layer :attr:`timeline`. Re-raises a background error."""
        t0 = time.perf_counter()
        pending = [f for f in self._layer.values() if not f.done()]
        if self._layer:
            self.timeline = [self._layer[k].result() for k, _ in self.groups if k in self._layer]
            self.update_start = self._next_start
            self._layer = {}
        if pending:
            self.wait_s += time.perf_counter() - t0

    def take_stats(self) -> dict:
        """Figures of the last *collected* update (the previous step's: :meth:`update` collects it
        before queuing the next; evaluation and checkpoints collect it early), the same in every
        mode: ``update_s`` (host AdamW + upload summed over layers, seconds), ``wait_s`` (seconds the
        main thread blocked on pending updates since the previous call), ``overlap_s = max(0,
        update_s - wait_s)`` (hidden behind other work; 0 without overlap), ``hidden`` = overlap_s /
        update_s, ``start``: the update's start (``time.perf_counter()``, CLOCK_MONOTONIC: comparable
        across the card processes of a host), ``timeline``: ``[[layer, start, adamw_end,
        upload_end], ...]`` in seconds from ``start`` (delayed mode: upload_end = adamw_end + the
        cast; the upload happens at the next :meth:`update`)."""
        tl = [[k, a - self.update_start, b - self.update_start, c - self.update_start]
              for k, a, b, c in self.timeline]
        upd = sum(c - a for _, a, _, c in tl)
        wait, self.wait_s = self.wait_s, 0.0
        ov = max(0.0, upd - wait) if self.overlap else 0.0
        return {"update_s": upd, "wait_s": wait, "overlap_s": ov, "hidden": ov / upd if upd > 0 else 0.0,
                "start": self.update_start, "timeline": tl}

    def close(self) -> None:
        """Finish the queued tasks and stop the background thread (the staged weights of a delayed
        update stay off the card: the masters hold them)."""
        self.wait_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
