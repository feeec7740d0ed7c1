"""Single-process reference trainer: the whole model in one process, torch.optim.AdamW, clip_grad_norm_.

Independent of the pipeline runtime (no schedules, no transport, no master/compute split): it is
what the multi-process runs must reproduce, with the same seed, data order, loss normalisation
(summed token cross-entropy / target tokens of the whole step), LR schedule and weight-decay
grouping. The model (:class:`RefDecoder`: Llama, Qwen2's q/k/v biases, Qwen3's q/k norms and explicit
head_dim, Mistral), the loss, the LR schedule and the decay grouping are written here from their definitions,
not imported from the product (a shared bug would cancel out): see :func:`ref_lr` and :func:`ref_decays`.
Only the weight loader and the data pipeline are the product's.
Packed rows (data with positions) are cut into their samples here and each sample runs alone, unpacked
(no mask, no positions): the definition of packing without cross-sample attention (:func:`ref_segments`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from npu_train.data.batches import micro_batch_tensors
from npu_train.data.sampler import StepSampler
from npu_train.model import load_config, load_tensors


class RefDecoder:
    """The decoder from its formulas over a dict ``w`` of HF-named tensors (leaves that require grad).

    Per layer (pre-norm): ``h += o_proj(attn(rms(h)))``, ``h += down(silu(gate(x)) * up(x))`` with ``x =
    rms(h)``; ``rms(x) = g * x / sqrt(mean(x^2) + eps)`` (statistics in fp32); ``attn``: q/k/v projections
    (``+ b`` when the checkpoint has biases), per-head ``rms`` of q and k (when it has ``q_norm``), RoPE by
    rotate-half at angles ``pos * theta^(-2i/d)``, each query head ``j`` reading kv head ``j // (heads/kv)``,
    causal ``softmax(q k^T / sqrt(d))`` (explicit mask), ``v``. Logits ``rms(h) @ lm_head^T`` (tied: the
    embedding). ``rope_scaling`` is not modelled (the fixtures use plain RoPE).

    A sparse layer (Qwen3-MoE naming) replaces the MLP by ``sum_e W[t, e] * expert_e(x)`` over *every* expert
    on every token (dense, no grouping): ``W[t, e]`` is the fp32 softmax of ``x @ gate^T`` at the token's top-k
    experts (renormalised over them when ``norm_topk_prob``), 0 elsewhere; each layer's router logits are kept in
    :attr:`router_logits` for :func:`ref_aux`."""

    def __init__(self, cfg, w: dict):
        if cfg.rope_scaling:
            raise NotImplementedError("the reference models plain RoPE only")
        self.cfg, self.w = cfg, w
        self.router_logits: list = []

    def _swiglu(self, x, p):
        return self._lin(F.silu(self._lin(x, p + "gate_proj")) * self._lin(x, p + "up_proj"), p + "down_proj")

    def _moe(self, x, p):
        c = self.cfg
        logits = self._lin(x, p + "gate")
        self.router_logits.append(logits.reshape(-1, c.num_experts))
        probs = torch.softmax(logits.float(), dim=-1)
        top, idx = torch.topk(probs, c.num_experts_per_tok, dim=-1)
        if c.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        W = torch.zeros_like(probs).scatter(-1, idx, top).to(x.dtype)
        return sum(W[..., e:e + 1] * self._swiglu(x, f"{p}experts.{e}.") for e in range(c.num_experts))

    def _rms(self, x, g):
        xf = x.float()
        return g * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)).to(x.dtype)

    def _rope(self, x, S):
        d = x.shape[-1]
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        ang = torch.arange(S, dtype=torch.float32)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * ang.cos().to(x.dtype) + rot * ang.sin().to(x.dtype)

    def _lin(self, x, name):
        b = self.w.get(name + ".bias")
        y = x @ self.w[name + ".weight"].t()
        return y if b is None else y + b

    def _attn(self, x, p):
        c, w = self.cfg, self.w
        B, S, _ = x.shape
        nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q = self._lin(x, p + "q_proj").view(B, S, nh, d)
        k = self._lin(x, p + "k_proj").view(B, S, nkv, d)
        v = self._lin(x, p + "v_proj").view(B, S, nkv, d)
        if p + "q_norm.weight" in w:
            q, k = self._rms(q, w[p + "q_norm.weight"]), self._rms(k, w[p + "k_norm.weight"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = self._rope(q, S), self._rope(k, S)
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        future = torch.ones(S, S, dtype=torch.bool).triu(1)
        if c.sliding_window is not None:  # Mistral: key j visible to query i when i - j < window
            future = future | torch.ones(S, S, dtype=torch.bool).tril(-c.sliding_window)
        o = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
        return o.transpose(1, 2).reshape(B, S, nh * d) @ w[p + "o_proj.weight"].t()

    def __call__(self, ids):
        c, w = self.cfg, self.w
        h = w["model.embed_tokens.weight"][ids]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = h + self._attn(self._rms(h, w[p + "input_layernorm.weight"]), p + "self_attn.")
            x = self._rms(h, w[p + "post_attention_layernorm.weight"])
            h = h + (self._moe(x, p + "mlp.") if p + "mlp.gate.weight" in w else self._swiglu(x, p + "mlp."))
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return (self._rms(h, w["model.norm.weight"]) @ head.t()).float()


def ref_aux(router_logits: list, E: int, k: int) -> torch.Tensor:
    """transformers' load-balancing loss (``load_balancing_loss_func``) over all layers' router logits ``[N, E]``:
    ``E * sum_e (T_e / R) * (P_e / R)``, ``T_e`` one-hot top-k counts and ``P_e`` softmax probabilities summed
    over tokens and layers, ``R`` tokens times layers."""
    probs = [torch.softmax(lg, dim=-1) for lg in router_logits]
    T = sum(F.one_hot(torch.topk(p, k, dim=-1).indices, E).sum(dim=(0, 1)).float() for p in probs)
    P = sum(p.float().sum(0) for p in probs)
    R = sum(p.shape[0] for p in probs)
    return E * torch.sum((T / R) * (P / R))


def ref_loss_sum(logits, labels):
    """Summed cross-entropy of the targets (``-100`` ignored) and their count."""
    V = logits.shape[-1]
    ls = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ls, int((labels != -100).sum())


def ref_decays(name: str) -> bool:
    """Weight decay applies to the weight matrices (attention, MLP, embedding, LM head), not to the
    RMSNorm gains (``*norm.weight``: ``input_layernorm``, ``post_attention_layernorm``, ``model.norm``,
    Qwen3's ``q_norm``/``k_norm``) nor biases (Qwen2's ``*.bias``), as in the Llama recipe; decided by name,
    independently of the product's ``ndim`` rule."""
    return not (name.endswith("norm.weight") or name.endswith(".bias"))


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


