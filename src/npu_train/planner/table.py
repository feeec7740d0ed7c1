"""Text of a :class:`~npu_train.planner.plan.Plan`: the per-card table (:func:`plan_table`), the dry-run
report (:func:`format_plan`) and the over-capacity message. Memory in GiB (2**30 B), time in seconds."""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Optional

from npu_train.hardware import BUSY_LOAD_PER_CORE, HOST_MEMORY_KINDS, Card
from npu_train.pipeline.schedule import SPLIT_BACKWARD, bubble_fraction
from npu_train.planner.memory import ATTENTION, activation_bytes_per_layer
from npu_train.planner.plan import MEM_KEYS, Plan
from npu_train.planner.spec import duration, gb, gib

__all__ = ["CheckedFixes", "plan_table", "format_plan", "offload_lines", "card_label", "over_capacity_message", "card_memory_line",
           "memory_sources", "rate_sources"]


def card_label(i: int, card: Card) -> str:
    """``"card <i> (<name>)"``: how messages name a card."""
    return f"card {i} ({card.name})"


def state_bytes(st) -> int:
    """What no activation, heap or recompute setting changes on a card (bytes): the process baseline, weights,
    gradient accumulators and, on a cpu card (whose memory holds every layer's state, resident or offloaded), the
    optimizer state; an accelerator's optimizer state is left out (fewer resident layers move it to the host)."""
    m = st.mem
    own = m["baseline"] + m["weights"] + m["grads"]
    return own + (m["optimizer"] if st.card.kind in HOST_MEMORY_KINDS else 0)


def card_memory_line(plan: Plan, st_index: int, limit_bytes: Optional[int] = None) -> str:
    """One card over its limit: ``"card 0 (cpu:0), layers 0-3 +emb: plan 25.69 GiB > usable 2.74 GiB (baseline
    0.35 + weights 5.21 + ...)"``; "usable" is ``limit_bytes`` (the capacity less ``placement.headroom``), else
    "capacity" (the card's whole capacity, the limit of explicit resident counts). GiB = 2**30 B."""
    st = plan.stages[st_index]
    return f"{card_label(st_index, st.card)}, layers {st.layers_label}: " + _memory_figures(plan, st_index, limit_bytes)


def _memory_figures(plan: Plan, st_index: int, limit_bytes: Optional[int]) -> str:
    st = plan.stages[st_index]
    m = st.mem
    limit = limit_bytes if limit_bytes is not None else st.card.capacity_bytes
    terms = ([f"baseline {gib(m['baseline']):.2f}"] if m["baseline"] else []) + [
        f"{k} {gib(m[k]):.2f}" for k in ("weights", "grads", "optimizer", "activations", "transient", "workspace")]
    return (f"plan {gib(m['total']):.2f} GiB > {'usable' if limit_bytes is not None else 'capacity'} "
            f"{gib(limit):.2f} GiB ({' + '.join(terms)})")


def _card_lines(plan: Plan, cards: list) -> list[str]:
    """:func:`card_memory_line` per card, neighbours with the same figures on one line (``"cards 1-4 (cpu:1 ..
    cpu:4), layers 4-7, 8-11, 12-15, 16-19: each plan 16.29 GiB > ..."``): an 8-card refusal repeated one line
    four times."""
    groups: list[list] = []
    for i, _, lim in cards:
        fig = _memory_figures(plan, i, lim)
        if groups and groups[-1][1] == fig and groups[-1][0][-1] == i - 1:
            groups[-1][0].append(i)
        else:
            groups.append([[i], fig])
    out = []
    for idx, fig in groups:
        if len(idx) == 1:
            out.append(card_memory_line(plan, idx[0], cards[[c[0] for c in cards].index(idx[0])][2]))
            continue
        a, b = plan.stages[idx[0]], plan.stages[idx[-1]]
        layers = ", ".join(plan.stages[i].layers_label for i in idx)
        out.append(f"cards {idx[0]}-{idx[-1]} ({a.card.name} .. {b.card.name}), layers {layers}: each {fig}")
    return out


@dataclass
class CheckedFixes:
    """The card-level fixes of a refusal, each planned (``search.check_fixes``): None where not checked (the fix is
    named as a setting that lowers memory). ``recompute``: whether ``train.recompute=true`` fits; ``more_cards``:
    how many cards like these fit (``"6 such cards, the fewest that fit"``), ``""`` when none of the counts tried
    does; ``micro_batch`` / ``seq_len``: the largest that fits with the other as it is, 0 when none does;
    ``recompute_micro_batch``: where recompute alone does not fit, the largest micro-batch that fits with it (0:
    none)."""

    recompute: Optional[bool] = None
    recompute_micro_batch: int = 0
    #: whether ``runtime.keep_host_memory=false`` (no heap holes on a cpu card) fits
    keep_host: Optional[bool] = None
    more_cards: Optional[str] = None
    micro_batch: Optional[int] = None
    seq_len: Optional[int] = None


