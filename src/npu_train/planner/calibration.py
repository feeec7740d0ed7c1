"""Calibration: measure the :class:`~npu_train.planner.rates.Rates` of a card kind on this machine.

A training run's launcher calibrates the figures its plan needs by itself on the first run on a
machine (:mod:`npu_train.planner.autocal`, ~12 s for cpu). ``python launch/run.py calibrate=true``
measures everything and ends up in :func:`main_calibrate`, which measures every
card kind of the job with :func:`calibrate`, prints a table and writes one profile per kind with
:func:`save_profile` (default ``$NPT_CACHE/calibration/<kind>.json``, i.e.
``~/.cache/npu-train/calibration/<kind>.json``: :func:`~npu_train.planner.rates.calibration_path`,
the file :func:`~npu_train.planner.rates.load_rates` reads; ``placement.profile=<path>`` selects
another). The benchmarks themselves are in :mod:`npu_train.planner.measure`.

What is measured, through the card's backend (:func:`npu_train.backends.make_backend`), each in a
time-bounded loop (about 0.6 s per figure, at most 3 s; the median of the repetitions is kept, so
a short burst of other load on a shared machine does not decide the figure; a whole cpu
calibration takes ~25 s on 2 cores):

- ``device_flops``: *sustained training* FLOP/s = forward + backward of one
  :class:`npu_train.model.llama.DecoderLayer` (the trainer's own layer, in the planner's compute
  dtype: fp32 on cpu, bf16 on cuda/furiosa; fp32 and bf16 both go to ``flops_by_dtype``) on
  ``b*s`` tokens (cpu 2x128 as the default job, accelerators 1x512), counted as the placement
  model counts them (``6 * tokens * params + 12 * s * heads*head_dim * tokens``). The layer has
  the shapes of the model being calibrated for (``model_path``) when one repetition stays within
  a FLOP budget (:mod:`npu_train.planner.measure`), else a reference Llama layer. A bare matmul
  runs faster (about 100 vs 85 GFLOP/s fp32 per core on an AMD EPYC Zen 4) because a training
  step also spends time in norms, RoPE, SwiGLU, attention and autograd; the planner divides
  training FLOPs by this rate, so it must be the training rate. The bare square-matmul FLOP/s are recorded too
  (``matmul_flops_by_dtype``, not used by the planner).
- ``head_flops_ratio``: FLOP/s of final norm + ``lm_head`` + ``causal_lm_loss_sum`` forward +
  backward (the model's vocabulary and width when given) divided by the decoder layer's FLOP/s:
  about 0.8 for SmolLM2 on a CPU core (the ``V x H`` GEMMs have one small dimension; the fp32
  log-softmax spans the vocabulary). Timed in rounds, each right after a short timing of the
  layer, and the rounds' median ratio taken (:func:`npu_train.planner.measure._head_vs_layer`):
  timed apart, the machine's drift between the two figures moved the ratio by +-25 %, enough to
  move a layer across a stage boundary.
- ``split_backward_ratio``: seconds of a 4-layer stage through forward + input-gradient pass +
  deferred weight-gradient pass (the zero-bubble split, graph cut per layer, as the card processes
  run it) over forward + one backward, median of 3 interleaved rounds
  (:func:`npu_train.planner.splitcost.split_backward_ratio`; 1.08-1.16 on the 2-core VM,
  experiments/2026-12-01-bench-run7.md); the planner stretches the splitting stages' B and W by it.
- ``h2d_bytes_per_s`` / ``d2h_bytes_per_s``: ``backend.upload`` / ``backend.download`` of one
  117 MB tensor (the size of the earlier RNGD reference measurement) + ``synchronize``; on cpu that
  is a clone into freshly allocated memory (page faults included), as in the trainer.
- ``host_adamw_params_per_s``: ``torch.optim.AdamW(fused=True)`` on the CPU over ~20M fp32
  params (8 tensors), gradients set, after two warm-up steps (the first allocates the moments).
- ``device_adamw_params_per_s``: ``StageOptimizer.step`` over resident parameters on the card,
  i.e. the trainer's own device-optimizer path: gradient scaling into the fp32 masters, AdamW as
  the trainer configures it for the device (cpu: the same fused CPU AdamW as the host's; cuda:
  fused; furiosa: ``foreach=False``) and the refresh of the compute-dtype weights.
- ``process_baseline_bytes`` (cpu only): RSS of a fresh subprocess that does what a card process
  does before it allocates model state: imports torch and the trainer's modules (the ``modules``
  argument of :func:`measure_process_baseline`, default :data:`CARD_PROCESS_MODULES`), sets up the cpu
  backend, a ZeroMQ context and a one-rank gloo process group, and (with ``model_path``) opens the
  model file with the trainer's loader; a GGUF reader stays cached in the card process with its
  parsed metadata and memory-mapped file, so its pages are touched too (an upper bound: a stage
  touches only its own tensors' pages). :mod:`npu_train.planner.baseline` holds it.

Threads: on cpu the figures depend on the torch thread count, and the launcher gives each card
process :func:`npu_train.planner.threads.threads_per_card` threads (``runtime.threads``, else the
usable cores divided among the host's card processes). Calibration measures every count in
``{1, 2, 4, ..., cores}`` (:func:`thread_counts`) (``torch.set_num_threads(n)`` around the
measurement); the profile's top level holds the figures for ``cores`` threads and ``by_threads``
the others, and the planner picks the entry of the job's thread count (see
:meth:`npu_train.planner.rates.Rates.resolve`). Multi-thread figures collapse while another
process holds a core (an OpenMP team waits for its descheduled thread: 5-40 instead of 145
GFLOP/s on 2 cores), so the largest count is measured first, a count that comes out slower than
a smaller one is re-measured (best of up to 4 per figure), and if it stays slower the smaller
count's figures are used (a lower bound) and a warning is printed and saved: calibrate on a quiet
machine.

Concurrency: this full calibration measures each thread count in one process alone (the profile
says ``concurrent: 1``). A job runs its card processes at once and they share memory bandwidth
and caches, so its per-card figures are lower (the 2-process cpu job of
experiments/2026-11-30-first-run-calibration.md: 1.34x the alone-time step prediction). The
automatic first-run calibration (:mod:`npu_train.planner.autocal`) measures under the job's
concurrency, and a ``concurrent: 1`` profile does not satisfy a job of several cpu card processes:
its first launch measures the job's thread count again under load.

Shapes: the profile records the model shapes its figures were measured on (``shapes``,
:func:`~npu_train.planner.measure.shape_signature`: the layer and head dims, not the tokens per
micro-batch); a job on another model's shapes measures its thread count again on its own on its first
launch (:func:`npu_train.planner.autocal.profile_status`).

``quick=True`` shrinks every size (for tests): positive, finite, but not meaningful figures.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from npu_train.hardware import KINDS
from npu_train.planner.baseline import (  # noqa: F401 - re-exported
    CARD_PROCESS_MODULES,
    finish_process_baseline,
    measure_process_baseline,
    start_process_baseline,
)
from npu_train.planner.machine import cpu_model, machine_info  # noqa: F401 - re-exported
from npu_train.planner.measure import (
    RETRIES,
    best_of,
    measure_at,
    note_load,
    planner_dtype,
    rate_fields,
    slower,
)
from npu_train.planner.rates import DEFAULT_RATES, Rates, calibration_path, load_rates
from npu_train.planner.spec import gib
from npu_train.planner.threads import usable_cores

__all__ = ["calibrate", "save_profile", "main_calibrate", "machine_info", "thread_counts",
           "measure_process_baseline", "start_process_baseline", "finish_process_baseline", "CARD_PROCESS_MODULES", "PROFILE_VERSION"]

#: 2: measured with freed host memory kept (npu_train.hostmem, as the card processes run by default);
#: a version-1 profile read the head at 0.71-0.83x a layer's FLOP/s where it now reads ~1.2x
#: (experiments/2026-12-01-bench-run6.md), so it is recalibrated. 3: adds split_backward_ratio (the
#: zero-bubble split's cost per layer, experiments/2026-12-01-bench-run7.md); without it a zb plan
#: assumed 1.0 and put a layer too many on the stages that split. 4: entries record the model shapes they
#: were measured on (``shapes``), and the lm_head figure is timed on the fused head of cpu/cuda cards
#: (model/headops.py, experiments/2026-12-02-head.md); older profiles (which may hold another model's
#: ratios: a profile without ``shapes`` fits any job) are measured again once
PROFILE_VERSION = 4


def thread_counts(cores: Optional[int] = None) -> list[int]:
    """cpu thread counts calibration measures: ``{1, 2, 4, ...} <= cores``, plus ``cores``
    (default :func:`npu_train.planner.threads.usable_cores`: affinity and cgroup quota)."""
    cores = int(cores or usable_cores())
    out, t = set(), 1
    while t <= cores:
        out.add(t)
        t *= 2
    out.add(cores)
    return sorted(out)


def calibrate(kind: str, index: Optional[int] = None, *, quick: bool = False,
              model_path: Optional[str] = None, threads: Optional[list[int]] = None,
              modules: Optional[Sequence[str]] = None) -> Rates:
    """Measure :class:`Rates` of card kind ``kind`` (``"cpu"``, ``"cuda"``, ``"furiosa"``) on this
    machine, through the backend of card ``index`` (default 0; ignored for cpu).

    Args:
        quick: tiny sizes and few repetitions (tests); figures are positive but not meaningful.
        model_path: the model the profile is for. Its decoder layer and lm_head shapes are used
            for the FLOP/s benchmarks when one repetition stays small (else reference shapes), and
            on cpu opening its file (as a card process does) is part of
            ``process_baseline_bytes``. ``None``: reference shapes, imports/runtime only.
        threads: cpu only: torch thread counts to measure (default :func:`thread_counts`); the
            largest goes to the top level, the others to ``by_threads``.
        modules: cpu only: the modules a card process imports, for the process baseline
            (:func:`measure_process_baseline`; ``None``: :data:`CARD_PROCESS_MODULES`).

    Returns:
        The measured :class:`Rates`. Its attribute ``calibration`` (not a dataclass field) holds
        the details :func:`save_profile` records: per-thread figures, matmul FLOP/s, machine info,
        seconds spent.
    """
    import torch

    from npu_train.backends import make_backend

    if kind == "rngd":
        kind = "furiosa"
    if kind not in KINDS:
        raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")
    t0 = time.perf_counter()
    entry = "cpu" if kind == "cpu" else f"{kind}:{0 if index is None else int(index)}"
    backend = make_backend(entry)
    backend.setup()
    details: dict = {"kind": kind, "card": backend.name, "quick": bool(quick),
                     "planner_dtype": planner_dtype(kind)}
    model_cfg = None
    if model_path:
        from npu_train.model import load_config, resolve_model_path

        model_cfg = load_config(resolve_model_path(model_path))
        details["model"] = {"path": str(model_path), "name": model_cfg.name}
    if kind == "cpu":
        counts = sorted({int(t) for t in (threads or thread_counts())})
        if quick:
            counts = counts[:1] if threads is None else counts
        old = torch.get_num_threads()
        per: dict[int, dict] = {}
        try:
            # most threads first: they suffer most from other load (an OpenMP team stalls
            # when one of its threads is descheduled), so they go first, right after start-up
            for t in sorted(counts, reverse=True):
                torch.set_num_threads(t)
                per[t] = measure_at(kind, backend, quick, model_cfg)
                note_load(per[t])
            for t in counts:
                prev = [u for u in per if u < t]
                if not prev or quick:
                    continue
                lower = per[max(prev)]
                if not slower(per[t], lower):
                    continue
                # more threads but slower: disturbed by other load. The figures wanted are what
                # the machine does for the job alone: re-measure a few times, keep the best of
                # each figure.
                torch.set_num_threads(t)
                for _ in range(RETRIES):
                    time.sleep(2.0)
                    again = measure_at(kind, backend, quick, model_cfg)
                    note_load(again)
                    per[t] = best_of(per[t], again, kind)
                    if not slower(per[t], lower):
                        break
                bad = slower(per[t], lower)
                if bad:
                    # keep a lower bound instead: t threads are at least as fast as fewer
                    details.setdefault("warnings", []).append(
                        f"{t} threads measured slower than {max(prev)} for {', '.join(bad)} "
                        "(other load on the machine?): the lower thread count's figures are used "
                        "for those (a lower bound); rerun calibration on an idle machine")
                    per[t] = best_of(per[t], lower, kind, only=bad)
                    per[t]["disturbed"] = bad
        finally:
            torch.set_num_threads(old)
        top_t = max(per)
        top = per[top_t]
        baseline_threads = min(counts)
        try:
            baseline = measure_process_baseline(
                model_path, baseline_threads,
                modules=CARD_PROCESS_MODULES if modules is None else modules)
            details["process_baseline"] = {"model_path": model_path, "threads": baseline_threads,
                                           "rss_bytes": baseline}
        except Exception as exc:  # noqa: BLE001 - keep the other figures, report the failure
            baseline = DEFAULT_RATES["cpu"].process_baseline_bytes
            details["process_baseline"] = {"error": str(exc)[:2000], "used_default": baseline}
            details["assumed_fields"] = ["process_baseline_bytes"]
        by_threads = {t: rate_fields(v) for t, v in per.items() if t != top_t}
        details["by_threads"] = {str(t): v for t, v in per.items()}
    else:
        top_t = 0
        top = measure_at(kind, backend, quick, model_cfg)
        baseline = 0
        by_threads = {}
        details["measured"] = top
    rates = Rates(
        device_flops=top["device_flops"], h2d_bytes_per_s=top["h2d_bytes_per_s"],
        d2h_bytes_per_s=top["d2h_bytes_per_s"],
        host_adamw_params_per_s=top["host_adamw_params_per_s"],
        device_adamw_params_per_s=top["device_adamw_params_per_s"],
        head_flops_ratio=top["head_flops_ratio"],
        split_backward_ratio=float(top.get("split_backward_ratio", 1.0)),
        process_baseline_bytes=float(baseline), threads=top_t,
        flops_by_dtype=dict(top["flops_by_dtype"]), by_threads=by_threads,
        shapes=str((top.get("shapes") or {}).get("signature", "")),
    )
    for k in ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s"):
        v = getattr(rates, k)
        if not (v > 0 and math.isfinite(v)):
            raise RuntimeError(f"calibration of {kind}: {k}={v!r} is not a positive number")
    details["machine"] = machine_info(kind, backend)
    details["seconds"] = round(time.perf_counter() - t0, 2)
    rates.calibration = details  # type: ignore[attr-defined]
    return rates




def save_profile(kind: str, rates: Rates, path: Union[str, os.PathLike, None] = None,
                 *, details: Optional[dict] = None) -> Path:
    """Write ``rates`` as a calibration profile that :func:`~npu_train.planner.rates.load_rates`
    reads (``{"rates": {...}}``), with the machine facts and measurement details of
    ``details`` (default: ``rates.calibration`` when :func:`calibrate` made it, else machine info
    only). Atomic (temp file + rename); creates the directory. Returns the path."""
    path = Path(path) if path is not None else calibration_path(kind)
    det = details if details is not None else getattr(rates, "calibration", None)
    if det is None:
        det = {"machine": machine_info(kind)}
    r = {
        "device_flops": rates.device_flops,
        "h2d_bytes_per_s": rates.h2d_bytes_per_s,
        "d2h_bytes_per_s": rates.d2h_bytes_per_s,
        "host_adamw_params_per_s": rates.host_adamw_params_per_s,
        "device_adamw_params_per_s": rates.device_adamw_params_per_s,
        "head_flops_ratio": rates.head_flops_ratio,
        "split_backward_ratio": rates.split_backward_ratio,
        "process_baseline_bytes": int(rates.process_baseline_bytes),
        "threads": int(rates.threads),
        "concurrent": int(rates.concurrent),
        "shapes": str(rates.shapes),
        "flops_by_dtype": dict(rates.flops_by_dtype),
        "by_threads": {str(t): v for t, v in rates.by_threads.items()},
    }
    doc = {
        "version": PROFILE_VERSION,
        "kind": kind,
        "created": det.get("machine", {}).get("date")
        or _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "units": {"device_flops": "FLOP/s (forward+backward of a decoder layer)",
                  "*_bytes_per_s": "B/s", "*_params_per_s": "fp32 params/s",
                  "process_baseline_bytes": "B (process RSS)"},
        "rates": r,
        "machine": det.get("machine", {}),
        "details": {k: v for k, v in det.items() if k != "machine"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    return path


def _parse_kind(entry: str) -> tuple[str, Optional[int]]:
    entry = str(entry).strip()
    kind, _, idx = entry.partition(":")
    kind = "furiosa" if kind == "rngd" else kind
    index = int(idx) if idx.isdigit() else None
    return kind, index


def _fmt_rates(kind: str, r: Rates) -> list[str]:
    rows = [f"  {'threads':<26} {r.threads or '-'}", f"  {'measured on':<26} {r.shapes or '-'}"]
    rows.append(f"  {'device_flops':<26} {r.device_flops / 1e9:10.1f} GFLOP/s (training, "
                + ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(r.flops_by_dtype.items())) + ")")
    mm = (getattr(r, "calibration", {}) or {}).get("by_threads", {}).get(str(r.threads)) \
        or (getattr(r, "calibration", {}) or {}).get("measured") or {}
    if mm.get("matmul_flops_by_dtype"):
        rows.append(f"  {'matmul (not used)':<26} "
                    + ", ".join(f"{d} {v / 1e9:.1f}" for d, v in sorted(mm["matmul_flops_by_dtype"].items()))
                    + " GFLOP/s")
    rows += [
        f"  {'head_flops_ratio':<26} {r.head_flops_ratio:10.2f} (lm_head + loss vs layers)",
        f"  {'split_backward_ratio':<26} {r.split_backward_ratio:10.2f} (zero-bubble F + B + W vs F + backward)",
        f"  {'h2d_bytes_per_s':<26} {r.h2d_bytes_per_s / 1e9:10.2f} GB/s",
        f"  {'d2h_bytes_per_s':<26} {r.d2h_bytes_per_s / 1e9:10.2f} GB/s",
        f"  {'host_adamw_params_per_s':<26} {r.host_adamw_params_per_s / 1e6:10.1f} M params/s",
        f"  {'device_adamw_params_per_s':<26} {r.device_adamw / 1e6:10.1f} M params/s",
    ]
    if kind == "cpu":
        rows.append(f"  {'process_baseline_bytes':<26} {gib(r.process_baseline_bytes):10.3f} GiB")
        for t, e in sorted(r.by_threads.items(), key=lambda kv: int(kv[0])):
            rows.append(f"  at {t} thread(s): {e['device_flops'] / 1e9:.1f} GFLOP/s, h2d "
                        f"{e['h2d_bytes_per_s'] / 1e9:.2f} GB/s, d2h {e['d2h_bytes_per_s'] / 1e9:.2f}"
                        f" GB/s, AdamW {e['host_adamw_params_per_s'] / 1e6:.1f} M params/s")
    return rows


def main_calibrate(kinds: list[str], *, quick: bool = False, model_path: Optional[str] = "embedded",
                   profile: Union[str, os.PathLike, None] = None,
                   modules: Optional[Sequence[str]] = None) -> list[str]:
    """Calibrate every distinct kind in ``kinds`` (``"cpu"``, ``"cuda:1"``, ``"furiosa:0"``...;
    the first index given for a kind is the card measured), print the measured rates and where
    they were saved, and return the saved paths.

    ``model_path`` (default the embedded SmolLM2): the job's ``model.path``; its layer and head
    shapes are benchmarked and its file reader is part of the cpu process baseline (``None``:
    reference shapes, imports only). ``profile``: write to this path instead of the default (only
    with a single kind). ``modules``: the modules a card process imports, passed to
    :func:`calibrate` (``None``: :data:`CARD_PROCESS_MODULES`).

    Raises:
        ValueError: an unknown kind, or one ``profile`` path for several kinds.
    """
    seen: dict[str, Optional[int]] = {}
    for k in kinds:
        kind, idx = _parse_kind(k)
        if kind not in KINDS:
            raise ValueError(f"card kind must be one of {KINDS}, got {k!r}")
        if kind not in seen or (seen[kind] is None and idx is not None):
            seen[kind] = idx
    if profile is not None and len(seen) > 1:
        raise ValueError(f"one profile path for {len(seen)} kinds ({sorted(seen)}): calibrate one "
                         "kind at a time or use the default paths")
    saved = []
    for kind, idx in seen.items():
        print(f"calibrating {kind}{'' if idx is None else f':{idx}'}"
              f"{' (quick)' if quick else ''} ...", flush=True)
        r = calibrate(kind, idx, quick=quick, model_path=model_path, modules=modules)
        path = save_profile(kind, r, profile)
        det = getattr(r, "calibration", {})
        print(f"{kind}: measured in {det.get('seconds', 0):.1f} s on "
              f"{det.get('machine', {}).get('cpu_model', '?')}"
              + (f" / {det['machine']['device']}" if det.get("machine", {}).get("device") else ""))
        for row in _fmt_rates(kind, r):
            print(row)
        for w in det.get("warnings", []):
            print(f"  warning: {w}")
        if "error" in det.get("process_baseline", {}):
            print(f"  warning: process baseline not measured ({det['process_baseline']['error'][:200]}); "
                  "default used")
        check = load_rates(kind, path)
        assert math.isclose(check.device_flops, r.device_flops)
        print(f"  saved to {path}", flush=True)
        saved.append(str(path))
    return saved

