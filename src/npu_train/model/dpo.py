"""Direct Preference Optimization losses from per-sequence log-probabilities (the formulas only; the pipeline
side is :class:`npu_train.pipeline.objective.DpoObjective`).

DPO (Rafailov et al., NeurIPS 2023, eq. 7): with ``h = (log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) -
log ref(y_l|x))`` the pair's loss is ``-log sigmoid(beta h)``; conservative DPO / label smoothing ``eps``
(Mitchell 2023, as TRL's ``label_smoothing``): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
IPO (Azar et al. 2023, eq. 17): ``(h - 1 / (2 beta))^2`` with log-probabilities averaged over the completion
tokens (as TRL). Implicit rewards: ``beta (log pi(y|x) - log ref(y|x))`` for chosen and rejected.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from npu_train.model.headops import IGNORE_INDEX, cross_entropy_sum

__all__ = ["DPO_LOSSES", "DpoSettings", "PairTerms", "dpo_losses", "sequence_logps"]

#: ``dpo.loss`` values: the paper's sigmoid loss and IPO
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DpoSettings:
    """``dpo.*``: ``beta`` (> 0, the KL strength), ``loss`` (one of :data:`DPO_LOSSES`), ``label_smoothing``
    (cDPO's ``eps`` in [0, 0.5), sigmoid loss only)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0

    @property
    def length_normalized(self) -> bool:
        """IPO compares log-probabilities averaged over the completion tokens (sigmoid: summed)."""
        return self.loss == "ipo"


@dataclass
class PairTerms:
    """Per-pair values of :func:`dpo_losses`, each ``[n_pairs]`` fp32: ``losses`` (with autograd),
    ``chosen_rewards`` / ``rejected_rewards`` (detached, nats scaled by beta)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps [B] fp32, n_tokens [B] int64)``: each row's summed ``log p(label_t | ...)`` over the positions
    whose label is not ``IGNORE_INDEX`` (the completion tokens), from ``logits`` ``[B, S, V]`` and shifted
    ``labels`` ``[B, S]`` int64. ``fused``: the one-pass backward of :func:`cross_entropy_sum`, row by row
    (one row's ``[S, V]`` log-softmax alive at a time in the backward)."""
    rows = []
    for b in range(logits.shape[0]):
        lg, lb = logits[b], labels[b]
        rows.append(-(cross_entropy_sum(lg, lb) if fused else
                      F.cross_entropy(lg.float(), lb, ignore_index=IGNORE_INDEX, reduction="sum")))
    return torch.stack(rows), (labels != IGNORE_INDEX).sum(dim=1)


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               s: DpoSettings) -> PairTerms:
    """The per-pair loss and implicit rewards of policy log-probabilities ``chosen`` / ``rejected`` ``[N]``
    against the reference's ``ref_chosen`` / ``ref_rejected`` ``[N]`` (summed, or for IPO averaged, over the
    completion tokens by the caller). Raises ValueError for an unknown ``s.loss``."""
    ref_chosen = ref_chosen.to(chosen.dtype)
    ref_rejected = ref_rejected.to(chosen.dtype)
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if s.loss == "sigmoid":
        eps = float(s.label_smoothing)
        losses = -F.logsigmoid(s.beta * h) * (1.0 - eps)
        if eps:
            losses = losses - F.logsigmoid(-s.beta * h) * eps
    elif s.loss == "ipo":
        losses = (h - 1.0 / (2.0 * s.beta)) ** 2
    else:
        raise ValueError(f"dpo.loss={s.loss!r}: use one of {list(DPO_LOSSES)}")
    return PairTerms(losses, (s.beta * (chosen - ref_chosen)).detach(), (s.beta * (rejected - ref_rejected)).detach())
