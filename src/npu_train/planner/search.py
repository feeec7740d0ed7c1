"""Placement search: which decoder layers go to which card and which keep their optimizer state on the
card (resident) or the host (offloaded). Start at :func:`make_plan`."""
from __future__ import annotations

import numbers
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

from npu_train.hardware import HOST_MEMORY_KINDS, KINDS, LAUNCHER_RESERVE_BYTES
from npu_train.pipeline.schedule import SPLIT_BACKWARD, stages_needed
from npu_train.planner.cost import CostModel, StageCost
from npu_train.planner.plan import Plan
from npu_train.planner.rates import Rates
from npu_train.planner.request import PlanRequest
from npu_train.planner.spec import PlacementError, gib
from npu_train.planner.table import card_label, over_capacity_message, state_bytes
from npu_train.planner.threads import threads_per_card, usable_cores

__all__ = ["PROGRESS", "SearchProgress", "SplitSearchStats", "balanced_split", "search_split", "fastest_split", "make_plan",
           "plan_beats", "state_floor_over_cards"]

#: most schedule timelines :func:`fastest_split` evaluates (about 0.1 ms each for P = 8, M = 4)
#: before it returns the best split found so far
MAX_TIMELINES = 20000
#: most partial splits (search-tree nodes, a few microseconds each) :func:`fastest_split` visits before it
#: returns the best split found so far
MAX_NODES = 400000


class SearchProgress:
    """What the placement search is doing, for a caller that says so while it runs (an 8-card
    ``train.schedule=auto`` plan makes dozens of plans and simulates tens of thousands of timelines: tens of
    seconds on a loaded host). :func:`make_plan` counts each plan and names what it plans (:attr:`current`),
    :func:`fastest_split` its timelines; each calls :attr:`listener` (no arguments), when set, at a new plan
    and every :data:`TICK_TIMELINES` timelines. One writer (the search) and a listener in the same thread."""

    def __init__(self) -> None:
        self.plans, self.timelines, self.current = 0, 0, ""
        self.listener: Optional[Callable[[], None]] = None

    def tick(self) -> None:
        if self.listener is not None:
            self.listener()


#: timelines between two :meth:`SearchProgress.tick` calls of :func:`fastest_split` (~0.1 ms each)
TICK_TIMELINES = 256
#: the placement search's progress (module-level: the search is reached through several callers)
PROGRESS = SearchProgress()


def shape_label(shape, dp: int = 1) -> str:
    """What one plan is of, for :class:`SearchProgress`: ``zb-h2 + attention recompute, micro-batch 1 x 4``."""
    what = shape.schedule
    if shape.recompute:
        what += " + recompute" + (" (fewest layers)" if shape.recompute_fewest else "")
    if shape.recompute_attention:
        what += " + attention recompute"
    return what + (f", dp {dp}" if dp > 1 else "") + f", micro-batch {shape.micro_batch} x {shape.micro_batches}"


@dataclass
class SplitSearchStats:
    """What one :func:`fastest_split` did: ``timelines`` evaluated (schedule timelines of whole splits),
    ``nodes`` visited (partial splits), ``capped`` when it stopped at ``max_timelines`` or :data:`MAX_NODES`
    (the best split found so far, not proven fastest)."""

    timelines: int = 0
    nodes: int = 0
    capped: bool = False


def balanced_split(num_layers: int, num_cards: int) -> list[int]:
    """``num_layers`` spread evenly over ``num_cards``, the remainder on the first cards. Raises ``ValueError``
    for no cards."""
    if num_cards < 1:
        raise ValueError(f"need at least one card, got {num_cards}")
    q, r = divmod(num_layers, num_cards)
    return [q + (1 if k < r else 0) for k in range(num_cards)]


def _over_capacity(pm: CostModel, plan: Plan, cards: Sequence[int], headroom: bool = False,
                   more_cards: Optional[str] = None, checked=None) -> str:
    """The refusal's lines for ``cards`` of ``plan`` (:func:`~npu_train.planner.table.over_capacity_message`)."""
    return over_capacity_message(plan, [(i, pm.max_resident(i, plan.stages[i].num_layers, headroom),
                                         pm.limit(i, headroom) if headroom else None) for i in cards], more_cards,
                                 checked)


def _check_host(plan: Plan, host_ram_bytes: Optional[int], strict: bool) -> Plan:
    plan.host_ram_bytes = host_ram_bytes
    if host_ram_bytes is None or plan.host_bytes <= host_ram_bytes:
        return plan
    plan.fits = False
    if strict:
        per = ", ".join(f"{card_label(i, st.card)} {gib(st.host_bytes):.2f}"
                        for i, st in enumerate(plan.stages) if st.host_bytes)
        raise PlacementError(
            f"host RAM too small for the offloaded optimizer state: plan {gib(plan.host_bytes):.2f} GiB of host "
            f"RAM > the host's {gib(host_ram_bytes):.2f} GiB in total\nplan GiB: {per}\n"
            f"fix: more resident layers, more cards, or a host with more RAM"
        )
    return plan


def search_split(pm: CostModel, L: int) -> Optional[list[int]]:
    """Layers per card minimizing the bound ``slots * max_i t_i + max_i (host_i + dev_i + xfer_i)`` with
    every stage at its auto resident count, or ``None`` if no split fits; a seed for :func:`fastest_split`.
    Exact for the bound: t, side time and memory are non-decreasing in a stage's layer count, so for bounds
    (T, X) each stage admits ``n`` in ``[1, U_i(T, X)]`` and a split exists iff ``sum U_i >= L``."""
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
    """Resident layers of stage ``i`` with ``n`` layers under ``resident`` ("auto" or per-card counts),
    -1 when none fits (explicit counts: ``r <= n`` within the full capacity)."""
    if resident == "auto":
        return pm.max_resident(i, n)
    r = int(resident[i])
    if r > n or pm.cost(i, n, r).mem["total"] > pm.limit(i, headroom=False):
        return -1
    return r