def over_capacity_message(plan: Plan, cards: list, more_cards: Optional[str] = None,
                          checked: Optional[CheckedFixes] = None) -> str:
    """The lines of a refusal for the cards over their limits, each fix said once for all of them.

    ``cards``: ``(stage index, max_resident, limit_bytes)`` per card over its limit (``max_resident``: the most
    resident layers that fit, -1 none; ``limit_bytes``: the auto limit with ``placement.headroom``, or None for
    the capacity). Lines: one per card (:func:`card_memory_line`), what "usable" is, then one ``fix:`` line per
    fix: fewer resident layers (per card), more RAM per cpu card (the most any card's weights, gradients and
    optimizer state need alone) or more cards (``more_cards`` says how many where planned), and the activation,
    recompute and heap settings only when some card's :func:`state_bytes` are within its limit (they cannot
    lower those); with ``checked`` (:class:`CheckedFixes`) only the fixes planned to fit, with the figures that do.
    Every figure in GiB (2**30 B)."""
    checked = checked or CheckedFixes()
    more_cards = more_cards if more_cards is not None else checked.more_cards
    lines = _card_lines(plan, cards)
    limited = [(plan.stages[i].card.capacity_bytes, lim) for i, _, lim in cards if lim is not None]
    if limited:
        caps = sorted({gib(c) for c, _ in limited})
        cap = f"{caps[0]:.2f} GiB" if len(caps) == 1 else "/".join(f"{c:.2f}" for c in caps) + " GiB"
        lines.append(f"usable = a card's capacity ({cap}) less placement.headroom={plan.headroom:g}")
    fixes = []
    fewer = [f"card {i} at most {r} (now {len(plan.stages[i].resident)})" for i, r, _ in cards
             if 0 <= r < len(plan.stages[i].resident)]
    if fewer:
        fixes.append("fewer resident layers: " + ", ".join(fewer))
    limit_of = {i: (lim if lim is not None else plan.stages[i].card.capacity_bytes) for i, _, lim in cards}
    over = [i for i in limit_of if state_bytes(plan.stages[i]) > limit_of[i]]
    if any(plan.stages[i].card.kind == "cpu" for i in limit_of):
        # a cpu card's capacity is its share of the host's RAM: more cpu cards split the same RAM
        need = ""
        if over:
            big = max(over, key=lambda i: state_bytes(plan.stages[i]))
            need = (f" (at least {gib(state_bytes(plan.stages[big])):.2f} GiB a card: card {big}'s weights, gradients "
                    "and optimizer state alone)")
        fixes.append(f"more RAM per cpu card{need}: a larger host, or placement.capacity_gib if it was set below "
                     "the card's share of the RAM (more cpu cards split the same RAM)")
    elif more_cards != "":  # "": none of the counts planned fits
        fixes.append(f"more cards ({more_cards})" if more_cards else "more cards")
    if len(over) < len(limit_of):
        fixes += _activation_fixes(plan, [i for i in limit_of if i not in over], checked)
    return "\n".join(lines + [f"fix: {f}" for f in fixes])


def _smaller_batch_fix(sh, checked: CheckedFixes) -> Optional[str]:
    """The micro-batch / sequence-length fix: the largest of each that fits (:class:`CheckedFixes`), or the
    settings unchecked; None when neither fits."""
    if checked.micro_batch is None and checked.seq_len is None:
        return f"a smaller train.micro_batch (now {sh.micro_batch}) or data.seq_len (now {sh.seq_len})"
    parts = []
    if checked.micro_batch:
        parts.append(f"train.micro_batch={checked.micro_batch} (now {sh.micro_batch})")
    if checked.seq_len:
        parts.append(f"data.seq_len={checked.seq_len}" + (f" (now {sh.seq_len}" + (
            f", at train.micro_batch={sh.micro_batch})" if sh.micro_batch > 1 else ")")))
    if not parts:
        return None
    return "the largest that fit" + ("" if len(parts) > 1 else "s") + ": " + " or ".join(parts)


def _activation_fixes(plan: Plan, cards: list[int], checked: Optional[CheckedFixes] = None) -> list[str]:
    """The settings that lower a card's activations and heap (for ``cards``, whose state fits their limit); with
    ``checked``, those planned to fit."""
    sh = plan.shape
    checked = checked or CheckedFixes()
    out = []
    one_f = " (with train.schedule=1f1b: not with the zero-bubble schedules)" if sh.schedule in SPLIT_BACKWARD else ""
    if not sh.recompute and checked.recompute is not False:
        out.append("train.recompute=true" + one_f)
    elif not sh.recompute and checked.recompute_micro_batch:
        out.append(f"train.recompute=true with train.micro_batch={checked.recompute_micro_batch} (now "
                   f"{sh.micro_batch}; neither alone fits)" + one_f)
    smaller = _smaller_batch_fix(sh, checked)
    if smaller:
        out.append(smaller)
    heap = max((plan.stages[i].mem.get("heap") or 0) for i in cards)
    if heap and checked.keep_host is not False:  # a cpu card keeping freed memory: its heap's holes in its workspace
        out.append(f"runtime.keep_host_memory=false (the card returns freed memory: up to {gib(heap):.2f} GiB "
                   "less a card, slower steps)")
    return out


def _first_of_each_kind(plan: Plan, per_stage) -> list[tuple]:
    """``(card kind, per_stage[i])`` for the first stage ``i`` of each card kind (``per_stage``: a list
    beside ``plan.stages``, or None)."""
    first: dict = {}
    for st, value in zip(plan.stages, per_stage or []):
        first.setdefault(st.card.kind, value)
    return list(first.items())


