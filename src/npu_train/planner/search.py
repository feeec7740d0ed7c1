"""Placement search: which decoder layers go to which card, and which of them keep their
optimizer state on the card ("resident") or on the host ("offloaded"); :func:`make_plan` is the
entry point. Pure arithmetic (planning Llama-3.1-70B on 8 cards takes milliseconds), torch-free
except :func:`~npu_train.planner.spec.default_capacity` for ``cuda``.
"""
from __future__ import annotations

import numbers
from bisect import bisect_right
from typing import Optional, Sequence, Union

from npu_train.model.config import LlamaConfig
from npu_train.planner.cost import CostModel
from npu_train.planner.memterms import MemoryTerms
from npu_train.planner.plan import Plan
from npu_train.planner.rates import Rates
from npu_train.planner.report import card_label, over_capacity_message
from npu_train.planner.spec import CardSpec, PlacementError, RunShape, gib
from npu_train.planner.threads import threads_per_card, usable_cores

__all__ = ["DEFAULT_HEADROOM", "balanced_split", "search_split", "fastest_split", "make_plan"]

#: most schedule timelines :func:`fastest_split` evaluates (about 0.1 ms each for P = 4, M = 8)
#: before it returns the best split found so far
MAX_TIMELINES = 20000

#: fraction of each card's capacity the ``auto`` placement keeps free (``placement.headroom``):
#: the model's assumed terms are not exact (issue 12: the old model put 2 cards at 47.42 of 47.5 GiB)
DEFAULT_HEADROOM = 0.05


def balanced_split(num_layers: int, num_cards: int) -> list[int]:
    """``num_layers`` spread over ``num_cards`` as evenly as possible; the remainder goes to the
    first cards (the last card also carries the lm_head). Raises ``ValueError`` for no cards."""
    if num_cards < 1:
        raise ValueError(f"need at least one card, got {num_cards}")
    q, r = divmod(num_layers, num_cards)
    return [q + (1 if k < r else 0) for k in range(num_cards)]


def _over_capacity(pm: CostModel, plan: Plan, i: int, headroom: bool = False) -> str:
    st = plan.stages[i]
    return over_capacity_message(plan, i, pm.max_resident(i, st.num_layers, headroom),
                                 pm.limit(i, headroom) if headroom else None)


def _check_host(plan: Plan, host_ram_bytes: Optional[int], strict: bool) -> Plan:
    plan.host_ram_bytes = host_ram_bytes
    if host_ram_bytes is None or plan.host_bytes <= host_ram_bytes:
        return plan
    plan.fits = False
    if strict:
        per = ", ".join(f"{card_label(i, st.card)} {gib(st.host_bytes):.2f} GiB"
                        for i, st in enumerate(plan.stages) if st.host_bytes)
        raise PlacementError(
            f"host RAM too small for the offloaded optimizer state: predicted "
            f"{gib(plan.host_bytes):.2f} GiB ({per}) > host RAM {gib(host_ram_bytes):.2f} GiB; "
            f"fix: more resident layers, more cards, or a host with more RAM"
        )
    return plan


