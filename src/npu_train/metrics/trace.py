"""Per-action pipeline timeline (``runtime.trace=true``): :class:`TraceWriter` writes ``trace.json`` as Chrome
trace events (open in Perfetto), one track per card; :func:`summarize` gives the end-of-run table. Input:
:attr:`npu_train.pipeline.stage.StageRunner.trace` tuples (``perf_counter`` s, comparable within a host).
"""
from __future__ import annotations

import json
from typing import Optional

#: phase names a card appends after its schedule's actions (runtime.trainer.StageTrainer.train_step)
PHASES = ("tied", "collectives", "optimizer")
#: the action kind of work the first stage moved out of the pipeline's fill, after its first forward:
#: the rest of the previous step's rows-first embedding update (npu_train.optim.rowsfirst) and the
#: embedding's zeroed gradient buffer; counted as optimizer time
DEFERRED = "U"


def step_events(step: int, actions_by_rank: list, base: float) -> list[dict]:
    """Chrome ``"X"`` events (µs from ``base`` s) of 1-based ``step``: per action a ``wait``, the action (``F3``,
    ``B3``, ``W3``, ``E``, ``U``, a phase) and a ``send`` event; ``tid`` = rank."""
    ev = []
    for rank, acts in enumerate(actions_by_rank):
        for kind, micro, t0, t1, t2, t3 in acts or ():
            name = f"{kind}{micro}" if micro >= 0 else kind
            cat = "phase" if kind in PHASES else "compute"
            parts = ((f"wait {name}", "wait", t0, t1), (name, cat, t1, t2), (f"send {name}", "send", t2, t3))
            for label, c, a, b in parts:
                if b > a or c == cat:  # the action itself always, its wait and send when not empty
                    ev.append({"name": label, "cat": c, "ph": "X", "pid": 1, "tid": rank, "args": {"step": step},
                               "ts": round((a - base) * 1e6, 1), "dur": round((b - a) * 1e6, 1)})
    return ev


def summarize(steps: list[list]) -> list[dict]:
    """Per rank, seconds per step over ``steps``: ``step_s``, ``compute_s``, ``start_wait_s`` (the fill),
    ``inner_wait_s``, ``collectives_s``, ``end_wait_s``, ``optimizer_s`` and ``idle_share``."""
    if not steps:
        return []
    n_rank = len(steps[0])
    acc = [dict(step_s=0.0, compute_s=0.0, start_wait_s=0.0, inner_wait_s=0.0, collectives_s=0.0, end_wait_s=0.0,
                optimizer_s=0.0) for _ in range(n_rank)]
    for per_rank in steps:
        t_begin = min(a[0][2] for a in per_rank if a)
        t_finish = max(a[-1][5] for a in per_rank if a)
        for rank, acts in enumerate(per_rank):
            s = acc[rank]
            s["step_s"] += t_finish - t_begin
            sched = [a for a in acts if a[0] not in PHASES and a[0] != DEFERRED]
            ph = {a[0]: a for a in acts if a[0] in PHASES}
            s["optimizer_s"] += sum(a[5] - a[3] for a in acts if a[0] == DEFERRED)
            if sched:
                s["start_wait_s"] += sched[0][3] - t_begin
                s["inner_wait_s"] += sum(a[3] - a[2] for a in sched[1:])
                s["compute_s"] += sum(a[5] - a[3] for a in sched)
            if "collectives" in ph:  # the tied exchange lies inside it
                s["collectives_s"] += ph["collectives"][5] - ph["collectives"][3]
            if "optimizer" in ph:
                s["optimizer_s"] += ph["optimizer"][5] - ph["optimizer"][3]
                s["end_wait_s"] += t_finish - ph["optimizer"][5]
    out = []
    for s in acc:
        r = {k: v / len(steps) for k, v in s.items()}
        r["idle_share"] = max(0.0, 1.0 - (r["compute_s"] + r["optimizer_s"]) / r["step_s"]) if r["step_s"] > 0 else 0.0
        out.append(r)
    return out


def format_summary(rows: list[dict], first_step: int, last_step: int, labels: Optional[list] = None) -> str:
    """The :func:`summarize` table as text (``labels``: first column, default the row index)."""
    head = (f"trace: where each card's step goes (mean of steps {first_step}-{last_step}, s/step; start wait = "
            "pipeline fill and anything before the first action, collectives = tied exchange + all-reduces "
            "including the wait for the slowest card; idle = all but compute and optimizer)")
    lines = [head, f"  {'rank':>4} {'step':>7} {'compute':>8} {'optim':>7} {'start wait':>10} "
                   f"{'inner wait':>10} {'collectives':>11} {'end wait':>8} {'idle':>6}"]
    for i, r in enumerate(rows):
        rank = labels[i] if labels else i
        lines.append(f"  {rank:>4} {r['step_s']:7.3f} {r['compute_s']:8.3f} {r['optimizer_s']:7.3f} "
                     f"{r['start_wait_s']:10.3f} {r['inner_wait_s']:10.3f} {r['collectives_s']:11.3f} "
                     f"{r['end_wait_s']:8.3f} {100 * r['idle_share']:5.1f}%")
    return "\n".join(lines)


class TraceWriter:
    """Writes ``trace.json`` at ``path`` line by line as steps arrive; ``ranks``: each track's global rank."""

    def __init__(self, path: str, ranks: Optional[list[int]] = None):
        self.path = path
        self.f = open(path, "w")
        self.f.write("[")
        self._n = 0
        self.base: Optional[float] = None
        self.ranks = list(ranks or [])
        self.steps: list[tuple[int, list]] = []
        for tid, rank in enumerate(self.ranks):
            self._write({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": f"rank {rank}"}})

    def _write(self, ev: dict) -> None:
        self.f.write((",\n" if self._n else "\n") + json.dumps(ev))
        self._n += 1

    def step(self, step: int, actions_by_rank: list) -> None:
        """Append one step's events (``actions_by_rank`` as in :func:`step_events`)."""
        if self.base is None:
            self.base = min(a[0][2] for a in actions_by_rank if a)
        for ev in step_events(step, actions_by_rank, self.base):
            self._write(ev)
        self.f.flush()
        self.steps.append((step, actions_by_rank))

    def summary(self) -> Optional[str]:
        """:func:`format_summary` over the steps after the first (step 1 includes start-up), or None."""
        use = self.steps[1:] if len(self.steps) > 1 else self.steps
        if not use:
            return None
        return format_summary(summarize([a for _, a in use]), use[0][0], use[-1][0], self.ranks or None)

    def close(self) -> None:
        if not self.f.closed:
            self.f.write("\n]\n")
            self.f.close()