def memory_sources(plan: Plan) -> list[str]:
    """Lines naming where the memory figures come from, per card kind (attention, workspace figures),
    the gradient accumulators and the RNGD compiler cache."""
    s = plan.shape
    out = []
    for k, terms in _first_of_each_kind(plan, plan.memory_terms):
        out.append(f"memory {k}: weights, gradients, optimizer state: exact; activations: a formula "
                   f"({ATTENTION[k]} attention, kernel assumed); workspace: {terms.describe()}")
    out.append("gradients: " + ("fp32 accumulators, 4 B/param" if s.grad_accum == "fp32"
                                else f"{s.dtype} .grad, {s.dtype_bytes} B/param"))
    if plan.model.is_moe:
        out.append(_moe_note(plan.model, s)[2:])
    note = copies_note(plan)
    if note:
        out.append(note)
    if plan.compiler_cache_dir:
        out.append(f"compiler cache (runtime.furiosa.compiler_cache_dir): {plan.compiler_cache_dir}")
    return out


def copies_note(plan: Plan) -> Optional[str]:
    """The plan's line on the stage-boundary copies in copy threads (``runtime.overlap_copies``), or None when
    every card copies in its own thread: what the xfer column then holds, the memory they take, and on RNGD
    the assumption the runtime checks."""
    from npu_train.planner.spec import copies_overlapped

    kinds = sorted({st.card.kind for st in plan.stages if copies_overlapped(plan.shape, st.card.kind)})
    if len(plan.stages) < 2 or not kinds:
        return None
    x = plan.shape.boundary_bytes(plan.model.hidden_size)
    line = (f"boundary copies: in copy threads on {', '.join(kinds)} cards (runtime.overlap_copies), overlapped "
            f"with compute; xfer holds the inputs not there when the card looked ahead; +{2 * x / 2 ** 20:.3g} MiB "
            f"a card (trans: an input fetched ahead, a gradient in flight)")
    if "furiosa" in kinds:
        line += ("; RNGD: assumes furiosa-torch 2026.4's thread-local memory-type flag, probed at setup (if "
                 "process-wide the card copies in its own thread: slower than planned, runtime.overlap_copies=false "
                 "plans that)")
    return line


#: (field, label, unit scale, unit) of the rates the plan prints with their sources
_RATE_ROWS = (("device_flops", "compute", 1e9, "GFLOP/s"), ("head_flops_ratio", "lm_head+loss x", 1.0, ""),
              ("split_backward_ratio", "split backward x", 1.0, ""),
              ("h2d_bytes_per_s", "h2d", 1e9, "GB/s"), ("d2h_bytes_per_s", "d2h", 1e9, "GB/s"),
              ("host_adamw_params_per_s", "host AdamW", 1e6, "M params/s"),
              ("device_adamw_params_per_s", "device AdamW", 1e6, "M params/s"),
              ("process_baseline_bytes", "process baseline", 2 ** 30, "GiB"),
              ("dp_bytes_per_s", "dp all-reduce", 1e9, "GB/s"))


def _other_shapes(kind: str, have: str, plan: Plan) -> Optional[str]:
    """The job's shapes when the profile of ``kind`` was measured on other shapes ``have``, else ``None``."""
    from npu_train.planner.rates import job_shapes, shapes_differ

    bs = (plan.shape.micro_batch, plan.shape.seq_len)
    want = job_shapes(kind, False, plan.model, bs)
    if not shapes_differ(have, want) or not shapes_differ(have, job_shapes(kind, True, plan.model, bs)):
        return None
    return want


def rate_sources(plan: Plan) -> list[str]:
    """One line per card kind: every rate with its source (measured, assumed, scaled, fitted) and the
    profile and shapes behind the measured ones."""
    out = []
    for k, rt in _first_of_each_kind(plan, plan.rates):
        parts = [_rate_text(rt, row) for row in _RATE_ROWS if _rate_shown(row[0], k, plan)]
        out.append(f"rates {k}" + (f" at {rt.threads} thread(s)" if rt.threads else "") + ": "
                   + ", ".join(parts) + f"; {_rates_origin(k, rt, plan)}")
    return out


def _rate_shown(name: str, kind: str, plan: Plan) -> bool:
    if name == "process_baseline_bytes":
        return kind == "cpu"
    if name == "dp_bytes_per_s":
        return plan.dp > 1
    if name == "split_backward_ratio":
        return plan.shape.schedule in SPLIT_BACKWARD and len(plan.stages) >= 2
    return True


