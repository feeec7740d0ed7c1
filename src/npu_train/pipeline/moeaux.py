"""The router load-balancing loss of a mixture-of-experts model split into pipeline stages (:class:`StageRouting`),
and each stage's expert load.

transformers (``load_balancing_loss_func``, 5.25) computes, per forward, over the router logits of *all* sparse
layers at once: ``aux = E * sum_e (T_e / R) * (P_e / R)`` with ``T_e`` the top-k assignments of expert ``e``
summed over layers (no gradient), ``P_e`` its softmax probabilities summed over layers and tokens, ``R`` the
token rows summed over layers; the model's loss is ``CE + router_aux_loss_coef * aux``. One micro-batch is one
such forward here, and the step's objective is ``CE_sum / target tokens + w * mean over the step's micro-batches
(all replicas) of aux``.

``aux`` is not a sum of per-stage terms, so each stage's partial sums ``(T, P, R)`` travel with the activation to
the next stage (header field ``moe`` of the boundary message); the last stage has the global sums, computes
``aux`` and ``c_e = d (w * aux / n) / d P_e = w * E * T_e / (n * R^2)`` (``n`` micro-batches), and ``c``
travels back with the input gradient. Every stage then adds ``sum_e c_e * P_e(local)`` to what it
backpropagates: the exact gradient of the global loss for its routers (and, through them, its hidden states).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from npu_train.errors import ConfigError

__all__ = ["aux_loss_weight", "check_aux_schedule", "RouterTotals", "StageRouting"]


def aux_loss_weight(override: Optional[float], mcfg) -> float:
    """The load-balancing loss weight of a run: ``train.moe_aux_loss`` when set, else the model's
    ``router_aux_loss_coef`` when its ``output_router_logits`` is true, else 0 (off); 0 for a dense model."""
    if not getattr(mcfg, "is_moe", False):
        return 0.0
    if override is None:
        return float(mcfg.router_aux_loss_coef) if mcfg.output_router_logits else 0.0
    return float(override)


def check_aux_schedule(weight: float, schedule: str) -> None:
    """ConfigError for the load-balancing loss with a split-backward schedule (its per-layer graph cuts would
    drop the routers' extra gradient) or a two-chunk one (the statistics would cross a card's own chunks)."""
    from npu_train.pipeline.schedule import CHUNKED_SCHEDULES, SPLIT_BACKWARD

    if weight > 0 and (schedule in SPLIT_BACKWARD or schedule in CHUNKED_SCHEDULES):
        raise ConfigError(f"train.schedule={schedule} does not combine with the mixture-of-experts load-balancing "
                          "loss: use train.schedule=1f1b, or train.moe_aux_loss=0 to train without it")


@dataclass
class RouterTotals:
    """Partial sums of the load-balancing loss over the sparse layers seen so far (float64 CPU): ``counts``
    ``[E]`` top-k assignments, ``probs`` ``[E]`` summed probabilities (values only), ``rows`` token rows."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: float

    @classmethod
    def zeros(cls, E: int) -> "RouterTotals":
        return cls(torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64), 0.0)

    @classmethod
    def from_meta(cls, meta: Optional[dict], E: int) -> "RouterTotals":
        """From a boundary header's ``moe`` field (None: zeros); ValueError for a malformed one."""
        if not meta:
            return cls.zeros(E)
        t, p = meta.get("T"), meta.get("P")
        if not (isinstance(t, list) and isinstance(p, list) and len(t) == len(p) == E):
            raise ValueError(f"malformed router statistics in a boundary message (expected {E} experts)")
        return cls(torch.tensor(t, dtype=torch.float64), torch.tensor(p, dtype=torch.float64), float(meta["R"]))

    def to_meta(self) -> dict:
        return {"T": self.counts.tolist(), "P": self.probs.tolist(), "R": self.rows}

    def aux(self) -> float:
        """transformers' ``load_balancing_loss_func`` value of these (global) sums."""
        E, R = self.counts.numel(), max(self.rows, 1.0)
        return float(E * torch.sum((self.counts / R) * (self.probs / R)))


