"""Figures fitted from the job's own finished runs (``plan.json`` + ``metrics.jsonl``): per card kind a
training FLOP/s, an AdamW rate and a cpu process baseline (:func:`run_figures`), kept in
``$NPT_CACHE/fitted/`` (:func:`record_run`) and combined by :func:`fitted_figures`; start at :func:`refit_from_run`.
A run on a busy host (:func:`run_load`) is recorded with its load but its speed is not fitted."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Optional, Sequence

from npu_train.env import cache_dir
from npu_train.hardware import host_busy

__all__ = ["RunFigures", "Fitted", "KEEP_RUNS", "run_figures", "fitted_path", "record_run", "read_runs",
           "fitted_figures", "refit_from_run", "shape_key", "work_seconds", "run_load", "own_threads"]

#: runs a fitted figure is taken over (the newest ones)
KEEP_RUNS = 8
#: the head card's fitted plan is its measured peak / HEAD_FIT (a margin under 1.0 for the next run's spread)
HEAD_FIT = 0.95
FORMAT_VERSION = 1
#: model shapes (:func:`shape_key`) a kind's file keeps runs of (the newest runs' shapes)
MAX_SHAPES = 8


@dataclass
class RunFigures:
    """What one run measured for one card kind (``None``: not measurable in that run)."""

    kind: str
    threads: int
    dtype: str
    model: str
    steps: int
    #: :func:`shape_key` of the run (model and micro-batch tokens); only runs of the same key are combined
    model_shape: str = ""
    #: the plan's FLOPs per step of a stage / its measured compute seconds, median over stages and steady steps
    #: (cpu cards: the compute's CPU seconds where the cards reported them, :func:`work_seconds`)
    device_flops: Optional[float] = None
    #: the plan's optimizer params per step / measured optimizer seconds of the slowest card, before the cpu
    #: core share (CostModel multiplies by it)
    adamw_params_per_s: Optional[float] = None
    #: cpu: the baseline under which every stage's plan would have covered its measured peak, >= 0 (the last
    #: stage, which holds the head, apart when there are several: :attr:`head_baseline_bytes`). Below the
    #: plan's own baseline it says the other terms over-counted; ``rates.apply_fitted`` applies it only where
    #: it is larger than the unfitted baseline
    process_baseline_bytes: Optional[float] = None
    #: cpu: the baseline under which the last stage (the head) would have planned its measured peak /
    #: :data:`HEAD_FIT` (>= 0; applied, like the other, only above the unfitted baseline). One figure for every
    #: card raised the head card's plan by another card's shortfall: a 0.63 B run's head card then planned
    #: 10.57 GiB against an 8.61 GiB peak (0.81)
    head_baseline_bytes: Optional[float] = None
    run_dir: str = ""
    time: float = 0.0
    #: what the timing figures were measured with: "cpu" (the cards' CPU seconds of their compute,
    #: :func:`work_seconds`) or "wall" (older runs, accelerators); :func:`fitted_figures` prefers "cpu" runs
    clock: str = "wall"
    #: the host's 1-minute load average over the run (median of the steady steps' ``host_load`` samples) and
    #: its cores; None: not sampled (this OS keeps no load average, or an entry from before the samples)
    load_avg: Optional[float] = None
    host_cores: Optional[int] = None
    #: :func:`~npu_train.hardware.host_busy` of that load against the job's own threads: True keeps the run's
    #: FLOP/s and AdamW rate out of :func:`fitted_figures` (they hold the other work's time slices and its
    #: contention for caches and memory bandwidth); None (not known, older entries) counts as not busy, as those
    #: entries always did: dropping them would send every plan after the upgrade back to assumed figures
    busy: Optional[bool] = None


@dataclass
class Fitted:
    """Figures over the newest :data:`KEEP_RUNS` runs (median FLOP/s and AdamW, maximum baseline) and
    how many runs each comes from."""

    device_flops: Optional[float] = None
    flops_runs: int = 0
    adamw_params_per_s: Optional[float] = None
    adamw_runs: int = 0
    process_baseline_bytes: Optional[float] = None
    baseline_runs: int = 0
    head_baseline_bytes: Optional[float] = None  # maximum over the runs
    head_runs: int = 0
    #: runs on a busy host (``busy`` True) whose timing figures were left out
    busy_runs: int = 0


def shape_key(model, tokens_per_micro_batch: int) -> str:
    """What fitted figures are kept per: the model's layer and vocabulary shape and the tokens of a micro-batch
    (``"h576-i1536-L30-a9/3-d64-v49152-t256"``): FLOP/s and optimizer rates measured on another model or
    micro-batch (a tiny test model, a smoke run at S=32) say little about this one. ``model``: a LlamaConfig."""
    return (f"h{model.hidden_size}-i{model.intermediate_size}-L{model.num_layers}-a{model.num_heads}/"
            f"{model.num_kv_heads}-d{model.head_dim}-v{model.vocab_size}-t{int(tokens_per_micro_batch)}")


def _kind(card: str) -> str:
    return str(card).split(":", 1)[0]


def _launch_records(plan_doc: dict, records: Sequence[dict]) -> list[dict]:
    want = float(plan_doc["step_time_s"])
    return [r for r in records if not r.get("skipped") and "step_s_pred" in r
            and math.isclose(float(r["step_s_pred"]), want, rel_tol=1e-9)]


def _cpu_share(plan_doc: dict) -> float:
    """min(1, cores / (cpu cards x threads)), as :class:`~npu_train.planner.cost.CostModel` gives it."""
    n_cpu = int(plan_doc.get("dp", 1)) * sum(1 for st in plan_doc["stages"] if _kind(st["card"]) == "cpu")
    threads, cores = max(1, int(plan_doc["threads"])), max(1, int(plan_doc["host_cores"]))
    return min(1.0, cores / (n_cpu * threads)) if n_cpu else 1.0


def work_seconds(wall: float, cpu: Optional[float], share: float) -> float:
    """A cpu card's compute seconds as an unloaded host would have taken them: ``min(wall, cpu / share)``.
    ``cpu``: the CPU seconds of the same intervals of the thread that ran them (``compute_cpu_s``,
    :func:`~npu_train.pipeline.stage.work_clock`: at several torch threads, with passive OpenMP waits, its serial
    part and its share of the parallel regions, so it is not divided by the threads; None or <= 0: not
    measured, ``wall`` as it is); ``share``: the core share the plan gives each cpu card (:func:`_cpu_share`;
    below 1 the job's own cards wait for each other's cores, which an unloaded host has too). On a host loaded
    by other processes the wall clock holds their time slices as well; fitted from it, the next plan would take
    the load for the card's speed (a fitted ~/.cache of loaded runs planned 31.25 s a step against 12-23 s
    measured). The process's CPU time over the threads (before) counted spinning threads as work: at 2 threads
    on a loaded host it fitted 47 GFLOP/s where one thread fits about 90."""
    if cpu is None or not cpu > 0:
        return wall
    return min(wall, cpu / min(1.0, share))


def _optimizer_params(st: dict, rt) -> Optional[float]:
    """Params per step behind a stage's planned optimizer seconds when its measured optimizer seconds
    are AdamW at one rate (cpu cards, or host updates only, never hidden by the overlap); else ``None``."""
    t = st["time"]
    if t.get("host_hidden", 0.0) > 0:
        return None
    dev, host = float(t.get("device_optimizer", 0.0)), float(t.get("host_optimizer", 0.0))
    if _kind(st["card"]) == "cpu" and not rt.device_adamw_params_per_s:
        return dev * rt.device_adamw + host * rt.host_adamw_params_per_s
    if dev == 0.0 and host > 0:
        return host * rt.host_adamw_params_per_s
    return None


def _timing(plan_doc: dict, steady: Sequence[dict], rates: Sequence) -> tuple[dict, dict, str]:
    """``(FLOP/s per kind, AdamW params/s per kind, clock)`` of the steady steps' records: lists of per-card,
    per-step figures; ``clock`` "cpu" where the cards' compute CPU seconds were used (:func:`work_seconds`)."""
    stages, P = plan_doc["stages"], len(plan_doc["stages"])
    share = _cpu_share(plan_doc)
    flops: dict = {}
    adamw: dict = {}
    clock = "wall"
    for rec in steady:
        cards = rec.get("compute_s_cards") or []
        cpus = rec.get("compute_cpu_s_cards") or []
        # per card, the share of its compute's wall time that was its own work (1: an unloaded host)
        busy = [1.0] * len(cards)
        for rank, sec in enumerate(cards):
            i = rank % P
            st, rt = stages[i], rates[i]
            cpu = cpus[rank] if rank < len(cpus) and _kind(st["card"]) == "cpu" else None
            if sec > 0 and isinstance(cpu, (int, float)) and cpu > 0:
                work = work_seconds(sec, cpu, share)
                busy[rank], sec, clock = work / sec, work, "cpu"
            if sec > 0 and st["time"]["compute"] > 0:
                flops.setdefault(_kind(st["card"]), []).append(st["time"]["compute"] * rt.device_flops / sec)
        slow = cards.index(rec["compute_s"]) if rec.get("compute_s") in cards else None
        if slow is not None and rec.get("optimizer_s", 0) > 0:
            st, rt = stages[slow % P], rates[slow % P]
            params = _optimizer_params(st, rt)
            if params:
                shared = share if _kind(st["card"]) == "cpu" else 1.0
                # the optimizer phase ran on the same loaded host: its seconds scaled like the compute's
                adamw.setdefault(_kind(st["card"]), []).append(params / (rec["optimizer_s"] * busy[slow]) / shared)
    return flops, adamw, clock


