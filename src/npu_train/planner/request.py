"""What :func:`~npu_train.planner.search.make_plan` is asked: :class:`PlanRequest` (the launcher builds
it from the config in one place, ``runtime/job.py::plan_request``)."""
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
    """A placement to plan: ``model`` on ``cards`` (one per pipeline stage, pipeline order) for ``shape``."""

    model: LlamaConfig
    shape: RunShape
    cards: Sequence[Card]
    rates: Union[Rates, Sequence[Rates]]  # one for all cards or one per card, unresolved
    #: decoder layers per card, summing to the model's; None: the fastest split that fits (ties: balanced)
    split: Optional[Sequence[int]] = None
    #: "auto" (per card the most that fit within the headroom), an int for every card, or one per card
    resident_layers: Union[str, int, Sequence[int]] = "auto"
    host_ram_bytes: Optional[int] = None  # when given, the offloaded fp32 state of all cards must fit
    #: optimizer state of embedding / final norm / untied lm_head on the card; None: when all layers are
    nonlayer_resident: Optional[bool] = None
    strict: bool = True  # False: an infeasible placement returns fits=False (layout errors still raise)
    threads: Optional[int] = None  # torch threads per card process; None: usable cores / card processes
    host_cores: Optional[int] = None  # cores the cpu cards share; None: threads.usable_cores()
    headroom: float = DEFAULT_HEADROOM  # capacity fraction auto keeps free (explicit counts: full capacity)
    memory_terms: Optional[Sequence[MemoryTerms]] = None  # one per card; None: the kinds' defaults
    dp: int = 1  # data-parallel replicas; cards are one replica's stages
    zero: int = 0  # 1 = ZeRO-1: each card keeps 1/dp of its stage's optimizer state
    #: card processes on one host, sharing its memory bandwidth (host AdamW); 0: every card of the job
    cards_per_host: int = 0
    #: a refusal plans its card-level fixes and names only those that fit (``search.checked_fixes``); False: names
    #: them unchecked (``train.schedule=auto`` planning each candidate, whose refusals it only summarises)
    check_fixes: bool = True
