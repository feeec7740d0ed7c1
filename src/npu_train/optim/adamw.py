"""Stage optimizer: AdamW (Loshchilov & Hutter 2019, ``torch.optim.AdamW``) over fp32 master weights.

Start at :class:`StageOptimizer`. Masters + moments are *resident* (on the card, 12 B/param) or
*offloaded* (host RAM, :mod:`npu_train.optim.offload`); gradients accumulate in fp32. docs/design.md §17.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterable, Optional

import torch

from npu_train.hardware import SHARED_MASTER_KINDS
from npu_train.optim.hooks import StepHooks
from npu_train.optim.offload import HostUpdater, squared_sum
from npu_train.optim.rowsfirst import RowsFirstUpdate


def decays(name: str, tensor: torch.Tensor) -> bool:
    """Whether AdamW weight decay applies to parameter ``name`` (matrices yes, norm vectors no)."""
    return tensor.ndim >= 2


def _fused_ok(device: torch.device) -> bool:
    return device.type in ("cpu", "cuda")


class _Group:
    """One AdamW instance over a set of masters living on one device."""

    def __init__(self, masters: dict[str, torch.Tensor], device: torch.device, lr: float, betas, eps, wd):
        self.masters = masters
        dec = [t for n, t in masters.items() if decays(n, t)]
        nodec = [t for n, t in masters.items() if not decays(n, t)]
        groups = [g for g in ({"params": dec, "weight_decay": wd}, {"params": nodec, "weight_decay": 0.0})
                  if g["params"]]
        self.opt = None
        if groups:
            kw = {"fused": True} if _fused_ok(device) else {"foreach": False}
            self.opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **kw)

    def set_lr(self, lr: float) -> None:
        if self.opt is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr

    def step(self) -> None:
        if self.opt is not None:
            self.opt.step()

    def init_state(self, track=None) -> None:
        """Create every master's AdamW state now, exactly as ``torch.optim.AdamW`` does in its first step (8 B/param,
        bit-identical updates; experiments/2026-12-01-bench-run7.md). ``track``: called with each new moment."""
        if self.opt is None:
            return
        for g in self.opt.param_groups:
            on_dev = bool(g.get("fused") or g.get("capturable"))
            for p in g["params"]:
                st = self.opt.state[p]
                if st:
                    continue
                st["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if on_dev
                              else torch.tensor(0.0, dtype=torch.float32))
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if track is not None:
                        track(st[k])


def grad_or_zeros(p: torch.nn.Parameter) -> torch.Tensor:
    """``p.grad``, created as zeros if the parameter got no gradient this step (to be changed in place)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


