"""``train.schedule=auto``: the fastest pipeline schedule whose plan fits (:func:`choose_schedule`).

Every candidate (1F1B, the zero-bubble schedules ZB, ZB-H1, ZB-H2, and the two-chunk ZB-V and interleaved
1F1B, the latter when the micro-batches divide by the stages) is planned with the same request;
the one with the shortest predicted step time among those that fit wins (ties: the earlier in
:data:`CANDIDATES`, the one holding fewer micro-batches). A two-chunk schedule must beat the best one-chunk
schedule by a margin (:func:`chunk_margin`): on cpu cards :data:`CHUNK_MARGIN`, for the extra boundary copies
the cost model leaves out there (each micro-batch crosses every card twice) and the second set of per-chunk
actions; on accelerator cards, whose copies are in the step time (``CostModel.boundary_copies``, copy threads),
:data:`ACCEL_CHUNK_MARGIN`, for those actions' host-side overhead alone (measured on this project's CPU hosts:
experiments/2026-12-06-eight-cards.md §16). When none fits, 1F1B with activation recompute is
tried, and interleaved 1F1B with recompute (the zero-bubble schedules do not combine with recompute). With
``recompute`` asked for, only 1F1B, GPipe and interleaved 1F1B are candidates. On one pipeline stage the two-chunk
schedules are not (their chunks hand activations between cards). The choice and the runners-up are said in one
line (:attr:`ScheduleChoice.why`).

Where a card's attention kernel keeps the ``[b, a, S, S]`` probabilities (``memory.ATTENTION`` eager: furiosa),
every candidate is also planned with the attention core recomputed (``RunShape.recompute_attention``: the
probabilities dropped, the core's forward FLOPs again in B), and the faster of the two plans that fit is the
candidate's. With ``vocab`` (``parallel.vocab=auto``) every candidate is also planned with vocabulary parallelism
(``RunShape.vocab_parallel``), kept when it is predicted :data:`VOCAB_MARGIN` faster: the blocking exchange and the
cards' synchronisation at each joint action are modelled from assumed rates, not measured on a card.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from npu_train.planner.plan import Plan
from npu_train.planner.request import PlanRequest
from npu_train.planner.search import make_plan, plan_beats, state_floor_over_cards
from npu_train.planner.spec import PlacementError

__all__ = ["ACCEL_CHUNK_MARGIN", "CANDIDATES", "CHUNK_MARGIN", "ScheduleChoice", "choose_schedule", "chunk_margin",
           "refusals_summary"]

#: in order of preference at equal predicted step time (fewest micro-batches held first)
CANDIDATES = ("1f1b", "zb", "zb-h1", "zb-h2", "zbv", "interleaved")
#: how much shorter a two-chunk schedule's predicted step must be than the best one-chunk schedule's where any card
#: is a cpu card (their boundary copies are not in the step time)
CHUNK_MARGIN = 0.05
#: the same where every card is an accelerator (copies modelled; the margin stands for the second set of
#: per-chunk actions' host overhead: experiments/2026-12-06-eight-cards.md §16)
ACCEL_CHUNK_MARGIN = 0.02
#: how much shorter a vocabulary-parallel plan's predicted step must be than the same schedule's without it
VOCAB_MARGIN = 0.05
#: the candidates when activation recompute is asked for (split-backward schedules do not recompute)
RECOMPUTE_CANDIDATES = ("1f1b", "gpipe", "interleaved")


@dataclass
class ScheduleChoice:
    """The chosen ``schedule`` (and ``recompute``), its ``plan``, and ``why`` (one line)."""

    schedule: str
    recompute: bool
    plan: Plan
    why: str
    recompute_attention: bool = False
    #: recompute on each card only the fewest layers that fit (``RunShape.recompute_fewest``)
    recompute_fewest: bool = False


def _label(schedule: str, plan: Plan) -> str:
    """``zbv``, ``zbv + attention recompute``, ``+ vocabulary parallel`` (the plan's shape)."""
    if plan is None:
        return schedule
    return (schedule + (" + attention recompute" if plan.shape.recompute_attention else "")
            + (" + vocabulary parallel" if plan.shape.vocab_parallel else ""))


def _capped(plan: Plan) -> str:
    """`` (best of N timelines)`` for a plan whose split search stopped at its cap (``Plan.search_capped_at``)."""
    n = getattr(plan, "search_capped_at", 0)  # a stand-in plan (tests) may lack it
    return f" (best of {n:,} timelines)" if n else ""


def with_vocab(req: PlanRequest, plan: Optional[Plan], why: str, plan_fn) -> tuple[Optional[Plan], str]:
    """``(plan, why)``, or the plan of ``req`` with vocabulary parallelism (``plan_fn(request)`` makes it: ``(plan or
    None, why not)``) where that is predicted :data:`VOCAB_MARGIN` faster (or only it fits)."""
    alt, _ = plan_fn(replace(req, shape=replace(req.shape, vocab_parallel=True)))
    if alt is not None and (plan is None or alt.step_time_s < plan.step_time_s * (1.0 - VOCAB_MARGIN)):
        return alt, ""
    return plan, why


def core_recompute_helps(req: PlanRequest) -> bool:
    """Whether recomputing the attention core can save memory on ``req``'s cards: some card's kernel keeps the
    probabilities (``memory.ATTENTION`` eager) and ``recompute_attention`` is not already asked for."""
    from npu_train.planner.memory import ATTENTION

    return not req.shape.recompute_attention and any(ATTENTION[c.kind] == "eager" for c in req.cards)


def _try(req: PlanRequest, schedule: str, recompute: bool, core: bool = True) -> tuple[Optional[Plan], str]:
    """The plan of ``req`` with ``schedule`` / ``recompute``, or None and why not; with ``core`` where
    :func:`core_recompute_helps`, the faster of it and the plan with the attention core recomputed (searched
    only where its split search finds a split faster than the plan without, :func:`plan_beats`: the same
    choice; an 8-card LoRA plan, whose recomputed core only adds time, skips most of that second search)."""
    plan, why = _try_one(req, schedule, recompute)
    if recompute or not core or not core_recompute_helps(req):
        return plan, why
    core_req = replace(req, shape=replace(req.shape, recompute_attention=True))
    if plan is not None and not plan_beats(_shaped(core_req, schedule, recompute), plan.step_time_s):
        return plan, why
    alt, _ = _try_one(core_req, schedule, recompute)
    if alt is not None and (plan is None or alt.step_time_s < plan.step_time_s):
        return alt, ""
    return plan, why


def _shaped(req: PlanRequest, schedule: str, recompute: bool) -> PlanRequest:
    """``req`` with ``schedule`` / ``recompute``, as :func:`_try_one` plans it."""
    return replace(req, check_fixes=False, shape=replace(req.shape, schedule=schedule, recompute=recompute))


def _try_one(req: PlanRequest, schedule: str, recompute: bool) -> tuple[Optional[Plan], str]:
    """The plan of ``req`` with ``schedule`` / ``recompute``, or None and why not."""
    try:
        plan = make_plan(_shaped(req, schedule, recompute))
    except PlacementError as e:
        return None, str(e)  # the whole refusal: :func:`refusals_summary` says it short
    except ValueError as e:  # interleaved: micro-batches not a multiple of the stages (the caller names it)
        return None, str(e).split(":")[0].removeprefix(f"schedule {schedule} ")
    return (plan, "") if plan.fits else (None, "does not fit")


def choose_schedule(req: PlanRequest, recompute_attention="auto", vocab: bool = False) -> ScheduleChoice:
    """The fastest schedule whose plan fits (module docstring). When nothing fits, recompute included: the
    1F1B plan (``req.strict``: its PlacementError). ``recompute_attention``: ``auto`` (``train.recompute_attention``)
    also plans each candidate with the attention core recomputed; else only ``req.shape``'s. ``vocab``
    (``parallel.vocab=auto``): each candidate also with vocabulary parallelism (:func:`with_vocab`)."""
    recompute = bool(req.shape.recompute)
    if state_floor_over_cards(req):  # the weights alone are over the cards: no candidate fits, refuse at once
        return _none_fits(req, recompute)
    core = recompute_attention == "auto"
    tried = []
    for s in _for_stages(RECOMPUTE_CANDIDATES if recompute else CANDIDATES, len(req.cards)):
        plan, why_not = _try(req, s, recompute, core)
        if vocab:
            plan, why_not = with_vocab(req, plan, why_not, lambda r, s=s: _try(r, s, recompute, core))
        tried.append((s, plan, why_not))
    fits = [(s, p) for s, p, _ in tried if p is not None]
    margin = chunk_margin(req.cards)
    if fits:
        best, plan = min(fits, key=lambda sp: _handicapped(sp[0], sp[1].step_time_s, margin))  # first of equals
        others = "; ".join(x for x in (", ".join(f"{_label(s, p)} {p.step_time_s:.3g} s{_capped(p)}"
                                                 for s, p, _ in tried if s != best and p is not None),
                                       refusals_summary([(s, w) for s, p, w in tried if p is None])) if x)
        return ScheduleChoice(best, recompute, plan,
                              f"train.schedule=auto: {_label(best, plan)} (predicted step {plan.step_time_s:.3g} s; "
                              f"{others}{_margin_note(fits, plan, margin)})", plan.shape.recompute_attention)
    rec = [(s, _fewest_or_all(req, s, core)) for s in _for_stages(("1f1b", "interleaved"), len(req.cards))]
    rec = [(s, p) for s, p in rec if p is not None]
    if rec:
        best, plan = min(rec, key=lambda sp: _handicapped(sp[0], sp[1].step_time_s, margin))
        also = "".join(f"; {s} {p.step_time_s:.3g} s" for s, p in rec if s != best)
        return ScheduleChoice(best, True, plan,
                              f"train.schedule=auto: {best} with {_recompute_label(plan)} (predicted step "
                              f"{plan.step_time_s:.3g} s{also}), the only way to fit{_recompute_note(plan)}; "
                              "without recompute "
                              + refusals_summary([(s, w) for s, _, w in tried], without="train.recompute=true",
                                                 fixes_from=_checked_refusal(req)),
                              plan.shape.recompute_attention, plan.shape.recompute_fewest)
    return _none_fits(req, recompute)


def _for_stages(schedules: tuple, stages: int) -> tuple:
    """``schedules`` that run on ``stages`` pipeline stages (:func:`~npu_train.pipeline.schedule.stages_needed`:
    the two-chunk ones need at least 2)."""
    from npu_train.pipeline.schedule import stages_needed

    return tuple(s for s in schedules if stages >= stages_needed(s))


def _none_fits(req: PlanRequest, recompute: bool) -> ScheduleChoice:
    """Nothing fits: 1F1B's own plan (a strict request raises its PlacementError, naming card and GiB)."""
    plan = make_plan(replace(req, shape=replace(req.shape, schedule="1f1b", recompute=recompute)))
    return ScheduleChoice("1f1b", recompute, plan, "train.schedule=auto: no schedule fits, 1f1b shown")


def chunk_margin(cards) -> float:
    """The two-chunk margin for ``cards`` (:class:`~npu_train.planner.spec.Card`): :data:`CHUNK_MARGIN` where any
    is a cpu card, :data:`ACCEL_CHUNK_MARGIN` where all are accelerators (module docstring)."""
    return CHUNK_MARGIN if any(c.kind == "cpu" for c in cards) else ACCEL_CHUNK_MARGIN


def _margin_note(fits: list, chosen: Plan, margin: float) -> str:
    """``"; zbv is within the 5 % two-chunk margin"``: the two-chunk schedules predicted faster than the chosen
    one but passed over for the two-chunk ``margin``; ``""`` when there are none."""
    from npu_train.pipeline.schedule import CHUNKED_SCHEDULES

    passed = [s for s, p in fits if s in CHUNKED_SCHEDULES and p.step_time_s < chosen.step_time_s]
    if not passed:
        return ""
    verb = "is" if len(passed) == 1 else "are"
    return f"; {' and '.join(passed)} {verb} within the {margin * 100:.0f} % two-chunk margin"


def _checked_refusal(req: PlanRequest) -> str:
    """The refusal of ``req`` on 1F1B without recompute (the least memory of the schedules without it), its fixes
    planned to fit (``PlanRequest.check_fixes``); ``""`` if that plan fits after all."""
    try:
        make_plan(replace(req, check_fixes=True, shape=replace(req.shape, schedule="1f1b", recompute=False)))
    except (PlacementError, ValueError) as e:
        return str(e)
    return ""


def refusals_summary(refused: list, without: Optional[str] = None, fixes_from: Optional[str] = None) -> str:
    """The schedules ``refused`` (``(schedule, why not)``: a one-line reason, or a planner refusal of several
    lines) in one short part of a line, the schedules with the same reason together: ``"zb-h1, zb-h2 do not
    fit; interleaved needs ..."``. With ``without`` (the setting the caller takes to fit, e.g.
    ``train.recompute=true``), the refusals' first line and then every other ``fix:`` of theirs once, shortened to
    the setting: ``"1f1b, zb: no placement fits ...; to fit without it: more cards; a smaller train.micro_batch
    or data.seq_len"``; ``fixes_from``: the refusal to take the fixes from instead (one whose fixes were planned to
    fit, :func:`_checked_refusal`), ``"; to fit without it on 1f1b: ..."``. ``""`` for none."""
    import re

    groups: dict = {}
    fixes: list = []
    for s, why in refused:
        lines = why.splitlines() or [""]
        head = re.sub(r"^no placement of .+? fits", "no placement fits", lines[0].split(";")[0]).strip()
        if without is None and head.startswith(("no placement fits", "does not fit")):
            head = "does not fit"
        groups.setdefault(head, []).append(s)
    sources = [fixes_from] if fixes_from is not None else [w for _, w in refused]
    for ln in "\n".join(sources).splitlines() if without is not None else []:
        if ln.startswith("fix: "):  # the fix itself: without its parentheses and what follows its colon
            fix = re.sub(r"^the largest that fits?: ", "", re.sub(r" \([^()]*\)", "", ln.removeprefix("fix: ")))
            fix = fix.split(": ")[0].strip()
            if fix and fix not in fixes and not fix.startswith(without):
                fixes.append(fix)
    parts = []
    for head, ss in groups.items():
        if head == "does not fit":
            parts.append(f"{', '.join(ss)} {'does' if len(ss) == 1 else 'do'} not fit")
        else:
            parts.append(f"{', '.join(ss)}{': ' if head.startswith('no ') else ' '}{head}")
    on = " on 1f1b" if fixes_from is not None else ""
    return "; ".join(parts) + (f"; to fit without it{on}: " + "; ".join(fixes) if fixes else "")


def _recompute_label(plan: Plan) -> str:
    """What recompute the plan uses: ``train.recompute=true`` (every layer recomputed whole), or with
    ``recompute_fewest`` each card's fewest layers recomputed whole (``"8 of 17 / 0 of 11 per card"``) or none
    (:func:`_recompute_note` says what fits then)."""
    if not plan.shape.recompute_fewest:
        return "train.recompute=true (every layer recomputed)"
    core = ", the others' attention core" if plan.shape.recompute_attention else ""
    if any(st.recompute_layers for st in plan.stages):
        counts = " / ".join(f"{st.recompute_layers} of {st.num_layers}" for st in plan.stages)
        return f"train.recompute=true, the fewest layers that fit recomputed ({counts} per card{core})"
    return "train.recompute=true" + (" (every layer's attention core recomputed)" if core else "")


def _recompute_note(plan: Plan) -> str:
    """``"; no layer is recomputed whole: under train.recompute the cpu cards return freed memory ..."`` for a
    recompute plan whose cards recompute no layer whole (``recompute_fewest``, every count 0): the recompute mode
    itself fits (a cpu card returns freed memory to the OS, ``hostmem.card_mmap_threshold``; the attention cores
    where planned); ``""`` otherwise."""
    if not plan.shape.recompute_fewest or any(st.recompute_layers for st in plan.stages):
        return ""
    what = (["the cpu cards return freed memory to the OS (no heap holes)"]
            if any(st.card.kind == "cpu" for st in plan.stages) else [])
    if plan.shape.recompute_attention:
        what.append("the attention cores are recomputed")
    return "; no layer is recomputed whole" + (f": under it {' and '.join(what)}, which is what fits" if what else "")


def _fewest_or_all(req: PlanRequest, schedule: str, core: bool = True) -> Optional[Plan]:
    """The faster plan of ``schedule`` with recompute that fits: every layer recomputed, or each card only the
    fewest of its layers that fit (``RunShape.recompute_fewest``; with ``core``, the others' attention core
    recomputed where :func:`core_recompute_helps`); None when neither fits."""
    full = _try(req, schedule, True)[0]
    shape = replace(req.shape, recompute_fewest=True,
                    recompute_attention=req.shape.recompute_attention or (core and core_recompute_helps(req)))
    few = _try_one(replace(req, shape=shape), schedule, True)[0]
    if few is not None and (full is None or few.step_time_s < full.step_time_s):
        return few
    return full


def _handicapped(schedule: str, step_s: float, margin: float) -> float:
    """The step time a schedule is compared by: a two-chunk schedule's divided by ``1 - margin``."""
    from npu_train.pipeline.schedule import CHUNKED_SCHEDULES

    return step_s / (1.0 - margin) if schedule in CHUNKED_SCHEDULES else step_s