def ref_backward(model, data, sampler, step: int, aux_weight: float = 0.0) -> float:
    """Forward + backward of every micro-batch of optimizer step ``step`` (the sampler's order),
    each micro-batch's summed token cross-entropy divided by the target tokens of the whole step, so
    the accumulated ``.grad`` is the step's gradient; returns the step's loss (nats per target token).
    Packed rows: every sample of the step alone (:func:`ref_segments`). ``aux_weight`` > 0 (mixtures of experts):
    plus ``aux_weight / micro-batches`` times each micro-batch's :func:`ref_aux`."""
    if getattr(data, "train_positions", None) is not None:
        mbs = [s for i in sampler.micro_batches_for_step(step) for s in ref_segments(data, i)]
    else:
        mbs = [micro_batch_tensors(data, i) for i in sampler.micro_batches_for_step(step)]
    n_tok = sum(int((y != -100).sum()) for _, y in mbs)
    tot = 0.0
    for x, y in mbs:
        model.router_logits = []
        ls, _ = ref_loss_sum(model(x), y)
        loss = ls / n_tok
        if aux_weight:
            c = model.cfg
            loss = loss + aux_weight / len(mbs) * ref_aux(model.router_logits, c.num_experts, c.num_experts_per_tok)
        loss.backward()
        tot += float(ls.detach())
    return tot / n_tok