def _baselines(plan_doc: dict, recs: Sequence[dict]) -> tuple[dict, dict]:
    """``(process baseline per kind, head card's baseline per kind)`` (cpu cards) from the records' peaks."""
    stages, P = plan_doc["stages"], len(plan_doc["stages"])
    base: dict = {}
    head: dict = {}
    for rec in recs:
        run_peaks = rec.get("mem_run_peak_bytes") or []  # every phase so far: the model load's included
        for rank, peak in enumerate(rec.get("mem_peak_bytes") or []):
            st = stages[rank % P]
            if _kind(st["card"]) == "cpu":
                # the baseline the plan's other terms leave for the peak; >= 0: an over-count elsewhere (the
                # peak under the plan) is no process memory (apply_fitted only raises the unfitted baseline)
                k, need = _kind(st["card"]), max(0.0, st["mem"]["baseline"] + int(peak) - st["mem"]["total"])
                if rank % P == P - 1:  # the head's own figure (with one stage, the general one too)
                    top = max(int(peak), int(run_peaks[rank]) if rank < len(run_peaks) else 0)
                    h = max(0.0, st["mem"]["baseline"] + top / HEAD_FIT - st["mem"]["total"])
                    head[k] = max(head.get(k, h), h)
                if rank % P != P - 1 or P == 1:
                    base[k] = max(base.get(k, need), need)
    return base, head