def plain_number(x: float) -> str:
    """``x`` to 3 significant digits without an exponent, thousands separated: ``1000`` -> ``"1,000"``,
    ``13456`` -> ``"13,500"``, ``2.345`` -> ``"2.35"`` (``.3g`` printed ``1e+03`` and ``1.35e+04``)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 100:
        digits = 3 - 1 - int(math.floor(math.log10(abs(x))))  # <= 0: round to tens, hundreds, ...
        return f"{int(round(x, digits)):,}"
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"


def _rate_text(rt, row: tuple) -> str:
    """``"<label> <value> <unit> [<source>]"`` of one :data:`_RATE_ROWS` row."""
    name, label, scale, unit = row
    device_adamw = name == "device_adamw_params_per_s"
    v = rt.device_adamw if device_adamw else getattr(rt, name)
    src = rt.source("host_adamw_params_per_s" if device_adamw and not rt.device_adamw_params_per_s else name)
    if unit == "GFLOP/s" and v >= 1e12:
        scale, unit = 1e12, "TFLOP/s"
    return f"{label}{'' if label.endswith('x') else ' '}{plain_number(v / scale)}{' ' + unit if unit else ''} [{src}]"


def _rates_origin(kind: str, rt, plan: Plan) -> str:
    from npu_train.planner.rates import BUSY_SKIPPED

    measured = any(rt.source(n).startswith("measured") for n, *_ in _RATE_ROWS)
    on = f", on {rt.shapes}" if rt.shapes else ""  # the model shapes its figures were timed on
    other = _other_shapes(kind, rt.shapes, plan) if measured else None
    if other:
        on += (f" -- not this job's shapes ({other}): its FLOP/s, head and split-backward figures are "
               "another model's; calibrate=true with this model.path (and placement.profile, if set) "
               "measures them")
    where = (f"measured = calibration profile {rt.origin}{on}" if measured and rt.origin
             else "no calibration profile (calibrate=true measures one)")
    if any(v.startswith("fitted from") for v in rt.sources.values()):
        where += "; fitted = from this job's finished runs ($NPT_CACHE/fitted)"
    if BUSY_SKIPPED in rt.sources:  # every finished run with a speed ran on a busy host
        where += f"; speed not fitted: {rt.sources[BUSY_SKIPPED]}"
    if any("busy run" in v for v in rt.sources.values()):
        where += (f"; busy = run at a load average of {BUSY_LOAD_PER_CORE:g}/core or more, "
                  f"{BUSY_LOAD_PER_CORE - 1:g}/core past the job's own threads where they outnumber the cores "
                  "(hardware.host_busy; planner.fit: its speed is not fitted)")
    return where


def _render(t, width: int) -> str:
    """A rich table as plain text (no colour, no wrapping inside cells)."""
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False,
            highlight=False, emoji=False).print(t)
    return buf.getvalue().rstrip("\n")


#: the widest a plan line may be (a terminal's usual 100 columns): a table wider with two spaces between columns
#: is rendered with one (8 cards and two-digit totals made the memory table 102 columns)
TABLE_COLUMNS = 100


def _table(cols: list[tuple[str, str]], footers: dict, rows: list[list[str]], gap: int = 2):
    """A borderless rich table with right-justified columns after the first two, footers by column name,
    ``gap`` spaces between columns."""
    from rich.table import Table

    t = Table(show_footer=True, box=None, pad_edge=False, padding=(0, gap - 1, 0, 1) if gap > 1 else (0, 1, 0, 0))
    for i, (name, footer) in enumerate(cols):
        t.add_column(name, footer=footers.get(name, footer), justify="left" if i < 2 else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t


def memory_table(plan: Plan, gap: int = 2) -> list:
    """Per card: layers, resident / offloaded layer counts and the predicted memory terms (GiB)."""
    tot_mem = {k: sum(st.mem[k] for st in plan.stages) for k in MEM_KEYS}
    cols = [("card", "total"), ("layers", f"{plan.model.num_layers} layers"), ("res", ""), ("off", "")] + [
        (f"{key}\nGiB", "") for key in ("base", "weights", "grads", "optim", "act", "trans", "ws", "total")] + [
        ("cap\nGiB", ""), ("host\nGiB", "")]
    footers = {"res": str(sum(len(st.resident) for st in plan.stages)),
               "off": str(sum(len(st.offloaded) for st in plan.stages)),
               "cap\nGiB": f"{gib(sum(st.card.capacity_bytes for st in plan.stages)):.2f}",
               "host\nGiB": f"{gib(plan.host_bytes):.2f}"}
    for key, mk in zip(("base", "weights", "grads", "optim", "act", "trans", "ws", "total"), MEM_KEYS):
        footers[f"{key}\nGiB"] = f"{gib(tot_mem[mk]):.2f}"
    rows = []
    for st in plan.stages:
        m = st.mem
        rows.append([st.card.name, st.layers_label, str(len(st.resident)), str(len(st.offloaded))]
                    + [f"{gib(m[k]):.2f}" for k in MEM_KEYS[:-1]]
                    + [f"{gib(m['total']):.2f}" + ("" if st.fits else " !"), f"{gib(st.card.capacity_bytes):.2f}",
                       _host_cell(st)])
    return [_table(cols, footers, rows, gap)]


def _state_on_card(st) -> bool:
    """A card whose memory is the host's (cpu) holding offloaded layers: their state is in its own columns."""
    return st.card.kind in HOST_MEMORY_KINDS and bool(st.offloaded)


def _host_cell(st) -> str:
    """The ``host GiB`` cell: host RAM beyond the card's own memory; on a cpu card with offloaded layers their
    state in parentheses, the same memory as its ``optim`` and ``total`` (:func:`host_legend`)."""
    if _state_on_card(st):
        return f"({gib(st.offloaded_state_bytes):.2f})"
    return f"{gib(st.host_bytes):.2f}"


