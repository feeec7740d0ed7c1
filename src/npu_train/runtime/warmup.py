"""Warm-up of a card process before step 1: compile every graph a training step runs (RNGD compiles each
op and shape on first use), untimed, with no training state or RNG changed (docs/design.md §17).
"""
from __future__ import annotations

import time

import torch

__all__ = ["warm_up_stage"]


def warm_up_stage(module, backend, *, first: bool, last: bool, micro_batch: int, seq_len: int,
                  hidden_size: int, dtype: torch.dtype, lr: float = 1e-12, betas=(0.9, 0.95),
                  eps: float = 1e-8, weight_decay: float = 0.0) -> float:
    """Run one forward + backward of shape ``[micro_batch, seq_len(, hidden_size)]`` and the optimizer's
    device ops per parameter shape on scratch tensors; returns seconds (``compile_s``)."""
    from npu_train.model.llama import causal_lm_loss_sum

    t0 = time.perf_counter()
    dev = backend.device()
    b, s = int(micro_batch), int(seq_len)
    if first:
        x = backend.upload(torch.zeros(b, s, dtype=torch.long))
    else:
        x = backend.upload(torch.zeros(b, s, hidden_size, dtype=dtype)).requires_grad_(True)
    out = module(x)
    if last and getattr(module, "vocab", None) is None:  # vocabulary-parallel: the forward ends at the norm
        ls, _ = causal_lm_loss_sum(out, backend.upload(torch.zeros(b, s, dtype=torch.long)))
        ls.backward()
    else:
        out.backward(torch.ones_like(out))
    del x, out
    seen = set()
    for p in module.parameters():
        key = (tuple(p.shape), p.dtype)
        if key in seen:
            continue
        seen.add(key)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g.detach().float().pow(2).sum()
        master = g.detach().float().mul(1.0).clone().requires_grad_(True)
        master.grad = g.detach().float().mul(1.0)
        opt = torch.optim.AdamW([master], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                foreach=False)
        opt.step()
        with torch.no_grad():
            scratch = torch.empty_like(p)
            scratch.copy_(master)
        del opt, master, scratch, g
    for p in module.parameters():
        p.grad = None
    backend.synchronize()
    del dev
    return time.perf_counter() - t0
