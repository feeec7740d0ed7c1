"""Sparse mixture-of-experts MLP (:class:`SparseMoe`) of Qwen3-MoE, Qwen2-MoE and Mixtral, with the checkpoint's
parameter names (one module per expert: ``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
``w1`` / ``w3`` / ``w2``; router ``gate``; Qwen2-MoE's ``shared_expert`` + ``shared_expert_gate``), and the
router statistics of the load-balancing loss (:class:`RouterRecorder`).

Routing follows transformers 5.25 (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``):
``logits = x @ gate^T`` in the compute dtype; ``p = softmax(logits)`` in fp32; ``(w, idx) = topk(p, k)``;
``w /= sum(w)`` when ``norm_topk_prob`` (Mixtral: always); Qwen casts ``w`` back to the compute dtype before
weighting the experts' outputs, Mixtral weights in fp32 and casts the sum. The weighted outputs are summed per
token over the ``k`` slots in one reduction, as transformers' default experts implementation (``grouped_mm``,
``integrations/moe.py::grouped_mm_experts_forward``) does.

Compute: the ``N * k`` (token, expert) pairs are sorted by expert; every expert with tokens runs one SwiGLU on
its contiguous block (three matmuls), never a loop over tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import FAMILIES, LlamaConfig

__all__ = ["Expert", "SparseMoe", "RouterRecorder", "LayerRouting"]


class Expert(nn.Module):
    """One SwiGLU expert ``down(silu(gate(x)) * up(x))`` whose three ``nn.Linear`` (no bias) carry the family's
    checkpoint names ``names = (gate, up, down)`` (``gate_proj, up_proj, down_proj``; Mixtral ``w1, w3, w2``).
    ``forward(x [n, H]) -> [n, H]``."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = tuple(names)
        g, u, d = self.names
        setattr(self, g, nn.Linear(hidden, inter, bias=False))
        setattr(self, u, nn.Linear(hidden, inter, bias=False))
        setattr(self, d, nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, n) for n in self.names)
        return d(F.silu(g(x)) * u(x))


@dataclass
class LayerRouting:
    """One sparse layer's router statistics of one forward (transformers' ``load_balancing_loss_func`` terms):
    ``counts`` fp32 ``[E]`` top-k assignments per expert (no gradient), ``prob_sum`` fp32 ``[E]`` routing
    probabilities summed over the rows (with gradient when the aux loss is on, else None), ``rows`` tokens."""

    layer: int
    counts: torch.Tensor
    prob_sum: Optional[torch.Tensor]
    rows: int


@dataclass
class RouterRecorder:
    """Collects :class:`LayerRouting` of a stage's sparse layers while :attr:`active` (the training forward;
    a recomputation during backward or an evaluation pass records nothing). ``with_probs``: keep the
    differentiable probability sums (aux loss on)."""

    active: bool = False
    with_probs: bool = False
    records: list = field(default_factory=list)

    def start(self, with_probs: bool) -> None:
        self.active, self.with_probs, self.records = True, bool(with_probs), []

    def take(self) -> list:
        """Stop recording; the records of the forward since :meth:`start`."""
        out, self.records, self.active = self.records, [], False
        return out


class SparseMoe(nn.Module):
    """The sparse MLP block of a decoder layer (module names as the family's checkpoint): router ``gate``
    ``nn.Linear(H, E)``, ``experts`` ``ModuleList`` of :class:`Expert` ``[I_e]``, and for Qwen2-MoE
    ``shared_expert`` (:class:`Expert` ``[I_s]``) scaled by ``sigmoid(shared_expert_gate(x))`` ``[1, H]``.
    ``forward(x [B, S, H]) -> [B, S, H]`` in ``x.dtype``. ``recorder``: where the router statistics go."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, recorder: Optional[RouterRecorder] = None):
        super().__init__()
        fam = FAMILIES[cfg.family]
        H = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.mixtral = cfg.family == "mixtral"
        self.norm_topk_prob = True if self.mixtral else bool(cfg.norm_topk_prob)
        self.gate = nn.Linear(H, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Expert(H, cfg.moe_intermediate_size, fam.expert_projs) for _ in range(cfg.num_experts)])
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.recorder = recorder

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [N, E] x.dtype, fp32 probabilities [N, E], weights [N, k], experts int64 [N, k])`` of
        ``x [N, H]``: the family's router (module docstring); weights in fp32 for Mixtral, else ``x.dtype``."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if not self.mixtral:
            w = w.to(logits.dtype)
        return logits, probs, w, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        xf = x.reshape(-1, H)
        logits, probs, w, idx = self.route(xf)
        rec = self.recorder
        if rec is not None and rec.active:
            rec.records.append(self._routing_stats(logits, probs, idx, rec.with_probs))
        out = self.experts_forward(xf, w, idx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return out.reshape(B, S, H)

    def experts_forward(self, xf: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``sum_j w[t, j] * expert_{idx[t, j]}(x[t])`` per token ``t`` of ``xf [N, H]`` -> ``[N, H]`` in
        ``xf.dtype``: the ``N * k`` pairs sorted by expert, one SwiGLU per expert on its block, each product weighted,
        put back in (token, slot) order and summed over the ``k`` slots in one reduction (then cast) — the
        arithmetic of transformers' default ``experts_implementation="grouped_mm"``."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = xf.index_select(0, order // k)
        parts = [self.experts[e](blk) for e, blk in enumerate(xs.split(counts)) if counts[e]]
        ys = torch.cat(parts) if len(parts) > 1 else parts[0]
        ys = ys * w.reshape(-1).index_select(0, order).unsqueeze(-1)  # Mixtral: fp32 weights promote
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return ys.index_select(0, inv).view(N, k, -1).sum(dim=1).to(xf.dtype)

    def _routing_stats(self, logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor,
                       with_probs: bool) -> LayerRouting:
        """transformers' ``load_balancing_loss_func`` per layer: softmax of the logits in *their* dtype (the
        routing's fp32 ``probs`` when the logits are fp32), its own top-k, assignment counts [E] and fp32
        probability sums [E]."""
        if logits.dtype != torch.float32:
            probs = torch.softmax(logits, dim=-1)
            idx = torch.topk(probs, self.top_k, dim=-1).indices
        counts = torch.bincount(idx.reshape(-1).detach(), minlength=self.num_experts).to(torch.float32)
        prob_sum = probs.float().sum(dim=0) if with_probs else None
        return LayerRouting(self.layer_idx, counts, prob_sum, int(logits.shape[0]))