def host_legend(plan: Plan) -> Optional[str]:
    """The line under the tables when a cpu card holds offloaded layers (its memory is the host's: the
    ``host GiB`` column would otherwise say 0.00 while its ``optim`` and ``total`` rise); None otherwise."""
    on_card = [st for st in plan.stages if _state_on_card(st)]
    if not on_card:
        return None
    extra = (" (fp32: +4 B/param for a master of its own)"
             if plan.shape.dtype_bytes == 4 else "")
    return ("host GiB (x.xx): on a cpu card, whose memory is the host's, the offloaded fp32 masters + AdamW "
            "moments, already in its optim and total (not in the host total); offloading there frees no "
            f"memory{extra} and adds host AdamW time (train.resident_layers=auto keeps them resident)")


def time_unit(step_s: float) -> tuple[str, float, int]:
    """``(unit, scale, decimals)`` of the time table for a step of ``step_s`` seconds: seconds with two decimals
    from 0.1 s, else milliseconds with the step to three significant digits (a tiny model's table read 0.00 and
    0.02 s throughout)."""
    if step_s >= 0.1 or step_s <= 0:
        return "s", 1.0, 2
    ms = step_s * 1e3
    return "ms", 1e3, 1 if ms >= 10 else 2 if ms >= 1 else 3


def time_table(plan: Plan, gap: int = 2) -> list:
    """Per card: the predicted seconds per step (compute and the part of it that recomputes forwards, bubble, host
    and device optimizer, card<->host transfers: the offloaded layers' and the stage-boundary copies, data-parallel
    communication, the stage's total); milliseconds for a step under 0.1 s (:func:`time_unit`)."""
    unit, scale, d = time_unit(plan.step_time_s)
    cols = [("card", "step"), ("layers", "")] + [(f"{k}\n{unit}", "") for k in (
        "compute", "recomp", "bubble", "host-opt", "hidden", "dev-opt", "xfer", "dp-comm", "stage")]
    keys = ("compute", "recompute", "bubble", "host_optimizer", "host_hidden", "device_optimizer", "transfer",
            "dp_comm", "total")
    shown = [{**st.time, "transfer": st.time.get("transfer", 0.0) + st.time.get("boundary", 0.0)}
             for st in plan.stages]  # the xfer column: offload transfers + boundary copies
    rows = [[st.card.name, st.layers_label] + [f"{max(0.0, tm.get(k, 0.0)) * scale:.{d}f}" for k in keys]
            for st, tm in zip(plan.stages, shown)]
    return [_table(cols, {f"stage\n{unit}": f"{plan.step_time_s * scale:.{d}f}"}, rows, gap)]


def _wrap(line: str, width: int) -> str:
    """A long prose line folded at ``width`` columns, continuation lines indented by two spaces."""
    from npu_train.errors import wrap_words  # never between a number and its unit

    return "\n".join(wrap_words(line, width)) or line


def _columns_of(t, keep: list[int]):
    """A copy of the rich table ``t`` (:func:`_table`) with only its columns ``keep``."""
    from rich.table import Table

    sub = Table(show_footer=t.show_footer, box=None, pad_edge=t.pad_edge, padding=t.padding)
    for i in keep:
        c = t.columns[i]
        sub.add_column(c.header, footer=c.footer, justify=c.justify, no_wrap=c.no_wrap)
    for r in range(t.row_count):
        sub.add_row(*[t.columns[i]._cells[r] for i in keep])
    return sub


def split_columns(t, width: int, keys: int = 2) -> str:
    """The rich table ``t`` (:func:`_table`) as plain text; wider than ``width`` columns, as blocks of its columns
    one under the other, each starting with the first ``keys`` columns (card, layers) and adding columns while
    the block fits (a column wider than that on its own still gets a block). An 80-column terminal had each
    96-column row folded at words onto a second line (issue 40)."""
    text = _render(t, 200)
    n = len(t.columns)
    if max(len(ln) for ln in text.splitlines()) <= width or n <= keys + 1:
        return text
    blocks, cur = [], []
    for i in range(keys, n):
        wide = max(len(ln) for ln in _render(_columns_of(t, [*range(keys), *cur, i]), 200).splitlines())
        if cur and wide > width:
            blocks.append(cur)
            cur = []
        cur.append(i)
    blocks.append(cur)
    return "\n".join(_render(_columns_of(t, [*range(keys), *b]), 200) for b in blocks)


def tables_text(plan: Plan, width: int = 0) -> str:
    """The memory and time tables as text: two spaces between columns, one where that is wider than
    :data:`TABLE_COLUMNS` or ``width``; ``width`` > 0 (the console) splits a table still wider into blocks of
    columns (:func:`split_columns`)."""
    limit = min(width, TABLE_COLUMNS) if width > 0 else TABLE_COLUMNS
    tables = "\n".join(_render(t, 200) for t in memory_table(plan) + time_table(plan))
    gap = 2 if max(len(ln) for ln in tables.splitlines()) <= limit else 1
    if gap == 1:
        tables = "\n".join(_render(t, 200) for t in memory_table(plan, gap=1) + time_table(plan, gap=1))
    if width > 0:
        tables = "\n".join(split_columns(t, width) for t in memory_table(plan, gap=gap) + time_table(plan, gap=gap))
    return tables