def own_threads(plan_doc: dict) -> int:
    """Runnable threads the job of ``plan_doc`` keeps busy itself: ``threads`` per cpu card, one per other card
    process (its host side), times the replicas (``dp``)."""
    threads = max(1, int(plan_doc.get("threads", 1)))
    per = sum(threads if _kind(st["card"]) == "cpu" else 1 for st in plan_doc["stages"])
    return int(plan_doc.get("dp", 1)) * per


def run_load(plan_doc: dict, steady: Sequence[dict]) -> tuple[Optional[float], Optional[int], Optional[bool]]:
    """``(load average, cores, busy)`` over the run: the median of the records' ``host_load`` samples
    (``[1-minute load average, cores]``, one a step, ``metrics.report.Reporter.step``), its cores, and
    :func:`~npu_train.hardware.host_busy` of it with the job's :func:`own_threads`; ``(None, None, None)``
    without samples. The median: a load average lags a minute, so the first steady steps still hold the
    start-up (several processes loading the model at once)."""
    samples = [r["host_load"] for r in steady if isinstance(r.get("host_load"), list) and len(r["host_load"]) == 2]
    if not samples:
        return None, None, None
    avg = median(float(s[0]) for s in samples)
    cores = max(1, int(samples[-1][1]))
    return avg, cores, host_busy(avg, cores, own_threads(plan_doc))