class StageOptimizer:
    """AdamW with fp32 masters for one pipeline stage's parameters.

    ``params``: ``{hf_name: parameter}`` (compute dtype, on the card); ``masters_init``: ``{hf_name: fp32
    CPU tensor}`` covering ``params``; ``resident``: names kept on the card, the rest offloaded; ``layers``:
    ``[(layer_key, [hf_name, ...])]`` in forward order (one host AdamW per offloaded layer; None: one layer);
    ``overlap``/``delayed``: :class:`~npu_train.optim.offload.HostUpdater` mode; ``eager_state``: create the
    moments now; ``rows_first``: the embedding updated rows first (:mod:`npu_train.optim.rowsfirst`);
    ``hooks``: the stage's :class:`~npu_train.optim.hooks.StepHooks`. :attr:`shared`: resident fp32
    parameters on a ``SHARED_MASTER_KINDS`` card, their own masters. Raises ValueError for an offloaded
    parameter in no layer."""

    def __init__(self, params: dict[str, torch.nn.Parameter], masters_init: dict[str, torch.Tensor],
                 resident: Iterable[str], backend, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, fp32_grad_accum: bool = True, layers=None,
                 overlap: bool = False, delayed: bool = False, eager_state: bool = True,
                 rows_first: Optional[str] = None, hooks: Optional[StepHooks] = None):
        self.params = params
        self.backend = backend
        self.hooks = hooks if hooks is not None else StepHooks()
        self.resident = set(resident) & set(params)
        self.offloaded = set(params) - self.resident
        dev = backend.device()
        hyper = (lr, betas, eps, weight_decay)
        res_m, off_m = self._place_masters(masters_init, dev)
        # the embedding matrix whose update may go looked-up rows first (step(rows=)): its own AdamW
        self.row_name = rows_first if rows_first in res_m and _fused_ok(dev) else None
        self.row_group = _Group({self.row_name: res_m.pop(self.row_name)}, dev, *hyper) if self.row_name else None
        self._pending: Optional[RowsFirstUpdate] = None
        self.dev_group = _Group(res_m, dev, *hyper)
        groups = self._host_layers(layers, off_m)
        self.host_groups = {k: _Group({n: off_m[n] for n in names}, torch.device("cpu"), *hyper) for k, names in groups}
        self.host_layer = {n: k for k, names in groups for n in names}
        self.host = HostUpdater({n: params[n] for n in off_m}, groups, self.host_groups, backend,
                                overlap=overlap, delayed=delayed)
        if eager_state:
            self._init_state()
        self._counts: dict[str, int] = {}
        self._final_after = 0  # micro-batches after which a gradient is final (0: not tracked this step)
        self._late: set[str] = set()
        self.step_count = 0
        # fp32 gradient accumulators for low-precision compute (see the module docstring)
        self.accumulators: dict[str, torch.Tensor] = {}
        self._touched: set[str] = set()
        self._register_hooks(fp32_grad_accum, overlap)

    def _place_masters(self, masters_init: dict, dev: torch.device) -> tuple[dict, dict]:
        """The fp32 masters ``(on the card, in host RAM)``; sets :attr:`shared`."""
        params, backend = self.params, self.backend
        # resident fp32 parameters on a cpu / cuda card are their own masters (the planner's memory model
        # keys on the same card kinds)
        own = getattr(backend, "kind", None) in SHARED_MASTER_KINDS and _fused_ok(dev)
        self.shared = {n for n in self.resident if own and params[n].dtype == torch.float32
                       and params[n].device == dev}
        res_m = {}
        for n in params:
            if n in self.shared:
                if masters_init[n].data_ptr() != params[n].data_ptr():  # else loaded in place (stagebuild)
                    with torch.no_grad():
                        params[n].copy_(backend.upload(masters_init[n].float().contiguous()))
                res_m[n] = params[n]
            elif n in self.resident:
                res_m[n] = backend.upload(masters_init[n].float().contiguous()).clone()
        off_m = {n: masters_init[n].float().contiguous().clone() for n in params if n in self.offloaded}
        return res_m, off_m

    def _host_layers(self, layers, off_m: dict) -> list[tuple[str, list[str]]]:
        """``layers`` restricted to the offloaded names; ValueError for an offloaded parameter in no layer."""
        if layers is None:
            layers = [("all", list(self.params))]
        groups = [(k, [n for n in names if n in off_m]) for k, names in layers]
        groups = [(k, names) for k, names in groups if names]
        missing = set(off_m) - {n for _, names in groups for n in names}
        if missing:
            raise ValueError(f"StageOptimizer: offloaded parameters in no layer: {sorted(missing)[:5]}")
        return groups

    def _card_allocations(self):
        """The backend's allocation lock (furiosa: memory accounting), or a no-op context."""
        lock = getattr(self.backend, "alloc_lock", None)
        return lock() if lock is not None else contextlib.nullcontext()

    def _init_state(self) -> None:
        """The AdamW moments of every group now (:meth:`_Group.init_state`)."""
        track = getattr(self.backend, "track", None)
        with self._card_allocations():
            self.dev_group.init_state(track)
            if self.row_group is not None:
                self.row_group.init_state(track)
        for g in self.host_groups.values():
            g.init_state()

    def _register_hooks(self, fp32_grad_accum: bool, overlap: bool) -> None:
        """The fold before the final-gradient count (the count must see the fp32 accumulator), then rows-first."""
        params = self.params
        # fp32_grad_accum=False (train.grad_accum=compute): gradients accumulate in the compute dtype's
        # .grad, as the predecessor system on RNGD did (half the gradient memory, one rounding per micro-batch)
        low = [n for n, p in params.items() if p.dtype != torch.float32] if fp32_grad_accum else []
        track = getattr(self.backend, "track", None)
        with self._card_allocations() if low else contextlib.nullcontext():
            for n in low:
                self.accumulators[n] = torch.zeros(params[n].shape, dtype=torch.float32, device=params[n].device)
                if track is not None:
                    track(self.accumulators[n])
        for n in low:
            self.hooks.on_grad_ready(params[n], self._folder(n))
        if overlap:  # after the fold hooks: sees the folded fp32 accumulator
            for n in self.host_layer:
                self.hooks.on_grad_ready(params[n], self._counter(n))
        if self.row_name:
            self.hooks.on_first_forward_sent(self.finish_rows)

    # ------------------------------------------------------------------ gradients
    def _fold(self, name: str, p: torch.Tensor) -> None:
        """Add ``p.grad`` (compute dtype) into the fp32 accumulator of ``name`` and free it."""
        if self._pending is not None:  # the accumulator may be the pending update's gradient
            self.finish_rows()
        acc = self.accumulators[name]
        with torch.no_grad():
            if name in self._touched:
                acc.add_(p.grad)
            else:
                acc.copy_(p.grad)
                self._touched.add(name)
        p.grad = None

    def _folder(self, name: str):
        return lambda p: self._fold(name, p)

    def _counter(self, name: str):
        def hook(p):
            c = self._counts.get(name, 0) + 1
            self._counts[name] = c
            if c == self._final_after and name not in self._late:
                self.host.grad_final(name, self.accumulators[name] if name in self.accumulators else p.grad)
        return hook

    def begin_step(self, micro_batches: int, late=()) -> None:
        """Overlap: a gradient is final after ``micro_batches`` accumulations, except ``late`` ones (changed by a
        collective later: tied embeddings, data-parallel replicas)."""
        self._counts.clear()
        self._final_after = int(micro_batches)
        self._late = set(late)

    def zero_grad(self) -> None:
        """Forget the gradients of the previous step (before the first micro-batch of a step)."""
        for p in self.params.values():
            p.grad = None
        self._touched.clear()
        self._counts.clear()
        self._final_after = 0

    def grad_buffer(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s step gradient to change in place (fp32 accumulator or ``.grad``; zeros if none)."""
        if name in self.accumulators:
            if self.grad(name) is None:
                self.accumulators[name].zero_()
                self._touched.add(name)
            return self.accumulators[name]
        return grad_or_zeros(self.params[name])

    def grad(self, name: str):
        """The step's accumulated gradient of ``name`` on the card (fp32 with bf16 compute), or None."""
        if name in self.accumulators:
            if self.params[name].grad is not None:  # set without a backward pass (no hook ran)
                self._fold(name, self.params[name])
            return self.accumulators[name] if name in self._touched else None
        g = self.params[name].grad
        return None if g is None else g.detach()

    def grad_sq_terms(self, exclude: Iterable[str] = (), only: Optional[Iterable[str]] = None) -> dict:
        """``{name: squared gradient sum}`` (fp32 CPU scalars) of parameters with a gradient, minus ``exclude``
        (or only ``only``); :meth:`sum_terms` adds parts bit-identically to :meth:`grad_sq_sum`."""
        ex = set(exclude)
        want = None if only is None else set(only)
        names = [n for n in self.params if want is None or n in want]
        host_sq = self.host.collect({n: self.grad(n) for n in names if n in self.host_layer})
        out = {}
        for n in names:
            if n in ex or self.grad(n) is None:
                continue
            if n in host_sq:  # offloaded: from the host copy (downloaded once, also for the update)
                out[n] = host_sq[n]
            else:
                out[n] = self.backend.download(squared_sum(self.grad(n))).to(torch.float32)
        return out

    def sum_terms(self, terms: dict) -> torch.Tensor:
        """The fp32 sum of :meth:`grad_sq_terms` parts, in parameter order (bit-identical to :meth:`grad_sq_sum`)."""
        total = torch.zeros((), dtype=torch.float32)
        for n in self.params:
            if n in terms:
                total += terms[n]
        return total

    def grad_sq_sum(self, exclude: Iterable[str] = ()) -> torch.Tensor:
        """Sum of squares of the stage's gradients except ``exclude``, fp32 CPU scalar."""
        return self.sum_terms(self.grad_sq_terms(exclude))

    def discard_grads(self) -> None:
        """A skipped step: drop the gradients (also the downloaded host copies)."""
        self.host.discard()
        self.zero_grad()

    # ------------------------------------------------------------------ update
    def step(self, lr: float, clip_coef: float, rows: Optional[torch.Tensor] = None) -> dict[str, float]:
        """One AdamW step with gradients scaled by ``clip_coef``; consumes the gradients. ``rows``: int64 ``[k]``
        rows of the ``rows_first`` matrix to update now (rest: :meth:`finish_rows`). Returns seconds
        ``{"device_optimizer", "host_optimizer", "transfer"}`` (``transfer`` 0: in ``host_optimizer``)."""
        t0 = time.perf_counter()
        self.finish_rows()  # (a step without a forward since the last one: evaluation off, one-step runs)
        row_grad = None
        split = rows is not None and self.row_group is not None and bool(
            self.row_group.opt.state.get(self.row_group.masters[self.row_name]))
        with torch.no_grad():
            for n, m in self._resident_masters():
                g = self.grad(n)
                if split and n == self.row_name and g is not None:  # clipped by the split update itself
                    row_grad = g if n in self.shared else g.float()
                    continue
                if g is None:
                    m.grad = torch.zeros_like(m)
                elif n in self.shared:  # m is the parameter: its .grad is the fp32 accumulated gradient
                    if clip_coef != 1.0:  # x * 1.0 == x: skip the pass over the gradients
                        g.mul_(clip_coef)
                else:  # (no pass over the gradient at clip_coef 1.0: x * 1.0 == x)
                    m.grad = g.float().mul_(clip_coef) if clip_coef != 1.0 else g.float()
        self.dev_group.set_lr(lr)
        self.dev_group.step()
        with torch.no_grad():
            for n, m in self.dev_group.masters.items():
                if n not in self.shared:
                    self.params[n].copy_(m)
                m.grad = None
        if self.row_group is not None:
            n, m = self.row_name, self.row_group.masters[self.row_name]
            self.row_group.set_lr(lr)
            if row_grad is not None:
                self._pending = RowsFirstUpdate(self.row_group.opt, m, row_grad, self.params[n], rows, clip_coef)
                self._pending.start()
            else:
                self.row_group.step()
                with torch.no_grad():
                    if n not in self.shared:
                        self.params[n].copy_(m)
            if n not in self.shared:
                m.grad = None
        self.backend.synchronize()
        t1 = time.perf_counter()
        self.host.update(lr, clip_coef, {n: self.grad(n) for n in self.host_layer})
        host_opt = time.perf_counter() - t1  # without overlap: downloads, host AdamW and uploads
        self.zero_grad()  # the step consumed the gradients (resident ones were scaled in place)
        self.step_count += 1
        return {"device_optimizer": t1 - t0, "host_optimizer": host_opt, "transfer": 0.0}

    def finish_rows(self) -> float:
        """Complete a pending rows-first update (before anything else reads the matrix); returns its seconds."""
        if self._pending is None:
            return 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.finish()
        self.backend.synchronize()
        return time.perf_counter() - t0

    def _resident_masters(self):
        yield from self.dev_group.masters.items()
        if self.row_group is not None:
            yield from self.row_group.masters.items()

    def wait_layer(self, key: str) -> None:
        """Block until layer ``key``'s pending host update is on the card (forward pre-hook)."""
        self.host.wait_layer(key)

    def wait_all(self) -> None:
        """Block until every pending update is finished (checkpoint, evaluation, end)."""
        self.finish_rows()
        self.host.wait_all()

    def close(self) -> None:
        """Finish pending work and stop the background thread."""
        self.finish_rows()
        self.host.close()

    # ------------------------------------------------------------------ state
    def _all(self):
        yield from self._resident_masters()
        for g in self.host_groups.values():
            yield from g.masters.items()

    def _opt_of(self, name: str) -> _Group:
        if name == self.row_name:
            return self.row_group
        return self.dev_group if name in self.dev_group.masters else self.host_groups[self.host_layer[name]]

    def _host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself when it is a contiguous CPU tensor (no copy), else one download of it."""
        return t.detach() if t.device.type == "cpu" and t.is_contiguous() else self.backend.download(t).contiguous()

    def state_entries(self) -> list:
        """Checkpoint tensors as :class:`~npu_train.optim.entry.Entry`: fp32 ``{master,exp_avg,exp_avg_sq}.<name>``."""
        from npu_train.optim.entry import Entry

        self.wait_all()  # no torn checkpoint: every pending host update finished
        out = []
        for n, m in self._all():
            g = self._opt_of(n)
            st = g.opt.state.get(m, {}) if g.opt is not None else {}
            shape = tuple(m.shape)
            out.append(Entry(f"master.{n}", torch.float32, shape, lambda m=m: self._host_view(m)))
            for k in ("exp_avg", "exp_avg_sq"):
                t = st.get(k)
                get = (lambda t=t: self._host_view(t)) if t is not None else (lambda: torch.zeros(shape))
                out.append(Entry(f"{k}.{n}", torch.float32, shape, get))
        return out

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """:meth:`state_entries` as a dict of fp32 CPU copies (12 bytes per parameter; the checkpoint streams
        :meth:`state_entries` instead)."""
        return {e.name: e.get().clone() for e in self.state_entries()}

    def load_state_tensors(self, tensors, step: int) -> None:
        """Restore masters, moments and ``step``; ``tensors``: dict or ``key -> fp32 CPU tensor`` (read one by one)."""
        get = tensors.__getitem__ if isinstance(tensors, dict) else tensors
        self.wait_all()
        self.step_count = step
        with torch.no_grad():
            for n, m in self._all():
                g = self._opt_of(n)
                on_card = g is self.dev_group or g is self.row_group
                dev = m.device
                m.copy_(get(f"master.{n}").to(dev))
                st = g.opt.state.get(m) if g.opt is not None else None
                if step > 0 and st:  # created up front (eager_state): fill in place, no second copy
                    st["step"].fill_(float(step))
                    st["exp_avg"].copy_(get(f"exp_avg.{n}"))
                    st["exp_avg_sq"].copy_(get(f"exp_avg_sq.{n}"))
                elif step > 0 and g.opt is not None:
                    g.opt.state[m] = {
                        "step": torch.tensor(float(step), dtype=torch.float32, device=dev if on_card and _fused_ok(dev) else "cpu"),
                        "exp_avg": get(f"exp_avg.{n}").to(dev).clone(),
                        "exp_avg_sq": get(f"exp_avg_sq.{n}").to(dev).clone(),
                    }
                p = self.params[n]
                p.copy_(self.backend.upload(m.detach().to("cpu").to(p.dtype)) if not on_card else m.to(p.dtype))