def plan_table(plan: Plan, width: int = 0) -> str:
    """Header (threads, cores, headroom), the per-card memory table (GiB) and time table (seconds) with
    totals, the rate and memory sources, the schedule line and the prediction. ``width`` > 0 folds the prose
    lines at that many columns and splits a table wider into blocks of columns (:func:`split_columns`; the
    console); 0 keeps one line each (``plan.txt``, grep)."""
    tables = tables_text(plan, width)
    cores = (f", {plan.host_cores} usable host core(s)" if plan.host_cores else
             " (a dry run for another machine: runtime.threads=<its cores per card> plans its host terms)")
    lines = [f"threads: {plan.threads} torch thread(s) per card process{cores}; headroom {plan.headroom * 100:g}% "
             f"of capacity kept free by auto (placement.headroom)"]
    n_cpu = plan.dp * sum(1 for st in plan.stages if st.card.kind == "cpu")
    if n_cpu and n_cpu * plan.threads > plan.host_cores:
        lines.append(f"oversubscribed: {n_cpu} cpu card process(es) x {plan.threads} thread(s) on {plan.host_cores} "
                     f"core(s): the measured rates are stretched by the cost model (pipeline slots where more "
                     f"threads compute than there are cores; optimizers at {plan.host_cores}/"
                     f"{n_cpu * plan.threads} of their rate)")
    if plan.dp > 1:
        lines.append(f"parallel: dp={plan.dp} x pp={len(plan.stages)} ({plan.dp * len(plan.stages)} cards), "
                     + ("ZeRO-1 (each card holds 1/dp of its stage's optimizer state)" if plan.zero
                        else "no ZeRO (every replica holds its stages' whole optimizer state)")
                     + f"; one replica shown, every replica's cards alike; host GiB all replicas "
                     f"{gib(plan.host_bytes_all):.2f}")
    lines.append(tables)
    legend = host_legend(plan)
    if legend:
        lines.append(legend)
    lines += rate_sources(plan)
    lines += memory_sources(plan)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    over = [st.card.name for st in plan.stages if not st.fits]
    if over:
        verdict += f" (over capacity: {', '.join(over)})"
    if plan.host_ram_bytes is not None and plan.host_bytes > plan.host_ram_bytes:
        verdict += (f" (host RAM {gib(plan.host_bytes):.2f} GiB needed > "
                    f"{gib(plan.host_ram_bytes):.2f} GiB)")
    lines.append(schedule_line(plan))
    lines += offload_lines(plan)
    lines.append(
        f"predicted: step {duration(plan.step_time_s)}, {plan.tokens_per_step:,} tokens/step"
        + (f" ({plan.dp} replicas)" if plan.dp > 1 else "") + ", "
        f"{plan.tokens_per_s:,.0f} tokens/s (all positions); {verdict}"
    )
    bound = bound_line(plan)
    if bound:
        lines.append(bound)
    return "\n".join(line if line is tables or width <= 0 else _wrap(line, width) for line in lines)


#: the share of the step from which :func:`bound_line` names a term without "the largest term"
BOUND_SHARE = 0.5

#: per term of the slowest stage's time: what it is called and the settings that change it
_BOUND_TERMS = (
    ("compute", "compute", ("more cards (backend=)", "a faster card kind", "train.recompute=false where set")),
    ("boundary", "the stage-boundary copies card<->host", ("fewer pipeline stages (parallel.dp)",
                                                           "a measured h2d/d2h rate (calibrate=true)")),
    ("bubble", "the pipeline bubble", ("more micro-batches (train.accum)", "a zero-bubble schedule "
                                       "(train.schedule=zb-h2)", "fewer pipeline stages")),
    ("host_optimizer", "host AdamW of offloaded layers", (
        "train.accum (more tokens per update)", "train.resident_layers (fewer offloaded layers)",
        "train.offload_update=delayed (the update runs during the next step)",
        "runtime.threads (host threads per card, up to the host memory bandwidth)",
        "a measured host rate (calibrate=true)")),
    ("device_optimizer", "AdamW on the card", ("train.accum (more tokens per update)",)),
    ("transfer", "host<->device transfers", ("train.resident_layers (fewer offloaded layers to upload)",
                                             "train.accum (more tokens per upload)")),
    ("dp_comm", "the data-parallel gradient exchange", ("train.accum (more tokens per exchange)",
                                                        "fewer replicas (parallel.dp)")),
)


#: the bubble's levers when the mixture-of-experts load-balancing loss is on (1f1b or gpipe only)
_AUX_BUBBLE_LEVERS = ("more micro-batches (train.accum), fewer pipeline stages; a zero-bubble schedule "
                      "(train.schedule=zb-h2) only with train.moe_aux_loss=0 (the load-balancing loss runs with "
                      "1f1b and gpipe)",)