def run_figures(plan_doc: dict, records: Sequence[dict], rates: Sequence) -> list[RunFigures]:
    """Per card kind, the figures one run measured: ``plan_doc`` its ``plan.json``, ``records`` its
    ``metrics.jsonl`` lines, ``rates`` the plan's per-stage :class:`~npu_train.planner.rates.Rates`."""
    recs = _launch_records(plan_doc, records)
    steady = recs[1:]
    flops, adamw, clock = _timing(plan_doc, steady, rates)
    base, head = _baselines(plan_doc, recs)
    load, cores, busy = run_load(plan_doc, steady)
    kinds = dict.fromkeys(_kind(st["card"]) for st in plan_doc["stages"])
    out = []
    for k in kinds:
        f, a = flops.get(k), adamw.get(k)
        out.append(RunFigures(kind=k, threads=int(plan_doc["threads"]), dtype=str(plan_doc["shape"]["dtype"]),
                              model=str(plan_doc.get("model", "")), steps=len(steady),
                              model_shape=str(plan_doc.get("model_shape", "")),
                              device_flops=median(f) if f else None, adamw_params_per_s=median(a) if a else None,
                              process_baseline_bytes=base.get(k), head_baseline_bytes=head.get(k),
                              clock=clock if k == "cpu" else "wall", load_avg=load, host_cores=cores, busy=busy))
    return out


def fitted_path(kind: str, threads: int, dtype: str, root: Optional[Path] = None) -> Path:
    """``$NPT_CACHE/fitted/<kind>-<threads>t-<dtype>.json`` (``root``: another directory)."""
    return (root or cache_dir("fitted")) / f"{kind}-{int(threads)}t-{dtype}.json"


def read_runs(path: Path) -> list[dict]:
    """The run entries of a fitted-figures file; ``[]`` when missing. Raises ``ValueError`` when broken."""
    if not path.is_file():
        return []
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError("not a fitted-figures file (no 'runs' list)")
    return [r for r in doc["runs"] if isinstance(r, dict)]


def record_run(fig: RunFigures, root: Optional[Path] = None) -> Path:
    """Append ``fig`` to its kind's file, keeping the newest :data:`KEEP_RUNS` of every model shape (busy runs
    apart from the others: a busy afternoon never pushes the runs the figures come from out); atomic; a broken
    file is replaced (one warning line)."""
    path = fitted_path(fig.kind, fig.threads, fig.dtype, root)
    try:
        runs = read_runs(path)
    except (OSError, ValueError) as exc:
        print(f"warning: {path}: {exc}; starting it again", file=sys.stderr, flush=True)
        runs = []
    runs = runs + [asdict(fig)]
    # the newest KEEP_RUNS of every model shape, at most MAX_SHAPES shapes' worth in the file
    per_shape: dict = {}
    for r in reversed(runs):
        per_shape.setdefault((str(r.get("model_shape", "")), r.get("busy") is True), []).append(r)
    keep = {id(r) for group in per_shape.values() for r in group[:KEEP_RUNS]}
    runs = [r for r in runs if id(r) in keep][-KEEP_RUNS * MAX_SHAPES:]
    doc = {"version": FORMAT_VERSION, "kind": fig.kind, "threads": fig.threads, "dtype": fig.dtype, "runs": runs}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _positive(runs: list[dict], key: str) -> list[float]:
    out = []
    for r in runs:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and v > 0:
            out.append(float(v))
    return out