def search_split(pm: CostModel, L: int) -> Optional[list[int]]:
    """Layers per card (``L`` layers in all) minimizing the 1F1B-style bound
    ``slots * max_i t_i + max_i (host_i + dev_i + xfer_i)`` (``slots`` = ``M + P - 1`` without
    oversubscribed cpu cores) with every stage at its auto resident count; ``None`` if no split
    fits. :func:`fastest_split` starts from it (the plan's step time is the schedule's timeline,
    which this bound over-estimates for unequal stages). Exact for the bound: for a stage, t, host+xfer and memory at 0 resident are all
    non-decreasing in its layer count, so for bounds (T, X) each stage admits n in
    [1, U_i(T, X)] and a split exists iff sum U_i >= L."""
    P = pm.P
    A = pm.slots
    nmax = L - P + 1
    t_tab, x_tab, ufit = [], [], []
    for i in range(P):
        ts, xs, fit = [], [], 0
        for n in range(1, nmax + 1):
            r = pm.max_resident(i, n)
            if r < 0:
                break
            c = pm.cost(i, n, r)
            h, d, x = pm.side_time(i, c)
            ts.append(c.t_mb)
            xs.append(h + d + x)
            fit = n
        if fit == 0:
            return None
        # enforce monotonicity against float noise / the non-layer step
        for j in range(1, len(ts)):
            ts[j] = max(ts[j], ts[j - 1])
            xs[j] = max(xs[j], xs[j - 1])
        t_tab.append(ts)
        x_tab.append(xs)
        ufit.append(fit)
    if sum(ufit) < L:
        return None
    t_vals = sorted({t for ts in t_tab for t in ts})
    x_vals = sorted({x for xs in x_tab for x in xs})

    def upper(T: float, X: float) -> list[int]:
        return [min(ufit[i], bisect_right(t_tab[i], T), bisect_right(x_tab[i], X))
                for i in range(P)]

    def ok(U: list[int]) -> bool:
        return min(U) >= 1 and sum(U) >= L

    best = None
    for T in t_vals:
        lo, hi = 0, len(x_vals) - 1
        if not ok(upper(T, x_vals[hi])):
            continue
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(upper(T, x_vals[mid])):
                hi = mid
            else:
                lo = mid + 1
        obj = A * T + x_vals[lo]
        if best is None or obj < best[0] * (1 - 1e-12):
            best = (obj, T, x_vals[lo])
    if best is None:
        return None
    U = upper(best[1], best[2])
    # fill: one layer each, then grow the stage whose next layer costs the least
    split = [1] * P
    for _ in range(L - P):
        cand = [(A * t_tab[i][split[i]] + x_tab[i][split[i]], i)
                for i in range(P) if split[i] < U[i]]
        _, i = min(cand)
        split[i] += 1
    return split


def _resident_for(pm: CostModel, i: int, n: int, resident) -> int:
    """Resident layers of stage ``i`` holding ``n`` layers under ``resident`` ("auto" or a per-card
    list), or -1 when that does not fit (auto: within the headroom; explicit counts: r <= n and
    within the full capacity, as :func:`make_plan` checks them)."""
    if resident == "auto":
        return pm.max_resident(i, n)
    r = int(resident[i])
    if r > n or pm.cost(i, n, r).mem["total"] > pm.limit(i, headroom=False):
        return -1
    return r


