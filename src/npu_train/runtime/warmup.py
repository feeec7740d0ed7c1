"""Warm-up of a card process before step 1: compile every graph a training step runs.

On RNGD, furiosa-torch compiles (and loads onto the card) each distinct eager op and shape the
first time it runs (``furiosa/torch/_backend/eager.py::run_aten_op``); the field record has 150 s
for one resident AdamW graph. Without a warm-up that time lands inside step 1 and in its timing.
:func:`warm_up_stage` runs, untimed and without changing any training state:

1. one forward + backward of the stage on one micro-batch of the run's shape (token ids of 0 on
   the first stage, a zero hidden state elsewhere; labels of 0 on the last stage; an all-ones
   output gradient on the others), so every layer op, the loss and every gradient op compiles
   (all decoder layers of a stage share their shapes);
2. the optimizer's device ops once per distinct (shape, dtype) of the stage's parameters: the
   gradient-norm reduction (``float().pow(2).sum()``), the clip scaling and cast, the weight
   refresh ``copy_`` and one AdamW step (``torch.optim.AdamW(foreach=False)``, the device
   optimizer of :mod:`npu_train.optim.adamw`) on a scratch master of that shape, discarded
   afterwards (one parameter's master + m + v extra for a moment);

then the gradients are dropped (``param.grad = None``). No random numbers are drawn, so the RNG
streams (and a resumed run) are unchanged. Returns the seconds it took (``compile_s`` of the
first step's metrics).
"""
from __future__ import annotations

import time

import torch

__all__ = ["warm_up_stage"]


def warm_up_stage(module, backend, *, first: bool, last: bool, micro_batch: int, seq_len: int,
                  hidden_size: int, dtype: torch.dtype, lr: float = 1e-12, betas=(0.9, 0.95),
                  eps: float = 1e-8, weight_decay: float = 0.0) -> float:
    """Compile the stage's step graphs (module docstring); returns seconds.

    Args:
        module: the stage's :class:`~npu_train.model.llama.StageModule` on the card.
        backend: the card's backend (``upload``, ``device``, ``synchronize``).
        first, last: whether the stage holds the embedding / the LM head.
        micro_batch, seq_len, hidden_size: the run's micro-batch shape ``[b, s]`` / ``[b, s, H]``.
        dtype: compute dtype of the hidden states.
        lr, betas, eps, weight_decay: AdamW settings of the scratch step (shapes matter, values do not).
    """
    from npu_train.model.llama import causal_lm_loss_sum

    t0 = time.perf_counter()
    dev = backend.device()
    b, s = int(micro_batch), int(seq_len)
    if first:
        x = backend.upload(torch.zeros(b, s, dtype=torch.long))
    else:
        x = backend.upload(torch.zeros(b, s, hidden_size, dtype=dtype)).requires_grad_(True)
    out = module(x)
    if last:
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