def _levers_not_chosen(levers: tuple, plan: Plan) -> str:
    """``levers`` joined, less the settings the plan already has (advice never names what is chosen): the
    zero-bubble schedule on a ``zb-h2`` or ``zbv`` plan (the schedules with the least bubble),
    ``train.offload_update=delayed`` on a delayed plan, ``train.recompute=false`` where no card recomputes a whole
    layer (``train.recompute`` off, the attention core alone recomputed, or its ``recompute`` seconds 0 on every
    card)."""
    s = plan.shape
    chosen = {"train.schedule=zb-h2": s.schedule in ("zb-h2", "zbv"),
              "train.offload_update=delayed": s.offload == "delayed",
              "train.recompute=false": not s.recompute or not any(st.time.get("recompute", 0.0) > 0
                                                                     for st in plan.stages)}
    return ", ".join(lv for lv in levers if not any(on and key in lv for key, on in chosen.items()))


def bound_line(plan: Plan) -> Optional[str]:
    """``"bound: host AdamW of offloaded layers 13.5 of 16.0 s on furiosa:0 (84 %); it changes with ..."``: the
    largest term of the slowest stage's step time, with the settings that change it; when it takes less than
    :data:`BOUND_SHARE` of the step, ``(43 %, the largest term)``. Host AdamW counts only what the pipeline does
    not hide. None for a plan without stages or step time."""
    if not plan.stages or plan.step_time_s <= 0:
        return None
    st = max(plan.stages, key=lambda s: s.time["total"])
    tm = dict(st.time)
    tm["host_optimizer"] = max(0.0, tm.get("host_optimizer", 0.0) - tm.get("host_hidden", 0.0))
    key, name, levers = max(_BOUND_TERMS, key=lambda t: tm.get(t[0], 0.0))
    if key == "bubble" and plan.shape.moe_aux_loss:  # zb-h2 would be refused (pipeline/moeaux.py)
        levers = _AUX_BUBBLE_LEVERS
    levers = _levers_not_chosen(levers, plan)
    total = st.time["total"]
    if total <= 0 or tm.get(key, 0.0) <= 0:
        return None
    share = tm[key] / total
    tail = "" if share >= BOUND_SHARE else ", the largest term"
    unit, scale = ("s", 1.0) if total >= 0.1 else ("ms", 1e3)  # a tiny model's step: milliseconds
    return (f"bound: {name} {tm[key] * scale:.3g} of {total * scale:.3g} {unit} a step on {st.card.name} "
            f"({100 * share:.0f} %{tail}); "
            f"it changes with {levers}")


def plan_summary(plan: Plan) -> str:
    """The plan in one line (a sweep job's console): ``"split [19, 11], resident 19/11, 2.39/1.57 GiB per card,
    step 11.19 s, fits"``."""
    mem = "/".join(f"{gib(st.mem['total']):.2f}" for st in plan.stages)
    return (f"split {plan.split}, resident {'/'.join(str(len(st.resident)) for st in plan.stages)}, {mem} GiB per "
            f"card, step {duration(plan.step_time_s)}, {'fits' if plan.fits else 'DOES NOT FIT'}")


def schedule_line(plan: Plan) -> str:
    """The schedule's pipeline phase (s) and bubble share next to the same schedule's bubble with equal
    unit times (:func:`npu_train.pipeline.schedule.bubble_fraction`) and the micro-batches held per card."""
    s, P = plan.shape, len(plan.stages)
    tm0 = plan.stages[0].time
    phase = tm0["compute"] + tm0.get("boundary", 0.0) + tm0["bubble"]
    idle = max(0.0, sum(st.time["bubble"] for st in plan.stages) / (P * phase)) if phase > 0 else 0.0
    unit = bubble_fraction(s.schedule, P, s.micro_batches)
    held = "/".join(str(st.in_flight) for st in plan.stages)
    line = (f"schedule {s.schedule}: pipeline phase {duration(phase)}, bubble {idle * 100:.1f} % of it "
            f"(equal unit F/B/W times: {unit * 100:.1f} %); micro-batches held per card {held}")
    if s.vocab_parallel:
        per = "/".join(f"{st.time.get('vocab', 0.0):.2f}" for st in plan.stages)
        line += (f"; vocabulary-parallel output layer (parallel.vocab): each card's share of the head + the exchange "
                 f"{per} s a step")
        if getattr(s, "vocab_exchange", "gloo") == "shm":
            from npu_train.planner.rates import VOCAB_SHM_SUM_BYTES_PER_S, VOCAB_SHM_X_BYTES_PER_S

            line += (f"; exchange through shared memory (runtime.vocab_exchange=shm) where every card is on one "
                     f"host, else gloo: hidden state {VOCAB_SHM_X_BYTES_PER_S / 1e9:.2f} GB/s, gradient sum "
                     f"{VOCAB_SHM_SUM_BYTES_PER_S / 1e9:.2f} GB/s x 2/P (measured on a 2-core VM)")
    if plan.search_capped_at:
        line += "; " + capped_note(plan)
    if s.recompute_fewest and not any(st.recompute_layers for st in plan.stages):
        what = (["the cpu cards return freed memory"] if any(st.card.kind == "cpu" for st in plan.stages) else []
                ) + (["attention cores recomputed"] if s.recompute_attention else [])
        line += ("; no layer recomputed whole (train.recompute=true, train.recompute_layers=fewest"
                 + (": " + ", ".join(what) if what else "") + ")")
    elif s.recompute_fewest:
        line += (f"; layers recomputed whole per card {plan.recompute_counts_label} (train.recompute_layers=fewest: the fewest that fit;"
                 " the others keep their activations" + (", attention core recomputed" if s.recompute_attention
                                                          else "") + ")")
    return line