def fastest_split(pm: CostModel, L: int, resident: Union[str, Sequence[int]] = "auto",
                  max_timelines: int = MAX_TIMELINES) -> Optional[list[int]]:
    """Layers per card (``L`` in all, every card >= 1) with the lowest predicted step time
    (:meth:`CostModel.step_time <npu_train.planner.cost.CostModel.step_time>`: the configured
    schedule's timeline + the largest optimizer / transfer time) among the splits that fit, with
    ``resident`` layers per card (``"auto"``: per card the most that fit within the headroom,
    :meth:`~npu_train.planner.cost.CostModel.max_resident`; a list: those counts, each <= the
    card's layers and within its capacity). ``None`` if no split fits.

    Ties (within a relative 1e-9) go to the balanced split (:func:`balanced_split`) when it is
    among them, else to the lexicographically smallest split, so the answer does not depend on
    the search order.

    Branch and bound over the cards in pipeline order: stage ``i`` cannot start before the
    forwards of the stages before it (``sum_{j<i} t_F,j``) and then computes ``M t_i``, so
    ``(sum_{j<i} t_F,j + M t_i) * stretch + max side time`` of the cards placed so far (side time
    less the host work the optimizer overlap may hide, :meth:`CostModel.hideable`) bounds the
    step time from below; branches whose bound exceeds the best step time found are cut. Exact
    unless more than ``max_timelines`` timelines would be evaluated (then the best found, which
    starts from the balanced split and :func:`search_split`'s).
    """
    P, M = pm.P, pm.shape.micro_batches
    stretch = pm.slots / (M + P - 1)
    nmax = L - P + 1
    opts = []  # per stage: [(n, r, cost, side seconds)]
    for i in range(P):
        o = []
        for n in range(1, nmax + 1):
            r = _resident_for(pm, i, n, resident)
            if r >= 0:
                c = pm.cost(i, n, r)
                # a lower bound of the stage's side time: the host work the overlap may hide left out
                o.append((n, r, c, sum(pm.side_time(i, c)) - pm.hideable(i, c)))
        if not o:
            return None
        opts.append(o)
    lo_rest = [0] * (P + 1)
    hi_rest = [0] * (P + 1)
    for i in range(P - 1, -1, -1):
        lo_rest[i] = lo_rest[i + 1] + opts[i][0][0]
        hi_rest[i] = hi_rest[i + 1] + opts[i][-1][0]
    if lo_rest[0] > L or hi_rest[0] < L:
        return None
    tol = 1e-9
    best = [float("inf")]
    ties: list[tuple[float, list[int]]] = []
    evals = [0]

    def leaf(split: list[int], costs: list) -> None:
        evals[0] += 1
        obj = max(t["total"] for t in pm.stage_times(split, costs))  # = CostModel.step_time
        if obj <= best[0] * (1 + tol):
            best[0] = min(best[0], obj)
            ties.append((obj, list(split)))

    def evaluate(split: Optional[list[int]]) -> None:
        if split is None or len(split) != P or sum(split) != L or min(split) < 1:
            return
        rs = [_resident_for(pm, i, n, resident) for i, n in enumerate(split)]
        if min(rs) >= 0:
            leaf(split, [pm.cost(i, n, r) for i, (n, r) in enumerate(zip(split, rs))])

    bal = balanced_split(L, P)
    evaluate(bal)  # seeds: a good first bound cuts most branches
    if resident == "auto":
        evaluate(search_split(pm, L))
    split: list[int] = []
    costs: list = []

    def dfs(i: int, left: int, f_before: float, lb_phase: float, side: float) -> None:
        if evals[0] >= max_timelines:
            return
        if i == P:
            if left == 0:
                leaf(split, costs)
            return
        for n, r, c, sd in opts[i]:
            rest = left - n
            if rest < lo_rest[i + 1]:
                break
            if rest > hi_rest[i + 1]:
                continue
            lb = max(lb_phase, (f_before + M * c.t_mb) * stretch)
            sdm = max(side, sd)
            if lb + sdm > best[0] * (1 + tol):
                continue  # t and side time grow with n, but a larger n leaves fewer layers to the rest
            split.append(n)
            costs.append(c)
            dfs(i + 1, rest, f_before + c.t_f, lb, sdm)
            split.pop()
            costs.pop()

    dfs(0, L, 0.0, 0.0, 0.0)
    if not ties:
        return None
    cand = sorted(sp for obj, sp in ties if obj <= best[0] * (1 + tol))
    return bal if bal in cand else cand[0]