def fastest_split(pm: CostModel, L: int, resident: Union[str, Sequence[int]] = "auto",
                  max_timelines: int = MAX_TIMELINES,
                  stats: Optional[SplitSearchStats] = None, beat: Optional[float] = None) -> Optional[list[int]]:
    """Layers per card (``L`` in all, >= 1 each) with the lowest predicted step time among the splits that
    fit with ``resident`` layers per card (``"auto"`` or a list), or ``None``. Ties (relative 1e-9) go to the
    balanced split, else the lexicographically smallest. With ``beat`` (seconds): the first split found whose
    predicted step is under it, or ``None`` (the search starts with ``beat`` as its best, so it cuts more and
    visits a subset of the nodes in the same order: every split under ``beat`` the search without it evaluates
    before its caps, this one evaluates too; :func:`plan_beats`).

    Branch and bound in pipeline order: stage ``i`` cannot start before micro-batch 0's forward through the
    stages before it (their first chunks: :meth:`~CostModel.first_chunk_forward`), so
    ``(sum_{j<i} t_F0,j + M t_i) * stretch`` bounds the phase from below; with one chunk per card, the last
    micro-batch's backward still runs through the stages before it after stage ``i`` has done its ``M`` forwards
    and input-gradient passes (:func:`_drain_bound`); each stage's total is the phase plus
    its side time less the hideable host work plus its exposed host time, which the earlier stages' forwards
    already fix (:meth:`~CostModel.exposed_floor`); the stages not placed yet hold the rest, one of them at least
    its share (:class:`_RestBound`); with one chunk per card a stage's first ``B`` waits for micro-batch 0's
    round trip through the later stages, and the last stage for the forwards and ``B`` passes of all the stages
    before it (:class:`_TailBound`). Exact unless more than ``max_timelines`` timelines or :data:`MAX_NODES`
    partial splits would be visited (then the best found; ``stats`` says which)."""
    P, M = pm.P, pm.shape.micro_batches
    stretch = pm.slots / (M + P - 1)
    nmax = L - P + 1
    opts = _stage_options(pm, nmax, resident)
    if opts is None:
        return None
    lo_rest = [0] * (P + 1)
    hi_rest = [0] * (P + 1)
    for i in range(P - 1, -1, -1):
        lo_rest[i] = lo_rest[i + 1] + opts[i][0][0]
        hi_rest[i] = hi_rest[i + 1] + opts[i][-1][0]
    if lo_rest[0] > L or hi_rest[0] < L:
        return None
    tol = 1e-9
    best = [float("inf") if beat is None else beat]
    ties: list[tuple[float, list[int]]] = []
    evals = [0, 0]  # timelines, nodes
    rest_bound = _RestBound(opts, nmax)
    tail = _TailBound(opts, M, L, [pm.path_copies(i) for i in range(P)])

    # two chunks per card with copy threads: the timeline without copies first (CostModel.phase_floor, a third of
    # the time): every stage's total is at least the phase plus its side time less its hideable host work (and
    # its exposed host floor), what the search's ``side`` holds, so a split whose floor is over the best is cut
    # without its timeline (still counted as one: the same caps, nodes and split). It spares 70-89 % of the ZB-V
    # timelines of an 8-card LoRA plan; with one chunk per card the bounds above already leave few (1 %) it cuts
    floor_first = any(pm.overlapped) and not pm.shape.vocab_parallel and pm.memory.chunks != 1

    def leaf(split: list[int], costs: list, side: Optional[float] = None) -> None:
        evals[0] += 1
        if not evals[0] % TICK_TIMELINES:
            PROGRESS.timelines += TICK_TIMELINES
            PROGRESS.tick()
        if floor_first and side is not None and (pm.phase_floor(costs) + side) * (1 - 1e-12) > best[0] * (1 + tol):
            return
        obj = max(t["total"] for t in pm.stage_times(split, costs))  # = CostModel.step_time
        if beat is not None and obj < beat:
            raise _Beaten(list(split))
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
    split: list[int] = []
    costs: list = []

    # per stage, the host work its exposed-host floor needs (:meth:`~CostModel.hideable`; 0: the floor is 0, e.g.
    # LoRA, whose adapters' optimizer runs on the card) and the bound tables as plain lists: the loop below runs
    # millions of times on an 8-card MoE LoRA plan, so it tries the bound without the floor first (the floor is
    # >= 0, so what that cuts the full bound cuts too: the same nodes, timelines and split, in less time)
    work = [[pm.hideable(i, o[2]) for o in opts[i]] for i in range(P)]
    on_tail = tail.on
    rb_t, rb_sd = rest_bound.t, rest_bound.sd
    busy_t, drained_t, down_t = tail.busy, tail.drained, tail.down
    copies_b = [pm.path_copies(i)[1] for i in range(P)]
    fast, suf_t, suf_sd, suf_fd, ns = _loop_tables(opts, M, on_tail)
    rest_lb = _RestFloor(rest_bound, tail, M, L)

    def dfs(i: int, left: int, f_before: float, chain: float, lb_phase: float, side: float, drain: float) -> None:
        evals[1] += 1
        if i == P:
            if left == 0:
                leaf(split, costs, side)
            return
        j = i + 1
        lo_next, hi_next = lo_rest[j], hi_rest[j]
        later = j < P
        per = P - j
        tail_on = later and on_tail
        stage, ns_i, fd_i = fast[i], ns[i], suf_fd[i]
        # the options this loop would pass over without a side effect: too few layers (the rest is over what the
        # later stages hold), and those whose rest alone is cut (_RestFloor.first_kept: rest = left - n falls as
        # n grows); the same nodes, timelines and split, fewer tries
        k0 = bisect_left(ns_i, left - hi_next)
        if later:
            k0 = rest_lb.first_kept(j, ns_i, k0, bisect_right(ns_i, left - lo_next), left, chain, drain, stretch,
                                    best[0] * (1 + tol))
        for k in range(k0, len(stage)):
            n, r, c, sd, f0, db, mt, mfd, mdb = stage[k]
            if evals[0] >= max_timelines or evals[1] >= MAX_NODES:
                return
            rest = left - n
            if rest < lo_next:
                break
            if rest > hi_next:
                continue
            cut = best[0] * (1 + tol)
            # (max() written out: this loop runs tens of millions of times; the same values as max gives)
            x = side if side > suf_sd[i][k] else suf_sd[i][k]
            y = M * suf_t[i][k]
            if fd_i is not None and fd_i[k] + drain > y:
                y = fd_i[k] + drain
            if ((chain + y) * stretch + x) * (1 - 1e-12) > cut:
                break  # this n and every larger one: their own M t_mb (or drain bound) alone is over the best
            if later:  # (_RestBound.at, _TailBound.last)
                q = -(-rest // per)
                t_r, sd_r = rb_t[j][q], rb_sd[j][q]
                busy, drained = (busy_t[j][rest], drained_t[j][rest]) if on_tail else (0.0, 0.0)
            else:
                t_r = sd_r = busy = drained = 0.0
            # the stage's own bound (_drain_bound)
            d = mt if db is None else (mt if mt > mfd + drain else mfd + drain)
            lb = (chain + d) * stretch
            if lb_phase > lb:
                lb = lb_phase
            if db is not None:  # its B of micro-batch 0 waits for that one's round trip through the later stages
                y = (chain + f0 + (down_t[j][rest] if tail_on else 0.0) + mdb + drain) * stretch
                if y > lb:
                    lb = y
            y = M * t_r
            z = drain + (db or 0.0) + drained
            if busy > y:
                y = busy
            if z > y:
                y = z
            lbt = (chain + f0 + y) * stretch
            if lb > lbt:
                lbt = lb
            x = side if side > sd else sd
            if sd_r > x:
                x = sd_r
            if (lbt + x) * (1 - 1e-12) > cut:
                continue  # cut without the exposed-host floor (>= 0): the full bound below cuts it too
            # the stage's total is phase + sd + its exposed host time, which the earlier stages' forwards fix
            sdm = max(side, sd + pm.exposed_floor(i, n, c, f_before)) if work[i][k] else max(side, sd)
            if (lbt + max(sdm, sd_r)) * (1 - 1e-12) > cut:
                continue  # t and side time grow with n, but a larger n leaves fewer layers to the rest
            split.append(n)
            costs.append(c)
            # (the last micro-batch's B path: with a copy thread its crossings' copies too, pm.first_chunk_forward)
            dfs(j, rest, f_before + c.t_f, chain + f0, lb, sdm, drain + (0.0 if db is None else db + copies_b[i]))
            split.pop()
            costs.pop()

    beaten = None
    try:
        evaluate(bal)  # seeds: a good first bound cuts most branches
        if resident == "auto":
            evaluate(search_split(pm, L))
        dfs(0, L, 0.0, 0.0, 0.0, 0.0, 0.0)
    except _Beaten as b:  # ``beat``: a split under it
        beaten = b.split
    if stats is not None:
        stats.timelines, stats.nodes = evals[0], evals[1]
        stats.capped = evals[0] >= max_timelines or evals[1] >= MAX_NODES
    if beat is not None:
        return beaten
    if not ties:
        return None
    cand = sorted(sp for obj, sp in ties if obj <= best[0] * (1 + tol))
    return bal if bal in cand else cand[0]


def _stage_options(pm: CostModel, nmax: int, resident) -> Optional[list]:
    """Per stage of :func:`fastest_split`, its options ``(n, r, cost, side seconds, first-chunk forward seconds,
    B seconds)`` for ``n`` in ``1..nmax`` layers that fit with ``resident`` (:func:`_resident_for`), ``n``
    ascending; None when some stage has none."""
    opts = []
    for i in range(pm.P):
        o = []
        for n in range(1, nmax + 1):
            r = _resident_for(pm, i, n, resident)
            if r >= 0:
                c = pm.cost(i, n, r)
                # the stage's side time less the host work the overlap may hide (+ what it cannot: dfs); its
                # first virtual stage's forward
                o.append((n, r, c, sum(pm.side_time(i, c)) - pm.hideable(i, c), pm.first_chunk_forward(c, i),
                          _backward_pass(pm, i, c)))
        if not o:
            return None
        opts.append(o)
    return opts


def _loop_tables(opts: list, M: int, on_tail: bool) -> tuple:
    """:func:`fastest_split`'s loop's tables, per stage: each option with ``M t_mb``, ``M (t_f + B)`` and ``M B``
    appended (B: :func:`_backward_pass`; None with two chunks per card); per option ``k`` the least ``t_mb`` and
    side seconds of options ``k..`` (no monotonicity in ``n`` assumed: once the chain before a stage plus the
    least ``M t_mb`` of its remaining options, with their least side time, is over the best, every larger ``n``
    is cut by the bound too, so the loop stops there: the same cuts, fewer tries), and with one chunk per card
    (``on_tail``) the least ``M (t_f + B)`` of options ``k..`` (the stage's drain bound stops the loop too), else
    None; the options' layer counts."""
    fast = [[(*o, M * o[2].t_mb, None if o[5] is None else M * (o[2].t_f + o[5]), None if o[5] is None else M * o[5])
             for o in stage] for stage in opts]
    suf_t = [_suffix_min([o[2].t_mb for o in stage]) for stage in opts]
    suf_sd = [_suffix_min([o[3] for o in stage]) for stage in opts]
    suf_fd = [_suffix_min([o[-2] for o in stage]) if on_tail else None for stage in fast]
    return fast, suf_t, suf_sd, suf_fd, [[o[0] for o in stage] for stage in opts]


def _backward_pass(pm: CostModel, i: int, c: StageCost):
    """Seconds of stage ``i``'s backward action ``B`` per micro-batch as the schedule's timeline runs it
    (:func:`~npu_train.pipeline.schedule.stage_timeline`): ``t_b + t_w`` unless the schedule splits the backward
    (the first stage's still whole); ``None`` with two chunks per card (no drain bound there)."""
    if pm.memory.chunks != 1:
        return None
    split = pm.shape.schedule in SPLIT_BACKWARD and i > 0
    return c.t_b if split else c.t_b + c.t_w


def _drain_bound(M: int, t_mb: float, t_f: float, db, drain: float) -> float:
    """Seconds of the pipeline phase from stage ``i``'s first action on, at least (before the stretch): its ``M``
    micro-batches' work ``M t_mb``; and, with one chunk per card (``db``: its ``B`` seconds, not None), its
    ``M`` forwards and ``B`` passes, the last of which precedes the last micro-batch's ``B`` on every stage
    before it (``drain``: the sum of theirs); its ``W`` passes may run meanwhile. Each card runs one action
    at a time, a micro-batch's ``B`` runs after its ``F`` on the same card and after its ``B`` on the next
    stage, and a card's ``B`` passes run in micro-batch order."""
    if db is None:
        return M * t_mb
    return max(M * t_mb, M * (t_f + db) + drain)


class _TailBound:
    """Lower bounds, with one chunk per card, for the stages :func:`fastest_split` has not placed yet, from the
    options of each (``t_f`` and ``B`` seconds per micro-batch, ``B`` as :func:`_backward_pass`) over the ways to
    put ``rest`` layers on stages ``j..P-1`` (each term minimised on its own):

    - :meth:`last`: the last stage's two :func:`_drain_bound` terms: it waits for micro-batch 0's forwards through
      all stages before it, then works ``M t_mb``; or, after its ``M`` forwards and ``B`` passes, the last
      micro-batch's ``B`` passes run through all stages before it;
    - :meth:`round_trip`: micro-batch 0's forward and ``B`` through stages ``j..P-1``, which come between a stage's
      forward of it and its ``B`` of it.

    ``paths``: per stage, ``(F, B)`` seconds of its boundary copies on a micro-batch's path outside its ``t_f`` /
    ``B`` (:meth:`~npu_train.planner.cost.CostModel.path_copies`: a copy thread's), added along the paths.
    All 0 with two chunks per card (no such bounds)."""

    def __init__(self, opts: list, M: int, L: int, paths: Optional[list] = None):
        inf = float("inf")
        P = len(opts)
        self.P, self.on = P, all(o[5] is not None for stage in opts for o in stage)

        def sums(last: int, f: float, b: float) -> list:
            """[j][k]: least sum of f t_f + b B over stages j..last holding k layers in all (one option each)"""
            out = [[inf] * (L + 1) for _ in range(P + 1)]
            out[last + 1][0] = 0.0
            for j in range(last, -1, -1) if self.on else ():
                for k in range(L + 1):
                    pf, pb = paths[j] if paths else (0.0, 0.0)
                    out[j][k] = min((f * (c.t_f + pf) + b * (db + pb) + out[j + 1][k - n]
                                     for n, _r, c, _sd, _f0, db in opts[j] if n <= k), default=inf)
            return out

        def with_last(mid: list, own) -> list:
            """[j][k]: least of mid[j][k - n] + own(option n of the last stage)"""
            out = [[inf] * (L + 1) for _ in range(P + 1)]
            for j in range(P - 1, -1, -1) if self.on else ():
                for k in range(L + 1):
                    out[j][k] = min((mid[j][k - o[0]] + own(o) for o in opts[P - 1] if o[0] <= k), default=inf)
            return out

        self.down = sums(P - 1, 1.0, 1.0)
        self.busy = with_last(sums(P - 2, 1.0, 0.0), lambda o: M * o[2].t_mb)
        self.drained = with_last(sums(P - 2, 1.0, 1.0), lambda o: M * (o[2].t_f + o[5]))

    def last(self, j: int, rest: int) -> tuple[float, float]:
        """``(busy, drained)`` seconds before the stretch: the last stage's end is at least the forwards of micro-batch
        0 through the stages before ``j`` + ``busy``, and at least their forwards and ``B`` passes + ``drained``,
        when stages ``j..P-1`` hold ``rest`` layers; ``(0, 0)`` when none is left or no bound applies."""
        if j >= self.P or not self.on:
            return 0.0, 0.0
        return self.busy[j][rest], self.drained[j][rest]

    def round_trip(self, j: int, rest: int) -> float:
        """Seconds of micro-batch 0's forward and ``B`` through stages ``j..P-1`` holding ``rest`` layers, at
        least; 0 when none is left or no bound applies."""
        if j >= self.P or not self.on:
            return 0.0
        return self.down[j][rest]


class _Beaten(Exception):
    """:func:`fastest_split` with ``beat``: ``split`` is under it (ends the search)."""

    def __init__(self, split: list[int]):
        super().__init__(split)
        self.split = split


def _suffix_min(xs: Sequence[float]) -> list[float]:
    """``[min(xs[k:]) for k in range(len(xs))]``."""
    out, m = [0.0] * len(xs), float("inf")
    for k in range(len(xs) - 1, -1, -1):
        m = xs[k] if xs[k] < m else m
        out[k] = m
    return out


class _RestFloor:
    """The part of :func:`fastest_split`'s bound that only the stages not placed yet fix, as a function of the
    layers ``x`` they hold, made non-decreasing in ``x``: per start stage ``j`` and ``x`` in ``0..L``,
    ``M t_mb`` and the side seconds of :class:`_RestBound` (already non-decreasing) and the least of
    :class:`_TailBound`'s ``busy`` and ``drained`` over ``x' >= x`` (0 without those bounds). Each is at most the
    term the search's bound uses at ``x`` and the bound's sums and products round monotonically, so where
    :meth:`first_kept` says the rest alone is over the best the search's own bound cuts too."""

    def __init__(self, rest: "_RestBound", tail: "_TailBound", M: int, L: int):
        P = rest.P
        self.t, self.sd, self.busy, self.drained = [None] * P, [None] * P, [None] * P, [None] * P
        for j in range(1, P):
            per, top = P - j, len(rest.t[j]) - 1
            q = [min(-(-x // per), top) for x in range(L + 1)]
            self.t[j] = [M * rest.t[j][k] for k in q]
            self.sd[j] = [rest.sd[j][k] for k in q]
            self.busy[j] = _suffix_min(tail.busy[j]) if tail.on else [0.0] * (L + 1)
            self.drained[j] = _suffix_min(tail.drained[j]) if tail.on else [0.0] * (L + 1)

    def first_kept(self, j: int, ns: Sequence[int], lo: int, hi: int, left: int, chain: float, drain: float,
                   stretch: float, cut: float) -> int:
        """The first option index ``k`` in ``lo..hi`` (layer counts ``ns``, ascending, each ``left - ns[k]`` in
        ``0..L``) whose rest ``left - ns[k]`` on stages ``j..`` is not cut by the rest's terms alone,
        ``((chain + max(M t, busy, drain + drained)) * stretch + sd) (1 - 1e-12) > cut``; ``hi`` when all are
        (bisected: the test holds for every rest from some value up)."""
        t, sd, busy, drained = self.t[j], self.sd[j], self.busy[j], self.drained[j]
        while lo < hi:
            mid = (lo + hi) // 2
            x = left - ns[mid]
            y = t[x]
            if busy[x] > y:
                y = busy[x]
            z = drain + drained[x]
            if z > y:
                y = z
            if ((chain + y) * stretch + sd[x]) * (1 - 1e-12) > cut:
                lo = mid + 1
            else:
                hi = mid
        return lo


class _RestBound:
    """Lower bounds for the stages :func:`fastest_split` has not placed yet: ``rest`` layers over the ``K``
    stages ``j >= i`` put at least ``k = ceil(rest / K)`` on one of them, whose time per micro-batch and side
    time are then at least the least over ``j >= i`` and ``n >= k`` of its options' (no monotonicity in ``n``
    assumed). That stage starts after the placed stages' first-chunk forwards and is busy ``M t`` after."""

    def __init__(self, opts: list, nmax: int):
        inf = float("inf")
        P = len(opts)
        self.P = P
        # [stage j][k]: least t_mb / side seconds over stages >= j holding >= k layers
        self.t = [[inf] * (nmax + 2) for _ in range(P + 1)]
        self.sd = [[inf] * (nmax + 2) for _ in range(P + 1)]
        for j in range(P - 1, -1, -1):
            gt, gs = [inf] * (nmax + 2), [inf] * (nmax + 2)
            for n, _r, c, sd, _f0, _db in opts[j]:
                gt[n], gs[n] = min(gt[n], c.t_mb), min(gs[n], sd)
            for k in range(nmax, -1, -1):
                gt[k], gs[k] = min(gt[k], gt[k + 1]), min(gs[k], gs[k + 1])
                self.t[j][k] = min(gt[k], self.t[j + 1][k])
                self.sd[j][k] = min(gs[k], self.sd[j + 1][k])

    def at(self, j: int, rest: int) -> tuple[float, float]:
        """``(t_mb, side seconds)`` lower bounds for the stage of ``j..P-1`` with the most of ``rest`` layers;
        ``(0, 0)`` when none is left (``j = P``)."""
        if j >= self.P:
            return 0.0, 0.0
        return self.t[j][-(-rest // (self.P - j))], self.sd[j][-(-rest // (self.P - j))]


def make_plan(req: PlanRequest) -> Plan:
    """Place ``req.model`` on ``req.cards`` and predict memory (bytes) and step time (seconds).

    Raises:
        PlacementError: a card over capacity, nothing fits in auto mode, host RAM too small, more cards than
            layers, a resident count above a card's layers, a bad ``split``.
        ValueError: an unknown card kind, ``dp < 1`` or ``zero`` not 0/1, a ``rates`` or ``memory_terms`` list
            of the wrong length, ``headroom`` outside [0, 1), an unknown ``resident_layers`` string, a two-chunk
            schedule (zbv, interleaved) on one card."""
    PROGRESS.plans += 1
    PROGRESS.current = shape_label(req.shape, int(req.dp))
    PROGRESS.tick()
    pm = _cost_model(req)
    split = _checked_split(req)
    if not isinstance(req.resident_layers, str):
        return _plan_with_resident_counts(pm, req, split)
    if req.resident_layers != "auto":
        raise ValueError(f"resident_layers must be 'auto', an int or a list, got {req.resident_layers!r}")
    return _plan_auto(pm, req, split)


def plan_beats(req: PlanRequest, step_s: float) -> bool:
    """Whether :func:`make_plan` of ``req`` may plan a step under ``step_s`` seconds: False only where that is
    proven not to be (its split search with ``beat``, :func:`fastest_split`, finds no split under it: the
    searched plan's split is one the search without ``beat`` evaluated, and every such split under ``step_s``
    this one evaluates too, caps included); True where it may, or where no such search applies (a given split or
    resident counts, a request the planner refuses). Cheaper than the plan where the answer is False: the search
    cuts at ``step_s`` from its start (``train.schedule=auto`` keeps a candidate's plan with the attention core
    recomputed only where it is faster than the one without, :mod:`~npu_train.planner.schedule_choice`)."""
    if req.split is not None or req.resident_layers != "auto":
        return True
    PROGRESS.plans += 1
    PROGRESS.current = shape_label(req.shape, int(req.dp))
    PROGRESS.tick()
    try:
        pm = _cost_model(req)
        if _over_floor(pm):
            return True
        return fastest_split(pm, req.model.num_layers, "auto", max_timelines=MAX_TIMELINES, beat=step_s) is not None
    except (PlacementError, ValueError):
        return True


def _cost_model(req: PlanRequest) -> CostModel:
    """The :class:`CostModel` of ``req`` after the checks that need no plan."""
    cards, model = list(req.cards), req.model
    P, L = len(cards), model.num_layers
    if P < 1:
        raise PlacementError("no cards given")
    if int(req.dp) < 1 or int(req.zero) not in (0, 1):
        raise ValueError(f"make_plan needs dp >= 1 and zero in (0, 1), got dp={req.dp}, zero={req.zero}")
    if P < stages_needed(req.shape.schedule):  # the runtime hands chunk 0 to chunk 1 across cards
        raise ValueError(f"schedule {req.shape.schedule} needs at least 2 pipeline stages (P={P}): use 1f1b")
    if P > L:
        raise PlacementError(
            f"more cards ({P}) than decoder layers ({L}) of {model.name}: every card needs at "
            f"least one layer; fix: use at most {L} cards"
        )
    for c in cards:
        if c.kind not in KINDS:
            raise ValueError(f"card kind must be one of {KINDS}, got {c.kind!r}")
    rates = [req.rates] * P if isinstance(req.rates, Rates) else list(req.rates)
    if len(rates) != P:
        raise ValueError(f"got {len(rates)} Rates for {P} cards")
    if not 0.0 <= float(req.headroom) < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {req.headroom!r}")
    if req.memory_terms is not None and len(req.memory_terms) != P:
        raise ValueError(f"got {len(req.memory_terms)} MemoryTerms for {P} cards")
    cores = int(req.host_cores) if req.host_cores else usable_cores()
    threads = int(req.threads) if req.threads else threads_per_card(0, P * int(req.dp), cores)
    return CostModel(model, req.shape, cards, rates, req.nonlayer_resident, threads, cores,
                     req.memory_terms, req.headroom, dp=int(req.dp), zero=int(req.zero),
                     cards_per_host=int(req.cards_per_host))


def _checked_split(req: PlanRequest) -> Optional[list[int]]:
    """``req.split`` as ints (``None`` if unset); ``PlacementError`` unless one count >= 1 per card
    summing to the model's layers."""
    if req.split is None:
        return None
    split, P, L = [int(n) for n in req.split], len(req.cards), req.model.num_layers
    if len(split) != P:
        raise PlacementError(f"split {split} has {len(split)} entries for {P} cards: give train.split one layer "
                             f"count per card ({P}), or drop it (the planner chooses)")
    if any(n < 1 for n in split):
        raise PlacementError(f"split {split}: every card needs at least one layer")
    if sum(split) != L:
        raise PlacementError(
            f"split {split} sums to {sum(split)} layers; {req.model.name} has {L}: give train.split "
            f"layers per card summing to {L}, or drop train.split (the planner chooses)")
    return split


def _plan_with_resident_counts(pm: CostModel, req: PlanRequest, split: Optional[list[int]]) -> Plan:
    """The plan for explicit resident counts on ``split`` (``None``: the fastest split holding
    them, else the balanced split, whose error explains why)."""
    P, L, cards = pm.P, req.model.num_layers, pm.cards
    if isinstance(req.resident_layers, numbers.Integral):
        res = [int(req.resident_layers)] * P
    else:
        res = [int(r) for r in req.resident_layers]
        if len(res) != P:
            raise PlacementError(f"resident_layers {res} has {len(res)} entries for {P} cards: give "
                                 f"train.resident_layers one count per card ({P}), one integer for every card, "
                                 "or drop it (the planner chooses)")
    if split is None:
        split = (fastest_split(pm, L, res) if min(res) >= 0 else None) or balanced_split(L, P)
    for i, (n, r) in enumerate(zip(split, res)):
        if r < 0:
            raise PlacementError(f"{card_label(i, cards[i])}: resident layers {r} < 0")
        if r > n:
            raise PlacementError(
                f"{card_label(i, cards[i])} holds {n} layers but {r} resident layers were "
                f"requested; fix: resident_layers <= {n} on this card (split {split})")
    plan = pm.build(split, res)
    if req.strict:
        bad = [i for i, st in enumerate(plan.stages) if not st.fits]
        if bad:
            raise PlacementError(f"the resident layers {res} do not fit on split {split}:\n"
                                 + _over_capacity(pm, plan, bad))
    return _check_host(plan, req.host_ram_bytes, req.strict)


def _plan_auto(pm: CostModel, req: PlanRequest, split: Optional[list[int]]) -> Plan:
    """The plan with the most resident layers that fit on ``split`` (``None``: the fastest); nothing fits: a
    ``fits=False`` plan (not ``strict``) or a ``PlacementError`` at each stage's least-memory count."""
    L = req.model.num_layers
    st = SplitSearchStats()
    if split is None and _over_floor(pm):  # no split fits (its least-memory plan below says why): no search
        chosen = None
    else:
        chosen = split if split is not None else fastest_split(pm, L, "auto", max_timelines=MAX_TIMELINES, stats=st)
    if chosen is not None:
        res = [pm.max_resident(i, n) for i, n in enumerate(chosen)]
        if min(res) >= 0:
            plan = pm.build(chosen, res)
            plan.search_capped_at = st.timelines if st.capped else 0
            return _check_host(plan, req.host_ram_bytes, req.strict)
    shown = chosen if chosen is not None else balanced_split(L, pm.P)
    least = [min(range(n + 1), key=lambda r, i=i, n=n: (pm.cost(i, n, r).mem["total"], r))
             for i, n in enumerate(shown)]
    plan = pm.build(shown, least)
    plan.fits = False
    if not req.strict:
        return _check_host(plan, req.host_ram_bytes, strict=False)
    bad = [i for i, st in enumerate(plan.stages) if st.mem["total"] > pm.limit(i)] or [0]
    floor, more_cards = _floor_over_cards(pm, shown, req)
    checked = checked_fixes(pm, req, more_cards) if req.check_fixes else None
    raise PlacementError(
        f"no placement of {req.model.name} fits with any number of resident layers"
        + ("" if split is not None else " on any split") + floor + "\n"
        + _host_ram_line(pm) + _over_capacity(pm, plan, bad, headroom=True, more_cards=more_cards, checked=checked)
        + _what_fits(pm, plan, req)
    )


def fits_somewhere(req: PlanRequest) -> bool:
    """Whether ``req`` (``resident_layers="auto"``) has a placement that fits: some split (``req.split``: that one)
    whose every card fits with its least-memory resident count (:meth:`CostModel.max_resident` >= 0), found by
    :func:`search_split` without simulating a timeline; False for a request the planner refuses outright."""
    try:
        pm = _cost_model(req)
        split = _checked_split(req)
    except (PlacementError, ValueError):
        return False
    if split is not None:
        return all(pm.max_resident(i, n) >= 0 for i, n in enumerate(split))
    return search_split(pm, req.model.num_layers) is not None


def _largest(fits, hi: int) -> int:
    """The largest ``x`` in ``1..hi`` with ``fits(x)`` (monotone: true up to some ``x``), 0 when none."""
    lo = 0  # fits(lo) holds (0: nothing yet)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _round_seq_len(s: int) -> int:
    """A sequence length to name, at most ``s``: a multiple of 256 from 1024 tokens, of 64 from 128."""
    step = 256 if s >= 1024 else 64 if s >= 128 else 1
    return s - s % step


def checked_fixes(pm: CostModel, req: PlanRequest, more_cards: Optional[str]) -> "CheckedFixes":
    """The card-level fixes of ``req``'s refusal, each planned with everything else as asked
    (:class:`~npu_train.planner.table.CheckedFixes`): whether ``train.recompute=true`` fits (on 1F1B where the
    schedule splits its backward), the largest micro-batch and sequence length that fit (bisected: memory grows
    with both), and on accelerator cards the fewest cards like these that fit (:func:`_fewest_cards`, unless the
    weights' floor already named them, ``more_cards``)."""
    from npu_train.planner.table import CheckedFixes

    sh = req.shape
    auto = replace(req, resident_layers="auto", strict=False, check_fixes=False)
    out = CheckedFixes()
    if not sh.recompute:
        rs = replace(sh, recompute=True, schedule="1f1b" if sh.schedule in SPLIT_BACKWARD else sh.schedule)
        out.recompute = fits_somewhere(replace(auto, shape=rs))
        if not out.recompute:
            out.recompute_micro_batch = _largest(
                lambda b: fits_somewhere(replace(auto, shape=replace(rs, micro_batch=b))), sh.micro_batch - 1)
    if any(c.kind in HOST_MEMORY_KINDS for c in pm.cards):
        from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS

        terms = req.memory_terms or [DEFAULT_MEMORY_TERMS[c.kind] for c in pm.cards]
        out.keep_host = fits_somewhere(replace(auto, memory_terms=[replace(t, heap_fraction=0.0) for t in terms]))
    out.micro_batch = _largest(lambda b: fits_somewhere(replace(auto, shape=replace(sh, micro_batch=b))),
                               sh.micro_batch - 1)
    out.seq_len = _round_seq_len(_largest(lambda n: fits_somewhere(replace(auto, shape=replace(sh, seq_len=n))),
                                          sh.seq_len - 1))
    if more_cards is None and not all(c.kind in HOST_MEMORY_KINDS for c in pm.cards):
        n = _fewest_cards(auto, pm.P + 1) if pm.P < req.model.num_layers else None
        out.more_cards = f"{n} such cards, the fewest that fit" if n else ""
    return out


#: how many card counts from the weights' floor up :func:`_floor_over_cards` plans to name the fewest that fit
FEWEST_CARDS_TRIED = 4


def _fewest_cards(req: PlanRequest, start: int) -> Optional[int]:
    """The fewest cards like ``req``'s (its first card's kind, capacity, rates and memory terms; the last card's
    for the head) from ``start`` up, :data:`FEWEST_CARDS_TRIED` counts at most, on which ``req`` fits; None when
    none of those does."""
    c0 = req.cards[0]
    for n in range(start, min(start + FEWEST_CARDS_TRIED, req.model.num_layers + 1)):
        cards = [replace(c0, index=i if c0.index is not None else None, name=f"{c0.kind}:{i}") for i in range(n)]
        rates = req.rates if isinstance(req.rates, Rates) else [req.rates[0]] * (n - 1) + [req.rates[-1]]
        terms = None if req.memory_terms is None else [req.memory_terms[0]] * (n - 1) + [req.memory_terms[-1]]
        plan = make_plan(replace(req, cards=cards, rates=rates, memory_terms=terms, split=None,
                                 resident_layers="auto", strict=False))
        if plan.fits:
            return n
    return None


def _floor_over_cards(pm: CostModel, split: Sequence[int], req: PlanRequest) -> tuple[str, Optional[str]]:
    """``(", since the weights and gradients alone need X GiB, more than the Y GiB usable on the P cards together",
    "N such cards, the fewest that fit")`` when the terms no placement can move off the cards (weights, and the gradient accumulators, at
    ``split`` with every layer offloaded) exceed the sum of the cards' limits, e.g. a 235 B mixture of experts on
    8 cards; else ``("", None)``. N is planned (:func:`_fewest_cards`): the floor alone would name too few (activations,
    workspace); "at least" the first count not tried when none of those does. On cpu cards more cards split the
    same host RAM, so no count is named (None): :func:`_what_fits` names what does fit."""
    mm = pm.memory
    floor, room = _state_floor(pm, split)
    if floor <= room:
        return "", None
    what = "weights and gradients" if mm.gradients(mm.parameters(0, split[0], 0)) else "weights"
    head = (f": the {what} alone need {gib(floor):.2f} GiB, more than the {gib(room):.2f} GiB usable on the "
            f"{pm.P} cards together")
    if all(c.kind in HOST_MEMORY_KINDS for c in pm.cards):
        return head + " (more cpu cards split the same host RAM)", None
    per_card = min(pm.limit(i) for i in range(pm.P))
    need = -(-floor // per_card)
    fewest = _fewest_cards(req, need)
    fix = (f"{fewest} such cards, the fewest that fit" if fewest is not None
           else f"at least {min(need + FEWEST_CARDS_TRIED, req.model.num_layers + 1)} such cards")
    return head, fix


def _state_floor(pm: CostModel, split: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """``(floor, room)``, bytes: the terms no placement can move off the cards, each card's weights and gradient
    accumulators with every layer offloaded, summed over the cards at ``split`` (None: balanced), and the sum of
    the cards' limits. The floor is the same on every split (the memory model gives every layer the same
    parameter count; the embedding and head go with the first and last card) and under every schedule and
    recompute (they change activations only), so ``floor > room`` rules out every placement of the request."""
    mm = pm.memory
    floor = 0
    for i, n in enumerate(split if split is not None else balanced_split(pm.model.num_layers, pm.P)):
        p = mm.parameters(i, n, 0)
        floor += mm.weights(p) + mm.gradients(p)
    return floor, sum(pm.limit(i) for i in range(pm.P))


def _over_floor(pm: CostModel) -> bool:
    floor, room = _state_floor(pm)
    return floor > room


def state_floor_over_cards(req: PlanRequest) -> bool:
    """True when ``req``'s weights and gradients alone (:func:`_state_floor`) exceed its cards' usable memory
    together: then nothing fits, whatever the split, resident layers, schedule, recompute or vocabulary
    parallelism, and a caller that would plan each of those (``train.schedule=auto``) plans once to refuse (a
    235 B mixture of experts on 8 RNGD cards: 54 plans, 89 CPU s, before). False for a request whose cost model
    cannot be built (the plan names that error)."""
    try:
        pm = _cost_model(req)
    except (PlacementError, ValueError):
        return False
    return _over_floor(pm)


def _host_ram_line(pm: CostModel) -> str:
    """For cpu cards (whose memory is the host's): ``"host RAM 23.54 GiB in total: 8 cpu cards x 2.88 GiB +
    0.50 GiB for the launcher\\n"``, the quantities the card lines' "usable" comes from; ``""`` otherwise."""
    cpu = [c for c in pm.cards if c.kind in HOST_MEMORY_KINDS]
    if not cpu or len(cpu) != len(pm.cards) or len({c.capacity_bytes for c in cpu}) != 1:
        return ""
    n = len(cpu) * pm.dp
    total = n * cpu[0].capacity_bytes + LAUNCHER_RESERVE_BYTES
    return (f"host RAM {gib(total):.2f} GiB in total: {n} cpu card(s) x {gib(cpu[0].capacity_bytes):.2f} GiB + "
            f"{gib(LAUNCHER_RESERVE_BYTES):.2f} GiB for the launcher\n")


def _what_fits(pm: CostModel, plan: Plan, req: PlanRequest) -> str:
    """``"\\nwhat fits instead: ..."`` when no card-level setting can (``plan``: the least-memory placement, whose
    cards' weights, gradients and optimizer state alone are over their limits, :func:`_state_over`): LoRA (rank
    8 on the default targets; with ``train.dtype=bf16`` from fp32) when it plans to fit on the same split, a host
    with the RAM that fits (cpu cards: :func:`_host_ram_that_fits`), a model under the parameter count whose
    state fits; ``""`` when some card's activations or resident layers could still be changed to fit."""
    if not any(_state_over(pm, plan, i) for i in range(pm.P)):
        return ""
    out = []
    s = req.shape
    variants = []
    if not s.lora_params_per_layer:
        from npu_train.config import LORA_TARGETS, LoraConf
        from npu_train.planner.moe import lora_expert_rank, lora_params_per_layer

        total, active = lora_params_per_layer(req.model, LoraConf().rank, LORA_TARGETS)
        lora = replace(s, lora_params_per_layer=total, lora_active_params_per_layer=active,
                       lora_expert_rank=lora_expert_rank(req.model, LoraConf().rank, LORA_TARGETS))
        variants.append((f"train.mode=lora (rank {LoraConf().rank})", lora))
        if s.dtype == "fp32":
            variants.append((f"train.mode=lora (rank {LoraConf().rank}) with train.dtype=bf16", replace(lora, dtype="bf16")))
    for text, shape in variants:
        alt = make_plan(replace(req, shape=shape, split=list(plan.split), resident_layers="auto", strict=False))
        if alt.fits:
            per_card = "/".join(f"{gib(st.mem['total']):.2f}" for st in alt.stages)
            out.append(f"{text}, planned at {per_card} GiB per card")
            break
    if all(c.kind in HOST_MEMORY_KINDS for c in pm.cards):
        out.append(_host_ram_that_fits(pm, plan))
    smaller = _largest_model_that_fits(req)
    if smaller:
        out.append(smaller)
    return "\nwhat fits instead: " + ", or ".join(out) if out else ""


def _state_over(pm: CostModel, plan: Plan, i: int) -> bool:
    return state_bytes(plan.stages[i]) > pm.limit(i)


def _host_ram_that_fits(pm: CostModel, plan: Plan) -> str:
    """``"a host with about X GiB of RAM in total (this one: Y GiB)"``: cpu cards split the host RAM (less the launcher's reserve)
    evenly, so the busiest card's total over ``1 - headroom``, times the cpu card processes, plus the reserve."""
    n_cpu = pm.dp * len(plan.stages)
    need = max(st.mem["total"] for st in plan.stages) / (1.0 - pm.headroom) * n_cpu + LAUNCHER_RESERVE_BYTES
    now = sum(st.card.capacity_bytes for st in plan.stages) * pm.dp + LAUNCHER_RESERVE_BYTES
    return f"a host with about {gib(need):.0f} GiB of RAM in total (this one: {gib(now):.2f} GiB)"


def _largest_model_that_fits(req: PlanRequest) -> str:
    """``"a smaller model, e.g. llama-3.2-1b (1.24 B params) plans to fit"``: the largest shape preset
    (:mod:`npu_train.model.presets`) under the model's parameter count that fits these cards at the same run
    shape, planned on a balanced split, presets of the model's kind first (a mixture of experts is offered
    ``qwen3-30b-a3b`` or ``mixtral-8x7b`` before a dense model, a dense model a dense one); ``""`` when none does."""
    from npu_train.model.presets import PRESETS

    n, moe = req.model.total_params(), req.model.is_moe
    smaller = sorted(((m.is_moe == moe, m.total_params(), name, m) for name, m in PRESETS.items()
                      if (moe or not m.is_moe) and m.total_params() < n and m.num_layers >= len(req.cards)),
                     reverse=True)
    for _, params, name, m in smaller:
        plan = make_plan(replace(req, model=m, split=balanced_split(m.num_layers, len(req.cards)),
                                 resident_layers="auto", strict=False))
        if plan.fits:
            return f"a smaller model, e.g. {name} ({params / 1e9:.2f} B params) plans to fit"
    return ""