def fitted_figures(runs: Sequence[dict]) -> Fitted:
    """Combine run entries: the FLOP/s and AdamW rate over the newest :data:`KEEP_RUNS` runs not on a busy host
    (``busy`` True: counted in ``busy_runs``, the newest :data:`KEEP_RUNS` of them), the baselines over the
    newest :data:`KEEP_RUNS` of all (a busy host does not change a card's memory)."""
    runs = sorted(runs, key=lambda r: float(r.get("time", 0.0)))
    # busy runs with a timing figure to leave out (one of keep_host_memory=false has none to skip)
    busy = [r for r in runs if r.get("busy") is True and (_positive([r], "device_flops")
                                                          or _positive([r], "adamw_params_per_s"))]
    quiet = [r for r in runs if r.get("busy") is not True][-KEEP_RUNS:]
    runs = runs[-KEEP_RUNS:]
    # timing figures from the cards' CPU seconds where there are any: the wall-clock ones of older runs
    # hold the load of the host they ran on (RunFigures.clock)
    timed = [r for r in quiet if r.get("clock") == "cpu"] or quiet
    f, a = (_positive(timed, k) for k in ("device_flops", "adamw_params_per_s"))
    b = _positive(runs, "process_baseline_bytes")
    h = [float(r["head_baseline_bytes"]) for r in runs if isinstance(r.get("head_baseline_bytes"), (int, float))
         and math.isfinite(r["head_baseline_bytes"]) and r["head_baseline_bytes"] >= 0]
    return Fitted(device_flops=median(f) if f else None, flops_runs=len(f),
                  adamw_params_per_s=median(a) if a else None, adamw_runs=len(a),
                  process_baseline_bytes=max(b) if b else None, baseline_runs=len(b),
                  head_baseline_bytes=max(h) if h else None, head_runs=len(h), busy_runs=len(busy[-KEEP_RUNS:]))


def busy_note(load: float, cores: int, own: int) -> str:
    """The end-of-run line's words for a run on a busy host (:func:`refit_from_run`): ``load`` the run's load
    average, ``cores`` the host's, ``own`` the job's :func:`own_threads`."""
    return (f"fitted: not this run's speed, the host was busy with other work (load average {load:.1f} on {cores} "
            f"core{'s' if cores != 1 else ''}, this job keeps about {own} busy); later plans keep "
            "their rates")


def refit_from_run(run_dir: str, rates: Sequence, timing: bool = True) -> str:
    """At the end of a run: record the figures of ``run_dir`` (``rates``: ``Plan.rates``). ``timing=False``
    records the process baseline alone: the run's speed is not the default's (``runtime.keep_host_memory=false``
    page-faults every micro-batch's tensors, experiments/2026-12-04-cpu-heap.md), so its FLOP/s and AdamW
    rate would slow the plans of default runs. A run on a busy host (:func:`run_load`) is recorded, marked
    ``busy``, and :func:`fitted_figures` leaves its speed out. Returns the end-of-run line's note for such a run
    (:func:`busy_note`), else ``""``. Never raises: a problem is one warning line."""
    note = ""
    try:
        with open(os.path.join(run_dir, "plan.json")) as f:
            plan_doc = json.load(f)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        for fig in run_figures(plan_doc, records, rates):
            if fig.steps:
                if not timing:
                    fig.device_flops = fig.adamw_params_per_s = None
                fig.run_dir, fig.time = os.path.abspath(run_dir), time.time()
                record_run(fig)
                if fig.busy and (fig.device_flops or fig.adamw_params_per_s):
                    note = busy_note(float(fig.load_avg), int(fig.host_cores), own_threads(plan_doc))
    except Exception as exc:  # noqa: BLE001 - fitting must not fail a finished run
        print(f"warning: figures not fitted from {run_dir}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return note
