"""What :func:`~npu_train.planner.search.make_plan` is asked: :class:`PlanRequest`, one typed value
(the launcher builds it from the config in one place, ``runtime/job.py::plan_request``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from npu_train.hardware import Card
from npu_train.model.config import LlamaConfig
from npu_train.planner.memterms import MemoryTerms
from npu_train.planner.rates import Rates
from npu_train.planner.spec import RunShape

__all__ = ["DEFAULT_HEADROOM", "PlanRequest"]

#: fraction of each card's capacity the ``auto`` placement keeps free (``placement.headroom``):
#: the model's assumed terms are not exact (issue 12: the old model put 2 cards at 47.42 of 47.5 GiB)
DEFAULT_HEADROOM = 0.05


@dataclass(frozen=True)
class PlanRequest:
    """A placement to plan: ``model`` on ``cards`` (one per pipeline stage, pipeline order) for ``shape``.

    Attributes:
        rates: one :class:`Rates` for all cards, or one per card (resolved for ``threads`` by the planner).
        split: decoder layers per card (summing to ``model.num_layers``); ``None``: the fastest split that fits
            (ties go to the balanced split).
        resident_layers: ``"auto"`` (per card the most that fit within the headroom), an int (the same count
            on every card) or one count per card.
        host_ram_bytes: when given, the offloaded fp32 master + moments of all cards must fit in it, bytes.
        nonlayer_resident: optimizer state of embedding / final norm / untied ``lm_head`` on the card (True),
            on the host (False), or (``None``) on the card exactly when all of the card's layers are resident.
        strict: False: an infeasible placement returns a plan with ``fits=False`` instead of raising
            (layout errors always raise).
        threads: torch threads of every card process; ``None``: the usable cores divided among the
            ``dp * len(cards)`` card processes (:func:`~npu_train.planner.threads.threads_per_card`).
        host_cores: cores the cpu cards share; ``None``: :func:`~npu_train.planner.threads.usable_cores`.
        headroom: fraction of every card's capacity that ``auto`` keeps free, ``0 <= headroom < 1``
            (explicit resident counts are checked against the full capacity).
        memory_terms: one :class:`MemoryTerms` per card; ``None``: the kinds' defaults.
        dp: data-parallel replicas of the pipeline (``cards`` are one replica's stages).
        zero: 1 = ZeRO-1: each card keeps ``1/dp`` of its stage's optimizer state.
    """

    model: LlamaConfig
    shape: RunShape
    cards: Sequence[Card]
    rates: Union[Rates, Sequence[Rates]]
    split: Optional[Sequence[int]] = None
    resident_layers: Union[str, int, Sequence[int]] = "auto"
    host_ram_bytes: Optional[int] = None
    nonlayer_resident: Optional[bool] = None
    strict: bool = True
    threads: Optional[int] = None
    host_cores: Optional[int] = None
    headroom: float = DEFAULT_HEADROOM
    memory_terms: Optional[Sequence[MemoryTerms]] = None
    dp: int = 1
    zero: int = 0