def reference_run(model_path: str, data, *, steps: int, micro_batch: int, accum: int, lr: float,
                  warmup_steps: int, min_lr_ratio: float, weight_decay: float, clip: float, seed: int,
                  betas=(0.9, 0.95), eps=1e-8, dtype=torch.float32, aux_weight: float = 0.0):
    """Train ``steps`` optimizer steps; returns (per-step losses, {hf_name: fp32 weight}). ``aux_weight``: the
    load-balancing loss weight of a mixture of experts (:func:`ref_backward`)."""
    torch.manual_seed(seed)
    cfg = load_config(model_path)
    names = list(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        names += list(cfg.param_shapes(i))
    params = {n: t.to(dtype).requires_grad_(True) for n, t in load_tensors(model_path, cfg, names).items()}
    model = RefDecoder(cfg, params)
    dec = [p for n, p in params.items() if ref_decays(n)]
    nodec = [p for n, p in params.items() if not ref_decays(n)]
    opt = torch.optim.AdamW([{"params": dec, "weight_decay": weight_decay},
                             {"params": nodec, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                            foreach=False)
    sampler = StepSampler(data.train.shape[0], micro_batch, accum, seed)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = ref_backward(model, data, sampler, step, aux_weight)
        for p in params.values():  # an expert no token reached: a zero gradient, as transformers' stacked experts get
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for g in opt.param_groups:
            g["lr"] = ref_lr(step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr_ratio=min_lr_ratio)
        opt.step()
        losses.append(loss)
    return losses, {n: p.detach().float().clone() for n, p in params.items()}


def ref_completion_logps(model, x, y):
    """Each row's summed ``log softmax(model(x))[t, y_t]`` over the positions with ``y_t != -100`` and their
    count (both ``[B]``): the log-probability of the completion given the prompt."""
    logp = torch.log_softmax(model(x).float(), dim=-1)
    mask = y != -100
    tok = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (tok * mask).sum(-1), mask.sum(-1)


def ref_dpo_pair_losses(lp, ref, n, beta: float, loss: str, eps: float):
    """The pair losses of rows ``2i`` (chosen) and ``2i+1`` (rejected): DPO (Rafailov et al. 2023, eq. 7) with
    cDPO smoothing ``eps``: ``-(1-eps) log s(beta h) - eps log s(-beta h)``, ``h = (lp_w - ref_w) - (lp_l - ref_l)``;
    IPO (Azar et al. 2023, eq. 17) on per-token averages: ``(h - 1/(2 beta))^2``."""
    if loss == "ipo":
        lp, ref = lp / n, ref / n
    h = (lp[0::2] - ref[0::2]) - (lp[1::2] - ref[1::2])
    if loss == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


def reference_dpo_run(model_path: str, data, *, steps: int, micro_batch: int, accum: int, lr: float,
                      warmup_steps: int, min_lr_ratio: float, weight_decay: float, clip: float, seed: int,
                      beta: float, loss: str = "sigmoid", eps_smooth: float = 0.0, betas=(0.9, 0.95), eps=1e-8):
    """DPO training of the whole model in one process: pairs drawn as ``StepSampler`` over pair indices
    (``micro_batch / 2`` pairs per micro-batch, rows ``2i, 2i+1``), reference log-probabilities from the initial
    weights (no grad, before any update), the step's loss the mean of its pairs' losses. Returns (per-step
    losses, {hf_name: fp32 weight})."""
    torch.manual_seed(seed)
    cfg = load_config(model_path)
    names = list(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        names += list(cfg.param_shapes(i))
    params = {n: t.float().requires_grad_(True) for n, t in load_tensors(model_path, cfg, names).items()}
    model = RefDecoder(cfg, params)
    dec = [p for n, p in params.items() if ref_decays(n)]
    nodec = [p for n, p in params.items() if not ref_decays(n)]
    opt = torch.optim.AdamW([{"params": dec, "weight_decay": weight_decay},
                             {"params": nodec, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps, foreach=False)
    pairs = StepSampler(data.train.shape[0] // 2, micro_batch // 2, accum, seed)

    def rows(p):
        return torch.stack([2 * p, 2 * p + 1], 1).reshape(-1)

    step_mbs = [[micro_batch_tensors(data, rows(p)) for p in pairs.micro_batches_for_step(s)] for s in range(steps)]
    with torch.no_grad():  # the reference: the initial model
        refs = [[ref_completion_logps(model, x, y)[0].double() for x, y in mbs] for mbs in step_mbs]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        n_pairs = sum(x.shape[0] // 2 for x, _ in step_mbs[step])
        tot = 0.0
        for (x, y), r in zip(step_mbs[step], refs[step]):
            lp, n = ref_completion_logps(model, x, y)
            ls = ref_dpo_pair_losses(lp, r.float(), n, beta, loss, eps_smooth).sum()
            (ls / n_pairs).backward()
            tot += float(ls.detach())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        for g in opt.param_groups:
            g["lr"] = ref_lr(step, lr=lr, warmup_steps=warmup_steps, total_steps=steps, min_lr_ratio=min_lr_ratio)
        opt.step()
        losses.append(tot / n_pairs)
    return losses, {n: p.detach().float().clone() for n, p in params.items()}