def make_plan(
    model: LlamaConfig,
    shape: RunShape,
    cards: Sequence[CardSpec],
    rates: Union[Rates, Sequence[Rates]],
    split: Optional[Sequence[int]] = None,
    resident_layers: Union[str, int, Sequence[int]] = "auto",
    host_ram_bytes: Optional[int] = None,
    *,
    nonlayer_resident: Optional[bool] = None,
    strict: bool = True,
    threads: Optional[int] = None,
    host_cores: Optional[int] = None,
    headroom: float = DEFAULT_HEADROOM,
    memory_terms: Optional[Sequence[MemoryTerms]] = None,
    dp: int = 1,
    zero: int = 0,
) -> Plan:
    """Place ``model`` on ``cards`` (pipeline order) and predict memory and step time.

    Args:
        model: architecture.
        shape: sequence length, micro-batch, accumulation steps, schedule, dtype, recompute.
        cards: one :class:`CardSpec` per pipeline stage.
        rates: one :class:`Rates` for all cards, or one per card.
        split: decoder layers per card (sums to ``model.num_layers``). ``None``: the split with
            the lowest predicted step time among those that fit, for the given
            ``resident_layers`` (auto, a number or a list) and ``shape.schedule``
            (:func:`fastest_split`: e.g. fewer layers on the last card, which computes the
            lm_head); ties go to the balanced split (:func:`balanced_split`).
        resident_layers: ``"auto"`` (per card the most resident layers that fit, since resident
            layers remove host-optimizer and transfer time), an int N (N on every card; more than
            a card's layers is an error) or a per-card list.
        host_ram_bytes: if given, the offloaded master + moments of all cards must fit in it.
        nonlayer_resident: keyword-only. Optimizer state of embedding / final norm / untied
            lm_head on the card (True), on the host (False), or (None, default) on the card exactly
            when all of that card's layers are resident.
        strict: keyword-only. If False, an infeasible placement returns a plan with
            ``fits=False`` instead of raising (layout errors always raise).
        threads: keyword-only. torch threads of every card process, the number the card
            processes are started with: ``threads_per_card(runtime.threads, cards on the host)``
            (:func:`npu_train.planner.threads.threads_per_card`). Every card's rates are
            resolved for it (:meth:`Rates.resolve <npu_train.planner.rates.Rates.resolve>`: the
            profile's ``by_threads`` entry of that count, else the nearest measured count scaled
            linearly) and ``plan.threads`` records it. ``None``: ``threads_per_card(0, len(cards),
            host_cores)`` (the cores divided among the cards).
        host_cores: keyword-only. Cores the cpu cards share; ``None``:
            :func:`npu_train.planner.threads.usable_cores` (affinity and cgroup quota).
        headroom: keyword-only. Fraction of every card's capacity that ``auto`` keeps free
            (``placement.headroom``, default :data:`DEFAULT_HEADROOM` = 5 %): the auto choice never
            predicts a card above ``capacity * (1 - headroom)``. Explicit resident counts are
            checked against the full capacity. Printed with the plan.
        memory_terms: keyword-only. One :class:`~npu_train.planner.memterms.MemoryTerms` per card
            (workspace constant and fraction, loaded-module cache, their sources), e.g. from
            :func:`~npu_train.planner.memterms.load_memory_terms`; ``None``: the kinds' defaults.
        dp: keyword-only. Data-parallel replicas of the pipeline: ``cards`` are one replica's
            stages (every replica has the same kinds); the job has ``dp * len(cards)`` cards and
            ``dp`` times the tokens per step (:mod:`npu_train.planner.cost`: ``dp_comm``).
        zero: keyword-only. 1 = ZeRO-1, each card keeps ``1/dp`` of its stage's optimizer state.

    Returns:
        The :class:`~npu_train.planner.plan.Plan`; ``plan.table()`` /
        :func:`~npu_train.planner.report.format_plan` render it.

    Raises:
        PlacementError: a card over capacity (message: card, predicted GiB, capacity GiB, fixes),
            nothing fits in auto mode, host RAM too small, more cards than layers, resident count
            above a card's layer count, a bad ``split``.
        ValueError: a ``rates`` list whose length is not the number of cards, an unknown
            ``resident_layers`` string.

    Reference figures (Llama-3.1-8B, S=512, micro-batch 1, M=4, bf16, 1F1B, RNGD 47.5 GiB =
    51.0 GB), from an earlier RNGD deployment, reproduced by ``tests/unit/test_placement.py``:

    1. fp32 master + AdamW m, v of one resident decoder layer: 218,112,000 params * 12 B
       = 2.617 GB (2.44 GiB): ``optimizer`` term only.
    2. One card, all 32 layers, 8 resident (24 offloaded + embedding/lm_head offloaded by the
       default rule): "~50 GB, does not fit". Reproduced by the *static state*
       weights + grads + optimizer = 16.06 + 16.06 + 20.94 GB = 53.06 GB = **49.4 GiB**: the
       deployment's "GB" were binary (in decimal it would be 6 % above 50). That alone exceeds
       47.5 GiB; the full plan adds activations (4.9 GB) and workspace (4.0 GB) for 57.7 GiB
       (61.9 GB) total -> ``PlacementError`` / ``fits=False``.
    3. Two cards, 16 layers each, nothing resident: "~15 GB per card". Reproduced by the static
       state weights + grads = 16.06 GB = **14.96 GiB** per card (first: 16 layers + embedding;
       last: 16 layers + norm + lm_head), again binary units (decimal 16.06 GB is within 10 %).
       The full plan adds activations (first card: 2 micro-batches in flight * 16 layers *
       136.3 MB = 4.36 GB; last: 1 * 16 * 136.3 MB + 0.53 GB logits) and workspace (~2 GB):
       22.5 GB (21.0 GiB) on the first card, 20.8 GB (19.4 GiB) on the last.
    """
    cards = list(cards)
    P, L = len(cards), model.num_layers
    if P < 1:
        raise PlacementError("no cards given")
    if int(dp) < 1 or int(zero) not in (0, 1):
        raise ValueError(f"make_plan needs dp >= 1 and zero in (0, 1), got dp={dp}, zero={zero}")
    if P > L:
        raise PlacementError(
            f"more cards ({P}) than decoder layers ({L}) of {model.name}: every card needs at "
            f"least one layer; fix: use at most {L} cards"
        )
    if isinstance(rates, Rates):
        rates_l = [rates] * P
    else:
        rates_l = list(rates)
        if len(rates_l) != P:
            raise ValueError(f"got {len(rates_l)} Rates for {P} cards")

    if not 0.0 <= float(headroom) < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if memory_terms is not None and len(memory_terms) != P:
        raise ValueError(f"got {len(memory_terms)} MemoryTerms for {P} cards")
    cores = int(host_cores) if host_cores else usable_cores()
    n_threads = int(threads) if threads else threads_per_card(0, P * int(dp), cores)
    pm = CostModel(model, shape, cards, rates_l, nonlayer_resident, n_threads, cores,
                   memory_terms, headroom, dp=int(dp), zero=int(zero))

    if split is not None:
        split_l = [int(n) for n in split]
        if len(split_l) != P:
            raise PlacementError(f"split {split_l} has {len(split_l)} entries for {P} cards")
        if any(n < 1 for n in split_l):
            raise PlacementError(f"split {split_l}: every card needs at least one layer")
        if sum(split_l) != L:
            raise PlacementError(
                f"split {split_l} sums to {sum(split_l)} layers; {model.name} has {L}: give train.split "
                f"layers per card summing to {L}, or drop train.split (the planner chooses)")
    else:
        split_l = None

    # ---- explicit resident counts ----
    if not isinstance(resident_layers, str):
        if isinstance(resident_layers, numbers.Integral):
            res_l = [int(resident_layers)] * P
        else:
            res_l = [int(r) for r in resident_layers]
            if len(res_l) != P:
                raise PlacementError(
                    f"resident_layers {res_l} has {len(res_l)} entries for {P} cards")
        if split_l is None:
            # the fastest split that holds these resident counts; none: the balanced split explains why
            split_l = (fastest_split(pm, L, res_l) if min(res_l) >= 0 else None) or balanced_split(L, P)
        for i, (n, r) in enumerate(zip(split_l, res_l)):
            if r < 0:
                raise PlacementError(f"{card_label(i, cards[i])}: resident layers {r} < 0")
            if r > n:
                raise PlacementError(
                    f"{card_label(i, cards[i])} holds {n} layers but {r} resident layers were "
                    f"requested; fix: resident_layers <= {n} on this card (split {split_l})")
        plan = pm.build(split_l, res_l)
        if strict:
            for i, st in enumerate(plan.stages):
                if not st.fits:
                    raise PlacementError(_over_capacity(pm, plan, i))
        return _check_host(plan, host_ram_bytes, strict)

    if resident_layers != "auto":
        raise ValueError(
            f"resident_layers must be 'auto', an int or a list, got {resident_layers!r}")

    # ---- auto ----
    if split_l is None:
        split_l = fastest_split(pm, L, "auto")
    if split_l is not None:
        res_l = [pm.max_resident(i, n) for i, n in enumerate(split_l)]
        if min(res_l) >= 0:
            return _check_host(pm.build(split_l, res_l), host_ram_bytes, strict)
    # nothing fits: explain with the given (or balanced) split at each stage's least-memory resident count
    split_e = split_l if split_l is not None else balanced_split(L, P)
    least = [min(range(n + 1), key=lambda r, i=i, n=n: (pm.cost(i, n, r).mem["total"], r))
             for i, n in enumerate(split_e)]
    plan = pm.build(split_e, least)
    plan.fits = False
    if not strict:
        return _check_host(plan, host_ram_bytes, strict=False)
    bad = [i for i, st in enumerate(plan.stages) if st.mem["total"] > pm.limit(i)] or [0]
    raise PlacementError(
        "no placement fits with any number of resident layers"
        + ("" if split is not None else " on any split")
        + ": " + "; ".join(_over_capacity(pm, plan, i, headroom=True) for i in bad)
    )


