"""The first stage's embedding update, looked-up rows first, to shorten the pipeline fill: AdamW on the
next step's ``k`` token rows now, the full update after the next first forward (AdamW is elementwise,
so bit-identical). experiments/2026-12-01-bench-run8.md §3, docs/design.md §17.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["RowsFirstUpdate"]


class RowsFirstUpdate:
    """One step's split update of an embedding master ``[V, H]`` (fp32; may be the parameter itself).
    ``grad``: the unclipped fp32 gradient (scaled by ``clip`` in place by :meth:`finish`); ``rows``: int64
    ``[k]`` sorted unique rows (:func:`npu_train.runtime.tied.looked_up_rows`)."""

    def __init__(self, group_opt: torch.optim.AdamW, master: torch.Tensor, grad: torch.Tensor,
                 param: torch.Tensor, rows: torch.Tensor, clip: float = 1.0):
        self.opt, self.master, self.grad, self.param, self.clip = group_opt, master, grad, param, float(clip)
        self.rows = rows.to(master.device)
        self._saved: Optional[tuple] = None

    def start(self) -> None:
        """AdamW on the looked-up rows now (gathered ``[k, H]`` with the matrix's state), written back."""
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
        """The full step (every row), then the rows of :meth:`start` restored (the full step updated them twice)."""
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
