"""The first stage's embedding update, looked-up rows first (the pipeline fill, issue 9).

Every step starts with the first stage's optimizer step and then its first forward; every later stage
waits for both (the pipeline's fill: experiments/2026-12-01-bench-run8.md). That forward reads the
embedding matrix ``[V, H]`` only at the rows of the step's token ids, but its AdamW update touches
all ``V`` rows: 28 M parameters of SmolLM2's 96 M on the first stage of the default split, ~44 ms
of its ~145 ms optimizer step on the 2-core VM.

:class:`RowsFirstUpdate` splits that update in two, with the same result bit for bit:

1. :meth:`RowsFirstUpdate.start` (in the optimizer step): AdamW on the ``k`` rows the next step
   looks up, gathered into ``[k, H]`` tensors with the matrix's own hyper-parameters, step count and
   moments, written back into the master, the moments and the compute weights;
2. :meth:`RowsFirstUpdate.finish` (after the next step's first forward has left the card, or before
   anything else reads the matrix: checkpoint, evaluation, end): the full ``[V, H]`` AdamW step, as
   it would have run, after which the ``k`` rows are restored from step 1 (the full step updated
   them a second time).

AdamW is elementwise: each element's new master and moments depend only on that element's
master, gradient and moments, the step count and the hyper-parameters, so the rows computed apart
are the rows the full step computes (``torch.optim.AdamW``'s fused CPU/CUDA kernel applies the
same per-element arithmetic to any tensor; the unit test checks it bit for bit). The full step's
extra reads of the ``k`` rows cost ``k*H*28`` bytes, ``k <= M*b*S``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RowsFirstUpdate"]


class RowsFirstUpdate:
    """One step's split update of an embedding master (module docstring).

    Args:
        group_opt: the ``torch.optim.AdamW`` that holds only this master (its own instance).
        master: the fp32 master ``[V, H]`` on the card (with fp32 compute on a cpu / cuda card, the
            parameter itself).
        grad: the step's fp32 gradient ``[V, H]``, not yet clipped (kept referenced until
            :meth:`finish`, which scales it by ``clip`` in place, as the optimizer step would have;
            :meth:`start` scales a copy of the rows).
        param: the compute-dtype weights ``[V, H]`` (the master itself when shared).
        rows: int64 ``[k]`` row indices, sorted and unique (the next step's
            :func:`npu_train.runtime.tied.looked_up_rows`).
        clip: the global clip coefficient of the step (1.0: no scaling, as the optimizer skips it).
    """

    def __init__(self, group_opt: torch.optim.AdamW, master: torch.Tensor, grad: torch.Tensor,
                 param: torch.Tensor, rows: torch.Tensor, clip: float = 1.0):
        self.opt, self.master, self.grad, self.param, self.clip = group_opt, master, grad, param, float(clip)
        self.rows = rows.to(master.device)
        self._saved: Optional[tuple] = None

    def start(self) -> None:
        """AdamW on the looked-up rows now (master, moments, compute weights of those rows)."""
        (group,) = [g for g in self.opt.param_groups if any(p is self.master for p in g["params"])]
        st = self.opt.state[self.master]
        idx = self.rows
        with torch.no_grad():
            pm = self.master.index_select(0, idx)
            pm.grad = self.grad.index_select(0, idx)
            if self.clip != 1.0:
                pm.grad.mul_(self.clip)
            ea = st["exp_avg"].index_select(0, idx)
            eas = st["exp_avg_sq"].index_select(0, idx)
        opts = {k: v for k, v in group.items() if k != "params"}
        tmp = torch.optim.AdamW([dict(opts, params=[pm])], lr=opts["lr"])
        tmp.state[pm] = {"step": st["step"].clone(), "exp_avg": ea, "exp_avg_sq": eas}
        tmp.step()
        with torch.no_grad():
            self.master.index_copy_(0, idx, pm)
            if self.param is not self.master:
                self.param.index_copy_(0, idx, pm.to(self.param.dtype))
        pm.grad = None
        self._saved = (pm, ea, eas)

    def finish(self) -> None:
        """The full step (every row, the real step count), then the rows of :meth:`start` restored."""
        if self._saved is None:
            raise RuntimeError("RowsFirstUpdate.finish before start")
        pm, ea, eas = self._saved
        self._saved = None
        st = self.opt.state[self.master]
        held = self.master.grad  # a shared master (the parameter): the next step's gradient buffer
        if self.clip != 1.0:
            with torch.no_grad():
                self.grad.mul_(self.clip)
        self.master.grad = self.grad
        try:
            self.opt.step()
        finally:
            self.master.grad = held
        with torch.no_grad():
            idx = self.rows
            self.master.index_copy_(0, idx, pm)
            st["exp_avg"].index_copy_(0, idx, ea)
            st["exp_avg_sq"].index_copy_(0, idx, eas)
            if self.param is not self.master:
                self.param.copy_(self.master)
        self.grad = None
