"""Single-process reference trainer: the whole model in one process, torch.optim.AdamW, clip_grad_norm_.

Independent of the pipeline runtime (no schedules, no transport, no master/compute split): it is
what the multi-process runs must reproduce, with the same seed, data order, loss normalisation
(summed token cross-entropy / target tokens of the whole step), LR schedule and weight-decay
grouping. The LR schedule and the decay grouping are written here from their definitions, not
imported from the product (a shared bug would cancel out): see :func:`ref_lr` and :func:`ref_decays`.
Packed rows (data with positions) are cut into their samples here and each sample runs alone, unpacked
(no mask, no positions): the definition of packing without cross-sample attention
(:func:`ref_segments`).
"""
from __future__ import annotations

import math

import torch

from npu_train.data.dataset import micro_batch_tensors
from npu_train.data.sampler import StepSampler
from npu_train.model.llama import causal_lm_loss_sum, full_model
from npu_train.model import load_config, load_tensors


def ref_decays(name: str) -> bool:
    """Weight decay applies to the weight matrices (attention, MLP, embedding, LM head), not to the
    RMSNorm gains (``*norm.weight``: ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``),
    as in the Llama recipe; decided by name, independently of the product's ``ndim`` rule."""
    return not name.endswith("norm.weight")


def ref_lr(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps`` (step s uses ``lr (s + 1) / warmup``), then half a
    cosine from ``lr`` at ``warmup_steps`` down to ``min_lr_ratio lr`` at ``total_steps`` (SGDR without
    restarts, Loshchilov & Hutter 2017; warm-up as Goyal et al. 2017)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    lo = min_lr_ratio * lr
    return lo + (lr - lo) * (1.0 + math.cos(math.pi * t)) / 2.0


def ref_segments(data, indices) -> list:
    """The samples of packed rows ``indices`` of ``data.train``, each as ``(x [1, L-1], y [1, L-1])``: a
    sample is a run of the row starting where its position is 0 (the row's padding, which continues the
    last sample's positions, stays with it; it has no targets); ``x`` its tokens but the last, ``y`` the
    labels of the next tokens inside the sample (text rows without labels: the tokens)."""
    out = []
    for r in indices.tolist():
        ids = data.train[r].to(torch.int64)  # stored compactly (uint16 / uint32) when read from the cache file
        lab = ids if data.train_labels is None else data.train_labels[r]
        if lab.dtype in (torch.uint8, torch.bool):  # a stored target mask: the token where 1, else ignored
            lab = torch.where(lab.bool(), ids, torch.full_like(ids, -100))
        lab = lab.to(torch.int64)
        starts = [int(j) for j in torch.nonzero(data.train_positions[r].to(torch.int64) == 0).flatten()]
        if not starts or starts[0] != 0:
            starts = [0] + starts
        for a, b in zip(starts, starts[1:] + [ids.numel()]):
            if b - a >= 2:
                out.append((ids[a:b - 1][None], lab[a + 1:b][None]))
    return out


def ref_backward(model, data, sampler, step: int) -> float:
    """Forward + backward of every micro-batch of optimizer step ``step`` (the sampler's order),
    each micro-batch's summed token cross-entropy divided by the target tokens of the whole step, so
    the accumulated ``.grad`` is the step's gradient; returns the step's loss (nats per target token).
    Packed rows: every sample of the step alone (:func:`ref_segments`)."""
    if getattr(data, "train_positions", None) is not None:
        mbs = [s for i in sampler.micro_batches_for_step(step) for s in ref_segments(data, i)]
    else:
        mbs = [micro_batch_tensors(data, i) for i in sampler.micro_batches_for_step(step)]
    n_tok = sum(int((y != -100).sum()) for _, y in mbs)
    tot = 0.0
    for x, y in mbs:
        ls, _ = causal_lm_loss_sum(model(x), y)
        (ls / n_tok).backward()
        tot += float(ls.detach())
    return tot / n_tok


def reference_run(model_path: str, data, *, steps: int, micro_batch: int, accum: int, lr: float,
                  warmup_steps: int, min_lr_ratio: float, weight_decay: float, clip: float, seed: int,
                  betas=(0.9, 0.95), eps=1e-8, dtype=torch.float32):
    """Train ``steps`` optimizer steps; returns (per-step losses, {hf_name: fp32 weight})."""
    torch.manual_seed(seed)
    cfg = load_config(model_path)
    model = full_model(cfg)
    names = model.param_names()
    model.load_named_tensors(load_tensors(model_path, cfg, names))
    model = model.to(dtype)
    params = dict(model.named_parameters())
    dec = [p for n, p in params.items() if ref_decays(n)]
    nodec = [p for n, p in params.items() if not ref_decays(n)]
    opt = torch.optim.AdamW([{"params": dec, "weight_decay": weight_decay},
                             {"params": nodec, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                            foreach=False)
    sampler = StepSampler(data.train.shape[0], micro_batch, accum, seed)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = ref_backward(model, data, sampler, step)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for g in opt.param_groups:
            g["lr"] = ref_lr(step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr_ratio=min_lr_ratio)
        opt.step()
        losses.append(loss)
    return losses, {n: p.detach().float().clone() for n, p in params.items()}
