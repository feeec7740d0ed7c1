"""The planner: where the model's layers go, what each card holds, how long a step takes, and
how fast this machine is.

Modules (dependencies point down the list; none imports torch, so a dry run ``plan=true`` stays
torch-free; a cuda card's capacity query is :func:`npu_train.backends.spec.default_capacity`):

- :mod:`~npu_train.planner.spec`: :class:`RunShape`, :class:`PlacementError`,
  GB/GiB conversion.
- :mod:`~npu_train.planner.threads`: torch threads per card process (:func:`threads_per_card`),
  usable cores (affinity, cgroup quota).
- :mod:`~npu_train.planner.fit`: figures fitted from the job's finished runs.
- :mod:`~npu_train.planner.rates`: :class:`Rates`, defaults per card kind, calibration profiles
  and fitted figures (:func:`load_rates`), the thread-count rule.
- :mod:`~npu_train.planner.memterms`: the per-kind workspace / loaded-module-cache constants and
  where each comes from (measured, fitted, assumed), memory calibration profiles.
- :mod:`~npu_train.planner.memory`: the memory model (per-stage terms, activations, logits,
  in-flight micro-batches from the schedule).
- :mod:`~npu_train.planner.plan`: :class:`Plan`, :class:`StagePlan`.
- :mod:`~npu_train.planner.cost`: the step-time model.
- :mod:`~npu_train.planner.table`: the plan table and the dry-run report.
- :mod:`~npu_train.planner.search`: :func:`make_plan` (split and resident-layer search).

Measuring a card kind (``calibrate=true``) is :mod:`npu_train.calibrate`, which the planner does not import.
"""
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