def capped_note(plan: Plan) -> str:
    """What a split search stopped at its cap (``Plan.search_capped_at``) chose: the best split of the timelines it
    evaluated, not proven fastest; with two chunks per card (ZB-V, interleaved) why (the search's phase bounds see
    one micro-batch's path through the cards, not how its actions wait behind the other micro-batches' on the
    same card, so at ``M < P`` thousands of splits stay within a few % of each other); ``""`` when not capped."""
    if not plan.search_capped_at:
        return ""
    from npu_train.pipeline.schedule import CHUNKED_SCHEDULES

    why = (" (two chunks per card: the bounds leave many splits within a few % of it)"
           if plan.shape.schedule in CHUNKED_SCHEDULES else "")
    return (f"split {plan.split}: the best of {plan.search_capped_at:,} timelines searched, not proven fastest"
            f"{why}; train.split=[...] sets one")


def offload_lines(plan: Plan) -> list[str]:
    """What the host update of offloaded layers does in this plan (``RunShape.offload``)."""
    mode = plan.shape.offload
    if not any(st.offloaded for st in plan.stages):
        return ([f"train.offload_update=delayed has no effect: every layer is resident (no host update to "
                 "delay)"] if mode == "delayed" else [])
    how = {"serial": "runs between the backward and the next forward (train.offload_overlap=false)",
           "overlap": "overlaps the next forward, layer by layer (train.offload_overlap=true)",
           "delayed": "runs during the next step, one step stale (train.offload_update=delayed)"}.get(mode, mode)
    return [f"offloaded layers: the host update (host AdamW + upload of the new weights) {how}; 'hidden s' = its seconds "
            "hidden behind the pipeline, upload included, so it can exceed 'host-opt s'"]


def _moe_note(m, s) -> str:
    """``"; mixture of experts: ..."`` for a model with experts: sparse layers, experts, top-k, the largest
    layer's active parameters (what the compute counts; memory counts all) and, with LoRA, the adapters per
    layer (every expert's / those a token passes through); ``""`` for a dense model."""
    if not m.is_moe:
        return ""
    note = (f"; mixture of experts: {len(m.moe_layers())} sparse layers x {m.num_experts} experts, top-"
            f"{m.num_experts_per_tok}; memory counts all {m.params_per_layer():,} params per layer, compute the "
            f"{m.active_params_per_layer():,} active; routed activations bounded by top-k x tokens")
    if s.lora_params_per_layer:
        note += f"; LoRA {s.lora_params_per_layer:,} adapter params per layer ({s.active_adapter_params:,} active)"
    return note


def format_plan(plan: Plan, width: int = 0) -> str:
    """Dry-run report: model and run shape, the per-card table, the model's assumptions."""
    m, s = plan.model, plan.shape
    head = [
        f"model {m.name}: {m.total_params():,} params ({m.num_layers} layers x "
        f"{m.params_per_layer():,} + embedding {m.embedding_params():,}"
        f"{' tied' if m.tie_word_embeddings else ' x2 (untied)'})" + _moe_note(m, s),
        f"run: seq_len {s.seq_len}, micro_batch {s.micro_batch}, micro_batches {s.micro_batches}, "
        f"schedule {s.schedule}, dtype {s.dtype}, recompute {'on' if s.recompute else 'off'}; "
        + (f"dp {plan.dp} x pp {len(plan.stages)}{' ZeRO-1' if plan.zero else ''}; " if plan.dp > 1 else "")
        + f"split {plan.split}, resident {plan.resident_counts}; {plan.threads} thread(s) per card "
        f"process on {plan.host_cores} core(s)",
        "",
        plan_table(plan, width=width),
        "",
        "assumptions: weights in compute dtype; resident params +12 B/param (fp32 master "
        "+ AdamW m, v; on cpu cards all params); offloaded: host AdamW + card<->host copies each "
        f"step, host AdamW + upload {s.offload} (hidden: the part overlapped with the pipeline); activations "
        + ", ".join(f"{k} {gb(activation_bytes_per_layer(m, s, ATTENTION[k])) * 1e3:.1f}"
                    for k in sorted({st.card.kind for st in plan.stages}))
        + " MB/layer/micro-batch (no recompute); transient = peak-phase temporaries; "
        "base = process baseline (cpu: RSS).",
    ]

    seen = set()
    for st, rt in zip(plan.stages, plan.rates or []):
        if st.card.kind in seen:
            continue
        seen.add(st.card.kind)
        head.append(
            f"rates {st.card.kind}: {plain_number(rt.device_flops / 1e12)} TFLOP/s, h2d "
            f"{rt.h2d_bytes_per_s / 1e9:.1f} GB/s, d2h {rt.d2h_bytes_per_s / 1e9:.1f} GB/s, "
            f"host AdamW {plain_number(rt.host_adamw_params_per_s / 1e6)} M params/s, device AdamW "
            f"{plain_number(rt.device_adamw / 1e6)} M params/s"
            + (f", baseline {gib(rt.process_baseline_bytes):.2f} GiB"
               if rt.process_baseline_bytes else "")
            + (f", at {rt.threads} thread(s)" if rt.threads else "")
        )
    return "\n".join(head)