class StageRouting:
    """One stage's part of the load-balancing loss and its expert load, step by step.

    ``recorder``: the stage module's :class:`~npu_train.model.moe.RouterRecorder`; ``weight``: the loss weight
    (0: statistics for the load only); ``micro_total``: micro-batches per optimizer step over all replicas;
    ``last``: this stage computes the loss. Per micro-batch ``m``: :meth:`start` before the forward,
    :meth:`finish` after it (returns the header field for the next stage), :meth:`loss_term` (last stage),
    :meth:`backward_root` with the gradient's header field, :meth:`grad_meta` for the previous stage."""

    def __init__(self, recorder, num_experts: int, weight: float, micro_total: int, last: bool):
        self.recorder, self.E, self.weight, self.n, self.last = recorder, num_experts, float(weight), micro_total, last
        self.begin_step()

    @property
    def on(self) -> bool:
        """The load-balancing loss is part of the objective."""
        return self.weight > 0

    def begin_step(self) -> None:
        self.layer_counts: dict[int, torch.Tensor] = {}
        self.prob_sums: dict[int, Optional[torch.Tensor]] = {}
        self.coefs: dict[int, torch.Tensor] = {}
        self.aux_sum = 0.0

    def start(self) -> None:
        self.recorder.start(with_probs=self.on)

    def finish(self, m: int, upstream: Optional[dict]) -> Optional[dict]:
        """Take micro-batch ``m``'s records; with the loss on, add them to ``upstream``'s partial sums: returns the
        next stage's header field (None on the last stage, which computes ``aux`` and ``c`` here)."""
        records = self.recorder.take()
        for r in records:
            c = r.counts.detach().to("cpu", torch.float64)
            self.layer_counts[r.layer] = self.layer_counts.get(r.layer, 0) + c
        if not self.on:
            return None
        tot = RouterTotals.from_meta(upstream, self.E)
        local = None
        for r in records:
            local = r.prob_sum if local is None else local + r.prob_sum
            tot.counts += r.counts.detach().to("cpu", torch.float64)
            tot.rows += r.rows
        self.prob_sums[m] = local
        if local is not None:
            tot.probs += local.detach().to("cpu", torch.float64)
        if not self.last:
            return tot.to_meta()
        self.aux_sum += tot.aux()
        R = max(tot.rows, 1.0)
        self.coefs[m] = self.weight * self.E * tot.counts / (self.n * R * R)
        return None

    def _root(self, m: int, coef: torch.Tensor) -> Optional[torch.Tensor]:
        local = self.prob_sums.pop(m, None)
        if local is None:
            return None
        return torch.sum(coef.to(device=local.device, dtype=local.dtype) * local)

    def loss_term(self, m: int) -> Optional[torch.Tensor]:
        """Last stage: the scalar whose gradient is the loss's through this stage's routers (None: loss off or
        no sparse layer here)."""
        return self._root(m, self.coefs[m]) if self.on else None

    def backward_root(self, m: int, meta: Optional[dict]) -> Optional[torch.Tensor]:
        """Other stages: the same scalar from the ``c`` of the gradient's header field ``meta`` (kept for
        :meth:`grad_meta`)."""
        if not self.on:
            return None
        if not meta or not isinstance(meta.get("c"), list) or len(meta["c"]) != self.E:
            raise ValueError(f"micro-batch {m}: the gradient message lacks the router loss coefficients")
        self.coefs[m] = torch.tensor(meta["c"], dtype=torch.float64)
        return self._root(m, self.coefs[m])

    def grad_meta(self, m: int) -> Optional[dict]:
        """The header field sent upstream with micro-batch ``m``'s input gradient."""
        c = self.coefs.pop(m, None)
        return None if c is None else {"c": c.tolist()}

    def expert_load(self) -> Optional[float]:
        """The step's expert load on this stage: over its sparse layers, the largest ``max_e T_e / mean_e T_e``
        of the top-k assignments summed over the step's micro-batches (1.0: balanced; None: no sparse layer)."""
        worst = None
        for c in self.layer_counts.values():
            mean = float(c.mean())
            if mean > 0:
                r = float(c.max()) / mean
                worst = r if worst is None else max(worst, r)
        return worst
