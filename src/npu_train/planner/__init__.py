"""The planner, a pure model (no torch): where the layers go, what each card holds, how long a step takes.

Start at :func:`make_plan` (:class:`PlanRequest` -> :class:`Plan`) and :func:`plan_table`; the model
term by term, with the source of every figure, is ``docs/planner.md``."""
from __future__ import annotations

from npu_train.planner.memory import (
    ATTENTION,
    WORKSPACE,
    activation_bytes_per_layer,
    in_flight_micro_batches,
    logits_bytes,
    saved_logits_bytes,
)
from npu_train.planner.memterms import (
    DEFAULT_MEMORY_TERMS,
    MemoryTerms,
    fit_memory_terms,
    load_memory_terms,
    save_memory_terms,
)
from npu_train.planner.plan import Plan, StagePlan
from npu_train.planner.rates import DEFAULT_RATES, Rates, calibration_path, load_rates
from npu_train.planner.table import format_plan, plan_table
from npu_train.planner.request import DEFAULT_HEADROOM, PlanRequest
from npu_train.planner.search import balanced_split, make_plan
from npu_train.planner.spec import PlacementError, RunShape, gb, gib
from npu_train.planner.threads import threads_per_card, usable_cores

__all__ = [
    "PlacementError", "RunShape", "Plan", "StagePlan", "Rates", "DEFAULT_RATES",
    "ATTENTION", "WORKSPACE", "gb", "gib", "calibration_path",
    "load_rates", "activation_bytes_per_layer", "logits_bytes", "saved_logits_bytes",
    "in_flight_micro_batches", "balanced_split", "make_plan", "PlanRequest", "format_plan", "plan_table", "threads_per_card",
    "usable_cores",
    "DEFAULT_HEADROOM", "DEFAULT_MEMORY_TERMS", "MemoryTerms",
    "load_memory_terms", "fit_memory_terms", "save_memory_terms",
]
