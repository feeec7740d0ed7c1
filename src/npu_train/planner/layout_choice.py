"""``parallel.dp=auto``: the data-parallel degree, pipeline depth, schedule, split and micro-batch size with the
highest predicted tokens/s within memory, for a fixed global batch (:func:`choose_layout`).

For every ``dp`` dividing the cards (``P = cards / dp`` stages, at most the model's layers) and every micro-batch
size ``b`` dividing the global batch's share of a replica (``accum = G / (dp b)``), the request is planned with
the schedule asked for (``auto``: :func:`~npu_train.planner.schedule_choice.choose_schedule`, the fastest that
fits; its split is the planner's own :func:`~npu_train.planner.search.fastest_split`). Every layout processes
the same tokens per step, so the highest tokens/s is the shortest predicted step; ties go to fewer replicas,
then to larger micro-batches. With the layout as written (``given``: one pipeline, the command's micro-batch x
accum) among the candidates, another one is taken only when predicted :data:`LAYOUT_MARGIN` faster: a re-split
takes the same sequences per step and divides the summed loss by the same target tokens
(``runtime/trainer.py``), so it is the same training up to the order of the gradient sums (float rounding), and
within the cost model's own error the command as written stays. The chosen layout, why, and the next two are
said in :attr:`LayoutChoice.lines`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from npu_train.planner.plan import Plan
from npu_train.planner.request import PlanRequest
from npu_train.planner.search import make_plan
from npu_train.planner.spec import PlacementError, gib

__all__ = ["LAYOUT_MARGIN", "Layout", "LayoutChoice", "choose_layout", "layouts"]

#: how much shorter another layout's predicted step must be than the layout as written (``given``)'s to be taken
LAYOUT_MARGIN = 0.05


@dataclass(frozen=True)
class Layout:
    """One candidate: ``dp`` replicas of a ``pp``-stage pipeline, ``micro_batch`` sequences x ``accum``
    micro-batches per replica and step."""

    dp: int
    pp: int
    micro_batch: int
    accum: int

    def label(self) -> str:
        return f"dp={self.dp} x pp={self.pp}, micro-batch {self.micro_batch} x accum {self.accum}"


@dataclass
class Option:
    """A planned :class:`Layout`: its ``schedule`` / ``recompute`` and ``plan`` (None: ``why_not``)."""

    layout: Layout
    schedule: str
    recompute: bool
    plan: Optional[Plan]
    why_not: str = ""
    recompute_attention: bool = False

    @property
    def step_s(self) -> float:
        return self.plan.step_time_s if self.plan is not None else float("inf")

    def summary(self) -> str:
        """``dp=2 x pp=4, micro-batch 1 x accum 16, zbv: step 4.91 s, 13,350 tokens/s, fullest card 41.2 GiB``."""
        if self.plan is None:
            return f"{self.layout.label()}: {self.why_not}"
        mem = max(st.mem["total"] for st in self.plan.stages)
        extra = " + recompute" if self.recompute else " + attention recompute" if self.recompute_attention else ""
        extra += " + vocabulary parallel" if self.plan.shape.vocab_parallel else ""
        return (f"{self.layout.label()}, {self.schedule}{extra}: step "
                f"{self.plan.step_time_s:.3g} s, {self.plan.tokens_per_s:,.0f} tokens/s, fullest card {gib(mem):.1f} GiB")


def _plan_given(req: PlanRequest) -> tuple[Optional[Plan], str]:
    """``(plan that fits, "")`` of ``req``, or ``(None, why not)``."""
    try:
        plan = make_plan(req)
    except (PlacementError, ValueError) as e:
        return None, str(e).split(";")[0]
    return (plan, "") if plan.fits else (None, "does not fit")


@dataclass
class LayoutChoice:
    """The chosen :class:`Option` and every option tried, fastest first (``options[0]`` is ``chosen``)."""

    chosen: Option
    options: list = field(default_factory=list)
    #: the layout as written (:func:`choose_layout`'s ``given``) when it was planned, else None
    given: Optional[Option] = None

    @property
    def lines(self) -> list[str]:
        """What the plan prints: the choice, why, and the next two alternatives."""
        fits = [o for o in self.options if o.plan is not None]
        out = [f"parallel.dp=auto: {self.chosen.summary()}"]
        g, c = self.given, self.chosen
        if g is not None and g.plan is not None and c is g and fits[0] is not g:
            out.append(f"  why: the layout as written; the fastest of {len(fits)} that fit ({len(self.options)} tried), "
                       f"{fits[0].layout.label()}, is predicted {(1 - fits[0].step_s / g.step_s) * 100:.1f} % faster, "
                       f"within the {LAYOUT_MARGIN * 100:.0f} % a re-split must win by")
        else:
            out.append(f"  why: the shortest predicted step of {len(fits)} layout(s) that fit, of {len(self.options)} "
                       "tried (same global batch, so the most tokens/s)")
        if g is not None and c is not g:
            was = f"step {g.step_s:.3g} s" if g.plan is not None else g.why_not
            out.append(f"  re-split from the layout as written ({g.layout.label()}, {was}): the same sequences per "
                       "step and the same loss divisor, gradients summed in another order (equal up to float "
                       "rounding); parallel.dp=1 keeps it as written")
        for k, o in enumerate([o for o in fits if o is not c][:2], 1):
            out.append(f"  alternative {k}: {o.summary()}")
        return out


def layouts(n_cards: int, num_layers: int, global_batch: int, micro_batches=(1, 2, 4, 8),
            pp: Optional[int] = None) -> list[Layout]:
    """Every :class:`Layout` of ``global_batch`` sequences per step on ``n_cards``: ``dp`` dividing the cards with
    ``pp = n_cards / dp <= num_layers`` (or only the given ``pp``), micro-batch sizes from ``micro_batches``
    dividing ``global_batch / dp``."""
    out = []
    for dp in range(1, n_cards + 1):
        P = n_cards // dp
        if n_cards % dp or P > num_layers or (pp is not None and P != pp) or global_batch % dp:
            continue
        for b in micro_batches:
            if (global_batch // dp) % b == 0:
                out.append(Layout(dp, P, b, global_batch // (dp * b)))
    return out


def choose_layout(candidates: list, request: Callable[[Layout], PlanRequest],
                  schedule: str = "auto", recompute_attention="auto", vocab: bool = False,
                  given: Optional[Layout] = None) -> LayoutChoice:
    """Plan every layout of ``candidates`` (``request(layout)`` builds its request) with ``schedule`` (``auto``:
    the fastest that fits, with ``recompute_attention`` and ``vocab`` as
    :func:`~npu_train.planner.schedule_choice.choose_schedule` takes them; a given schedule: with ``vocab``, also
    with vocabulary parallelism, :func:`~npu_train.planner.schedule_choice.with_vocab`) and return them fastest
    first (module docstring); ``given`` (one of ``candidates``, the layout as written) is kept unless another is
    predicted :data:`LAYOUT_MARGIN` faster. Raises PlacementError naming the layouts tried when none fits."""
    from npu_train.planner.schedule_choice import choose_schedule, with_vocab

    opts = []
    for lay in candidates:
        req = request(lay)
        if schedule == "auto":
            ch = choose_schedule(replace(req, strict=False), recompute_attention, vocab)
            ok = ch.plan is not None and ch.plan.fits
            opts.append(Option(lay, ch.schedule, ch.recompute, ch.plan if ok else None, "" if ok else "does not fit",
                               ch.recompute_attention))
            continue
        named = replace(req, shape=replace(req.shape, schedule=schedule))
        plan, why = _plan_given(named)
        if vocab:
            plan, why = with_vocab(named, plan, why, _plan_given)
        opts.append(Option(lay, schedule, bool(req.shape.recompute), plan, why))
    opts.sort(key=lambda o: (o.step_s, o.layout.dp, -o.layout.micro_batch))
    if not opts or opts[0].plan is None:
        raise PlacementError("parallel.dp=auto: no layout fits: " + "; ".join(o.summary() for o in opts[:6])
                             + "; fix: more cards, train.recompute=true, a smaller data.seq_len or global batch")
    g = next((o for o in opts if o.layout == given), None)
    keep = g is not None and g.plan is not None and opts[0].step_s > g.step_s * (1.0 - LAYOUT_MARGIN)
    return LayoutChoice(g if keep else opts[0], opts, g)
