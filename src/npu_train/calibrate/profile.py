"""``calibrate=true``: measure each card kind's :class:`~npu_train.planner.rates.Rates` and write
``$NPT_CACHE/calibration/<kind>.json`` (:func:`main_calibrate` -> :func:`calibrate` -> :func:`save_profile`).

Each figure is the median of a time-bounded loop through the card's backend: ``device_flops`` (one
decoder layer's forward + backward, FLOPs counted as the planner does; per dtype in ``flops_by_dtype``),
``head_flops_ratio``, ``split_backward_ratio`` (:mod:`.splitcost`), ``h2d``/``d2h_bytes_per_s`` (117 MB
tensor), ``host``/``device_adamw_params_per_s`` and, on cpu, ``process_baseline_bytes`` (:mod:`.baseline`).
cpu figures are taken at every count of :func:`thread_counts`. Figures fitted from finished runs win
(:mod:`npu_train.planner.fit`).
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from npu_train.calibrate.baseline import CARD_PROCESS_MODULES, measure_process_baseline
from npu_train.calibrate.measure import RETRIES, best_of, measure_at, note_load, rate_fields, slower
from npu_train.calibrate.timing import planner_dtype
from npu_train.hardware import KINDS
from npu_train.planner.rates import DEFAULT_RATES, Rates, calibration_path, load_rates
from npu_train.planner.spec import gib
from npu_train.planner.threads import usable_cores

__all__ = ["calibrate", "save_profile", "main_calibrate", "machine_info", "thread_counts", "CARD_PROCESS_MODULES",
           "PROFILE_VERSION"]

#: profile format version (4: entries record the model ``shapes``; history: experiments/2026-12-02-head.md)
PROFILE_VERSION = 4


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo``'s ``model name``, else ``platform``'s), for machine records."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(kind: Optional[str] = None, backend=None) -> dict:
    """Facts recorded with a profile: cpu model, cores, RAM, versions, date, load, device name."""
    import psutil
    import torch

    info = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_usable": usable_cores(),
        "cores_physical": psutil.cpu_count(logical=False),
        "ram_bytes": int(psutil.virtual_memory().total),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        info["loadavg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["npu_train"] = version("npu-train")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        pass
    if kind == "cuda":
        try:
            info["device"] = torch.cuda.get_device_name(backend.index if backend else 0)
        except Exception:  # noqa: BLE001
            pass
    if kind == "furiosa":
        try:
            info["device"] = str(backend.device()) if backend is not None else "furiosa"
        except Exception:  # noqa: BLE001
            pass
    return info


def thread_counts(cores: Optional[int] = None) -> list[int]:
    """cpu thread counts to measure: ``{1, 2, 4, ...} <= cores`` plus ``cores`` (default: usable cores)."""
    cores = int(cores or usable_cores())
    out, t = set(), 1
    while t <= cores:
        out.add(t)
        t *= 2
    out.add(cores)
    return sorted(out)


def _measure_threads(kind: str, backend, quick: bool, model_cfg, counts: list[int], details: dict) -> dict[int, dict]:
    """:func:`measure_at` per thread count, most first; a count slower than a smaller one is re-measured,
    else the smaller one's figures are kept (a warning)."""
    import torch

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
    return per


def _baseline(model_path: Optional[str], threads: int, modules: Optional[Sequence[str]], details: dict) -> float:
    """The cpu process baseline (bytes), or the default with the failure in ``details``."""
    try:
        baseline = measure_process_baseline(
            model_path, threads,
            modules=CARD_PROCESS_MODULES if modules is None else modules)
        details["process_baseline"] = {"model_path": model_path, "threads": threads,
                                       "rss_bytes": baseline}
    except Exception as exc:  # noqa: BLE001 - keep the other figures, report the failure
        baseline = DEFAULT_RATES["cpu"].process_baseline_bytes
        details["process_baseline"] = {"error": str(exc)[:2000], "used_default": baseline}
        details["assumed_fields"] = ["process_baseline_bytes"]
    return baseline


def calibrate(kind: str, index: Optional[int] = None, *, quick: bool = False,
              model_path: Optional[str] = None, threads: Optional[list[int]] = None,
              modules: Optional[Sequence[str]] = None) -> Rates:
    """Measure the :class:`Rates` of ``kind`` (``cpu``/``cuda``/``furiosa``) through card ``index``.

    ``quick``: tiny sizes (tests; figures not meaningful). ``model_path``: its layer and head shapes are
    timed when small enough, and (cpu) opening it counts in the process baseline. ``threads``/``modules``:
    cpu thread counts and card-process modules. The returned Rates carries ``calibration`` (per-thread
    figures, matmul, machine info, seconds) for :func:`save_profile`."""
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
        per = _measure_threads(kind, backend, quick, model_cfg, counts, details)
        top_t = max(per)
        top = per[top_t]
        baseline = _baseline(model_path, min(counts), modules, details)
        by_threads = {t: rate_fields(v) for t, v in per.items() if t != top_t}
        details["by_threads"] = {str(t): v for t, v in per.items()}
    else:
        top_t = 1  # the card's figures do not depend on the host threads; its host AdamW is one thread's
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
        process_baseline_bytes=float(baseline), threads=top_t, kind=kind,
        host_bytes_per_s=float(top.get("host_bytes_per_s", DEFAULT_RATES[kind].host_bytes_per_s)),
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
    """Write ``rates`` (and ``details``, default ``rates.calibration``) atomically as a profile
    :func:`~npu_train.planner.rates.load_rates` reads; returns the path."""
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
        "host_bytes_per_s": rates.host_bytes_per_s,
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
        f"  {'host_adamw_params_per_s':<26} {r.host_adamw_params_per_s / 1e6:10.1f} M params/s"
        + ("" if kind == "cpu" else " (one pass, one thread)"),
        f"  {'device_adamw_params_per_s':<26} {r.device_adamw / 1e6:10.1f} M params/s",
    ]
    if kind != "cpu":
        rows.append(f"  {'host_bytes_per_s':<26} {r.host_bytes_per_s / 1e9:10.2f} GB/s (host memory, every core)")
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
    """Calibrate every distinct kind in ``kinds`` (``cpu``, ``cuda:1``...; the first index per kind is
    measured), print the rates and return the saved paths. ``model_path``: as :func:`calibrate`;
    ``profile``: write there instead (one kind only). Raises ValueError for an unknown kind or a
    ``profile`` with several kinds."""
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

