"""What the last stage minimises (``train.objective``): :class:`SftObjective` (next-token cross-entropy, divided
by the step's target tokens) and :class:`DpoObjective` (preference pairs, divided by the step's pairs).

Either turns the last stage's logits of one micro-batch and its targets into ``(loss sum, statistic sums)``;
the runner divides the loss sum by the whole step's count of :meth:`units` (all micro-batches, all replicas),
so any cut of the step into micro-batches gives the same gradient. Statistic sums are all-reduced with the
loss and turned into per-step metrics by :meth:`metrics`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npu_train.model.dpo import DpoSettings, dpo_losses, sequence_logps
from npu_train.model.llama import IGNORE_INDEX, causal_lm_loss_sum

__all__ = ["PairTargets", "SftObjective", "DpoObjective", "make_objective", "DPO_STATS"]

#: the statistic sums a DPO micro-batch reports, in order (named as TRL's DPOTrainer metrics)
DPO_STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")


@dataclass
class PairTargets:
    """A DPO micro-batch's targets: shifted ``labels`` ``[2k, seq_len]`` int64 (rows ``2i`` chosen, ``2i+1``
    rejected of pair ``i``; ``IGNORE_INDEX`` outside the completions) and ``ref`` ``[2k]`` float64, the
    reference model's summed completion log-probability of each row (nats)."""

    labels: torch.Tensor
    ref: torch.Tensor

    def __post_init__(self) -> None:
        if self.labels.shape[0] % 2 or self.ref.shape != (self.labels.shape[0],):
            raise ValueError(f"pair targets need an even number of rows and one reference value per row, got "
                             f"labels {tuple(self.labels.shape)} and ref {tuple(self.ref.shape)}")


class SftObjective:
    """Summed next-token cross-entropy over the target tokens; the divisor is the step's target tokens."""

    name = "sft"
    stats: tuple = ()

    def tokens(self, labels: torch.Tensor) -> int:
        """Target tokens of one micro-batch's ``labels`` (throughput and, here, the loss divisor)."""
        return int((labels != IGNORE_INDEX).sum())

    units = tokens

    def loss_sum(self, out: torch.Tensor, labels: torch.Tensor, backend, fused: bool) -> tuple[torch.Tensor, list]:
        """``(loss sum fp32 scalar with autograd, [])`` of logits ``out`` ``[B, S, V]``."""
        ls, _ = causal_lm_loss_sum(out, backend.upload(labels), fused=fused)
        return ls, []

    def metrics(self, sums: list, units: float) -> dict:
        return {}


class DpoObjective:
    """DPO / IPO over pairs of rows (:class:`PairTargets`); the divisor is the step's pairs."""

    name = "dpo"
    stats = DPO_STATS

    def __init__(self, settings: DpoSettings):
        self.s = settings

    def tokens(self, t: PairTargets) -> int:
        return int((t.labels != IGNORE_INDEX).sum())

    def units(self, t: PairTargets) -> int:
        """Pairs in the micro-batch."""
        return t.labels.shape[0] // 2

    def logps(self, out: torch.Tensor, labels: torch.Tensor, backend, fused: bool) -> torch.Tensor:
        """Summed completion log-probabilities ``[B]`` fp32 of logits ``out`` ``[B, S, V]`` (the reference pass
        and the policy use the same function)."""
        lp, _ = sequence_logps(out, backend.upload(labels), fused=fused)
        return lp

    def loss_sum(self, out: torch.Tensor, t: PairTargets, backend, fused: bool) -> tuple[torch.Tensor, list]:
        """``(sum of the pairs' losses with autograd, [sums of DPO_STATS])``."""
        labels = backend.upload(t.labels)
        lp, n = sequence_logps(out, labels, fused=fused)
        ref = t.ref.to(device=lp.device, dtype=torch.float64)
        pol = lp
        if self.s.length_normalized:  # IPO: per-token averages of policy and reference
            n = n.clamp(min=1)
            pol, ref = lp / n.to(lp.dtype), ref / n.to(ref.dtype)
        terms = dpo_losses(pol[0::2], pol[1::2], ref[0::2].float(), ref[1::2].float(), self.s)
        lpd, rs = lp.detach().double(), t.ref.to(device=lp.device, dtype=torch.float64)
        # rewards as TRL logs them for every loss: beta x the summed (not per-token) log-ratio
        cr, rr = self.s.beta * (lpd[0::2] - rs[0::2]), self.s.beta * (lpd[1::2] - rs[1::2])
        sums = [float(cr.sum()), float(rr.sum()), float((cr > rr).sum()), float(lpd[0::2].sum()),
                float(lpd[1::2].sum())]
        return terms.losses.sum(), sums

    def metrics(self, sums: list, units: float) -> dict:
        """Per-pair means of the step's all-reduced ``sums`` over ``units`` pairs, plus ``rewards/margins``."""
        n = max(float(units), 1.0)
        m = {k: float(v) / n for k, v in zip(self.stats, sums)}
        m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
        return m


def make_objective(train) -> "SftObjective | DpoObjective":
    """The objective of a :class:`~npu_train.runtime.spec.TrainSpec` (``objective``, ``dpo_*`` fields)."""
    if getattr(train, "objective", "sft") == "dpo":
        return DpoObjective(DpoSettings(beta=train.dpo_beta, loss=train.dpo_loss,
                                        label_smoothing=train.dpo_label_smoothing))
    return SftObjective()
