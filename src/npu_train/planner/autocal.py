"""Automatic first-run calibration (``placement.calibrate=auto``, the default).

Before a training job plans its placement, :func:`ensure_profile` makes sure each card kind of the
job has a calibration profile (``$NPT_CACHE/calibration/<kind>.json``,
:func:`~npu_train.planner.rates.calibration_path`) that describes *this* machine at the job's
thread count and compute dtype (:func:`profile_status`): written on a machine with the same
fingerprint (:mod:`npu_train.planner.machine`: CPU model and flags, usable cores, torch version,
device name), with figures measured at ``threads`` torch threads (the top level or a
``by_threads`` entry) in the job's dtype, and (cpu) a measured process baseline. When it has
one, nothing is measured. When not, the launcher measures only what the plan needs, in a few
seconds (:data:`~npu_train.planner.measure.AUTO` loop bounds: 6 figures, each at most 1.2 s, the
job's own layer and head shapes, one thread count, one dtype, no bare-matmul figure), prints one line
``calibrating <kind> (<why>, ~N s; cached in <path>)`` and merges the figures into the profile:
a profile of another machine is replaced, one of this machine gains the thread count.

``placement.calibrate=never`` keeps the profile as it is (missing: the planner's assumed
defaults, each labelled "assumed" in the plan); ``always`` measures again. ``$NPT_CALIBRATE``
(``auto``/``never``/``always``) replaces a configured ``auto`` (the test suite sets ``never``).
``placement.profile=<file>`` (a profile the user chose), dry runs (``plan=true``: they plan for
another machine), a sweep's pre-check of its jobs (it plans without probing devices) and
multi-node jobs (every node must plan with the same figures) never calibrate automatically.

Concurrent card processes: a cpu job runs its ``c`` card processes on this host at once, and they
share its memory bandwidth and caches (a 2-process job measured 1.34x the step time of figures
timed in one process alone: experiments/2026-11-30-first-run-calibration.md). So on cpu the
figures are measured under the job's concurrency (:func:`job_concurrency`: the job's cpu cards,
at most usable cores // threads): ``c - 1`` helper processes
(:class:`~npu_train.planner.loadgen.BackgroundLoad`) run the same kind of work at the job's thread
count while the calibrating process measures; they are ready before and stopped after the
measured figures. The profile entry records ``concurrent: c``,
and a profile measured at another concurrency is ``"partial"`` for the job: its thread count is
measured again and replaces that entry (a machine that alternates jobs of different concurrency
re-measures each time). A profile without the field counts as measured alone (``c = 1``).

Started early (cpu): the launcher calls :func:`start_early` before it reads the model, so the
helpers' interpreter start and torch import overlap that work instead of following it, and
passes them to :func:`auto_calibrate` (``early=``), which gives them the job's shapes and waits
until they are ready. The first helper measures the process baseline before its load work (the
same source as the stand-alone baseline subprocess: :mod:`npu_train.planner.baseline`), so no
extra interpreter runs and nothing but the job's ``c`` processes runs in the measured window;
without helpers (``c = 1``) the baseline subprocess starts early too. Every helper is stopped
(killed when not yet ready) on every path: used, unused, a failed measurement, a rejected job.

Concurrency: launchers of a sweep may start together. The profile is written atomically (temp
file + ``os.replace``: a reader sees the old or the new file, never a torn one) under an
exclusive ``fcntl`` lock on ``<path>.lock``; a launcher that waited for the lock re-reads the
profile and reuses what the other one measured. A profile that cannot be read (a torn or
hand-broken file) is measured again with a warning.

Shapes: the FLOP/s, ``head_flops_ratio`` and ``split_backward_ratio`` are timed on the job's own layer
and head (model dims, micro-batch, sequence length) and describe that model only (head ratio: 6.4 for
a tiny test model, 1.2 for SmolLM2). Each entry records ``shapes`` (:func:`~npu_train.planner.measure.job_shapes`:
the model's dims; the micro-batch and sequence length are not part of it, or a sweep over them re-measures at every launch);
figures at the job's thread count measured on other shapes are ``"partial"``, measured again and replace
that entry with all its dtypes (other thread counts keep theirs, with their own ``shapes``). A profile
without the field (older) counts as measured on the job's shapes. :func:`start_early` runs before the
model is read and does not check shapes: a profile that fits but for them starts its helpers later.
"""
from __future__ import annotations

import contextlib
import functools
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

from npu_train.env import getenv
from npu_train.errors import ConfigError
from npu_train.planner.calibration import PROFILE_VERSION, save_profile
from npu_train.planner.loadgen import BackgroundLoad
from npu_train.planner.machine import (  # cpu_snapshot, others_cores: re-exported
    cpu_flags_digest,
    cpu_model,
    cpu_snapshot,
    machine_info,
    others_cores,
    same_machine,
)
from npu_train.planner.measure import (
    AUTO,
    QUICK,
    job_shapes,
    measure_at,
    note_load,
    rate_fields,
    reference_shapes,
    shape_signature,
    warm_imports,
)
from npu_train.planner.rates import DEFAULT_RATES, Rates, calibration_path, load_rates, shapes_differ
from npu_train.planner.spec import PlacementError
from npu_train.planner.threads import usable_cores

__all__ = ["MODES", "AUTO_ADAMW_PARAMS", "EXPECTED_SECONDS", "LOCK_TIMEOUT_S", "calibrate_mode", "auto_calibrate",
           "here_fingerprint", "profile_status", "ensure_profile", "measure_for_job", "cpu_snapshot",
           "others_cores", "job_concurrency", "needs_baseline", "start_early"]

MODES = ("auto", "never", "always")
#: parameters of the two AdamW benchmarks in the automatic calibration (8M: 96 MB of fp32
#: master + moments, far beyond any cache, as the real optimizer's state)
AUTO_ADAMW_PARAMS = 8_000_000
#: the wall time printed in the "calibrating" line, seconds, from that line to the plan (cpu: 11.7
#: and 12.7 s on the quiet 2-core machine with the helpers started early, run 4 of
#: experiments/2026-11-30-first-run-calibration.md; accelerators: an estimate)
EXPECTED_SECONDS = {"cpu": 12, "cuda": 10, "furiosa": 30}
#: cores per usable core that other processes may use during a calibration before it warns that
#: the machine was busy (their load slows the measured figures: experiments/2026-11-30-first-run-calibration.md)
BUSY_OTHERS = 0.1
#: seconds a launcher waits for another launcher's calibration before measuring itself
LOCK_TIMEOUT_S = 300.0


def calibrate_mode(configured: str) -> str:
    """The effective mode: ``$NPT_CALIBRATE`` when set and ``configured`` is ``auto``, else
    ``configured``. Raises :class:`~npu_train.errors.ConfigError` for a value not in :data:`MODES`."""
    mode = str(configured)
    if mode not in MODES:
        raise ConfigError(f"placement.calibrate={mode!r}: use auto, never or always")
    env = getenv("CALIBRATE")
    if env and mode == "auto":
        if env not in MODES:
            raise ConfigError(f"$NPT_CALIBRATE={env!r}: use auto, never or always (or unset it)")
        mode = env
    return mode


def here_fingerprint(kind: str, index: Optional[int] = None) -> dict:
    """This machine's :func:`~npu_train.planner.machine.fingerprint` for card kind ``kind``
    (cuda: the device name of card ``index``; furiosa: no device name)."""
    import torch

    fp = {"cpu_model": cpu_model(), "cpu_flags": cpu_flags_digest(), "cores_usable": usable_cores(),
          "torch": torch.__version__}
    if kind == "cuda":
        with contextlib.suppress(Exception):
            fp["device"] = torch.cuda.get_device_name(int(index or 0))
    return fp


def job_concurrency(cards: Sequence, threads: int, cores: Optional[int] = None) -> int:
    """How many cpu card processes of ``cards`` (:class:`~npu_train.planner.spec.CardSpec`, all
    on this host) run at once, at most ``cores // threads`` (``cores``: default
    :func:`~npu_train.planner.threads.usable_cores`), at least 1."""
    n = sum(1 for c in cards if c.kind == "cpu")
    cap = max(1, int(cores if cores is not None else usable_cores()) // max(1, int(threads)))
    return max(1, min(n, cap))


def profile_status(path: Path, kind: str, threads: int, dtype: str, *, quick: bool = False,
                   here: Optional[dict] = None, concurrent: int = 1, shapes: Optional[str] = None) -> tuple[str, str]:
    """(status, why) for the profile at ``path`` and a job of ``kind`` with ``threads`` torch
    threads per card process in ``dtype``. Status: ``"ok"`` (fits), ``"missing"``, ``"corrupt"``
    (unreadable), ``"stale"`` (another machine, profile version or quick-ness: replaced) or
    ``"partial"`` (this machine, but no figures for the thread count or dtype, or no measured
    process baseline, or (cpu) figures measured with another number of processes at once than
    ``concurrent``, or on other shapes than ``shapes``: the measurement is merged in).

    ``quick``: only a quick (test) profile is ok, and only a full one otherwise. ``here``: this
    machine's fingerprint (default :func:`here_fingerprint`). ``shapes``: the job's
    :func:`~npu_train.planner.measure.job_shapes` (``None``: not checked; unknown ones fit)."""
    if not path.is_file():
        return "missing", "first run on this machine"
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or not isinstance(doc.get("rates"), dict):
            raise ValueError("no 'rates' object")
        rates = load_rates(kind, path)
    except (OSError, ValueError, PlacementError) as exc:
        return "corrupt", f"unreadable profile ({str(exc)[:200]})"
    if doc.get("version") != PROFILE_VERSION:
        return "stale", f"profile version {doc.get('version')} != {PROFILE_VERSION}"
    if bool((doc.get("details") or {}).get("quick")) != bool(quick):
        return "stale", "a quick (test) profile" if not quick else "not a quick profile"
    diff = same_machine(doc.get("machine") or {}, here or here_fingerprint(kind))
    if diff:
        return "stale", "machine changed: " + "; ".join(diff)
    if kind == "cpu":
        t = int(threads)
        if t not in rates.measured_threads():
            return "partial", f"no figures for {t} thread(s)"
        if shapes_differ(rates.shapes_at(t), shapes):
            return "partial", (f"figures at {t} thread(s) measured on other shapes ({rates.shapes_at(t)}), "
                               f"the job's are {shapes}")
        entry = rates.by_threads.get(t) if t != rates.threads else None
        dts = entry.get("flops_by_dtype", {}) if isinstance(entry, dict) else rates.flops_by_dtype
        if dtype not in dts:
            return "partial", f"no {dtype} figures at {t} thread(s)"
        have = rates.concurrent_at(t)
        if have != int(concurrent):
            return "partial", (f"figures at {t} thread(s) measured with {have} process(es) at once, "
                               f"the job runs {int(concurrent)}")
        if not quick and "process_baseline_bytes" in rates.assumed_fields():
            return "partial", "no measured process baseline"
    elif shapes_differ(rates.shapes, shapes):
        return "partial", f"figures measured on other shapes ({rates.shapes}), the job's are {shapes}"
    elif dtype not in rates.flops_by_dtype:
        return "partial", f"no {dtype} figures"
    return "ok", "cached"


def _loadavg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@contextlib.contextmanager
def _locked(lock_path: Path, timeout: float):
    """An exclusive ``fcntl.flock`` on ``lock_path`` (created), polled for ``timeout`` seconds;
    yields True when held, False when the wait timed out (the caller proceeds unlocked)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        t_end = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() > t_end:
                    break
                time.sleep(0.1)
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def measure_for_job(kind: str, index: Optional[int], threads: int, dtype: str, *,
                    quick: bool = False, model_cfg=None, model_path: Optional[str] = None,
                    batch_seq: Optional[tuple[int, int]] = None,
                    modules: Optional[Sequence[str]] = None,
                    need_baseline: bool = True, concurrent: int = 1,
                    load: Optional[BackgroundLoad] = None) -> tuple[dict, Optional[int], dict]:
    """Measure the figures a job's plan needs for card kind ``kind`` at ``threads`` torch threads
    in ``dtype``: (rate fields as a ``by_threads`` entry, process baseline bytes (cpu with
    ``need_baseline``; ``None`` elsewhere or when it failed), details). Loop bounds
    :data:`~npu_train.planner.measure.AUTO` (``quick``: :data:`~npu_train.planner.measure.QUICK`
    and tiny sizes). ``concurrent`` (cpu): the job's card processes at once; ``concurrent - 1``
    helper processes run the same kind of work during the measured figures (module docstring).

    ``load``: the helpers (and baseline) :func:`start_early` started, used when they fit this
    measurement (:meth:`~npu_train.planner.loadgen.BackgroundLoad.fits`), else closed and started
    here. Either way every helper is stopped (killed on an error) before this returns or raises.
    The process baseline is measured by the first helper before the window opens, or (no
    helper) in its own subprocess: alongside the figures when the job leaves a core free, else
    before them.

    The entry holds ``"concurrent"`` and ``"shapes"`` (the layer and head measured); the details
    hold ``concurrent``, ``load_pids``, ``load_steps`` (each helper's steps per work),
    ``load_head_start_seconds`` (how long before this call :func:`start_early` started them),
    ``load_wait_seconds`` (seconds spent waiting for the helpers to be ready: what an early start
    did not hide), ``measure_seconds`` and ``seconds`` (wall seconds from this call to the end of
    the figures / of everything).

    Raises:
        RuntimeError: a helper process did not start (the figures are not measured)."""
    import torch

    from npu_train.backends import make_backend

    t0 = time.perf_counter()
    conc = max(1, int(concurrent)) if kind == "cpu" else 1
    details: dict = {"threads": int(threads), "dtype": dtype, "concurrent": conc}
    measure_baseline = kind == "cpu" and not quick and need_baseline
    if load is None or not load.fits(conc - 1, int(threads), measure_baseline):
        if load is not None:
            load.close()
        load = BackgroundLoad(conc - 1, threads=int(threads),
                              baseline=(model_path, modules) if measure_baseline else None)
    baseline = None
    old = torch.get_num_threads()
    if load.spawned_at is not None:  # started early: how long before this call
        details["load_head_start_seconds"] = round(time.monotonic() - load.spawned_at, 2)
    with load:  # the other card processes of the job, from before to after the figures
        backend = make_backend("cpu" if kind == "cpu" else f"{kind}:{int(index or 0)}")
        backend.setup()
        layer, head, _ = reference_shapes(kind, quick, model_cfg, batch_seq)
        spare_core = int(threads) * conc < usable_cores()
        load.give_work(dtype=dtype, layer=layer, head=head, adamw_params=200_000 if quick else AUTO_ADAMW_PARAMS)
        warm_imports()  # while the helpers build their work
        t_wait = time.perf_counter()
        load.wait_ready(baseline_first=not spare_core)
        details["load_wait_seconds"] = round(time.perf_counter() - t_wait, 2)
        try:
            torch.set_num_threads(int(threads))
            m = measure_at(kind, backend, quick, model_cfg, loop=QUICK if quick else AUTO,
                           dtypes=(dtype,), matmul=False, batch_seq=batch_seq,
                           adamw_params=None if quick else AUTO_ADAMW_PARAMS, on_phase=load.phase)
        finally:
            torch.set_num_threads(old)
        load.stop()
        details["measure_seconds"] = round(time.perf_counter() - t0, 2)
        if measure_baseline:
            try:
                baseline = load.baseline_bytes()
            except RuntimeError as exc:  # keep the rates; the baseline stays assumed
                details["process_baseline_error"] = str(exc)[:2000]
            details["process_baseline_in"] = ("load process" if load.n else
                                               "alongside" if spare_core else "before the figures")
    note_load(m)
    details.update(load_pids=load.pids, load_steps=load.steps, measured=m)
    details["seconds"] = round(time.perf_counter() - t0, 2)
    details["machine"] = machine_info(kind, backend)
    return dict(rate_fields(m), concurrent=conc, shapes=shape_signature(layer, head)), baseline, details


def _merged(kind: str, path: Path, status: str, entry: dict, threads: int,
            baseline: Optional[int]) -> tuple[Rates, list[str]]:
    """The profile's :class:`Rates` with ``entry`` (measured at ``threads``) merged in: a profile of
    this machine (``status`` ``"partial"``) keeps its other thread counts (each with its own
    ``concurrent`` and ``shapes``) and, at ``threads``, its other dtypes unless measured at another
    concurrency or on other (known) shapes than ``entry``; otherwise a new profile. The top level
    stays the largest measured count. Also returns the fields left at their assumed default."""
    keep = status == "partial"
    old = load_rates(kind, path) if keep else None
    t = int(threads) if kind == "cpu" else 0
    counts: dict[int, dict] = {}
    if old is not None:
        counts = {int(u): dict(e) for u, e in old.by_threads.items()}
        top = {k: getattr(old, k) for k in {*entry, "concurrent", "shapes"} if k != "flops_by_dtype"}
        counts[int(old.threads)] = dict(top, flops_by_dtype=dict(old.flops_by_dtype))
    prev = counts.get(t, {})
    if int(prev.get("concurrent", 1)) != int(entry.get("concurrent", 1)):
        prev = {}  # figures of another concurrency (e.g. another dtype's) no longer fit the count
    if shapes_differ(prev.get("shapes"), entry.get("shapes")):
        prev = {}  # nor figures of another model's shapes: ratios and all dtypes
    new = dict(prev, **entry)
    new["flops_by_dtype"] = {**prev.get("flops_by_dtype", {}), **entry["flops_by_dtype"]}
    counts[t] = new
    top_t = max(counts)
    top = counts.pop(top_t)
    assumed: list[str] = []
    if baseline is not None:
        base = float(baseline)
    elif old is not None and "process_baseline_bytes" not in old.assumed_fields():
        base = old.process_baseline_bytes
    else:
        base = DEFAULT_RATES[kind].process_baseline_bytes
        assumed.append("process_baseline_bytes")
    top.setdefault("concurrent", 1)  # an entry of a profile written before the field
    rates = Rates(**{k: v for k, v in top.items() if k != "flops_by_dtype"},
                  process_baseline_bytes=base, threads=top_t,
                  flops_by_dtype=dict(top["flops_by_dtype"]), by_threads=counts)
    return rates, assumed


def ensure_profile(kind: str, index: Optional[int] = None, *, threads: int, dtype: str,
                   mode: str = "auto", quick: bool = False, model_cfg=None,
                   model_path: Optional[str] = None, batch_seq: Optional[tuple[int, int]] = None,
                   modules: Optional[Sequence[str]] = None, path: Optional[Path] = None,
                   log=None, concurrent: int = 1, load: Optional[BackgroundLoad] = None) -> dict:
    """Make the calibration profile of ``kind`` at ``path`` (default
    :func:`~npu_train.planner.rates.calibration_path`) fit this machine and job (module docstring),
    measuring when it does not (``mode="auto"``) or always (``"always"``; ``"never"``: no-op).

    Args:
        threads, dtype: the job's torch threads per card process and compute dtype.
        quick: tiny sizes (tests); such a profile only satisfies quick runs.
        model_cfg / model_path: the job's model (layer and head shapes; the file the process
            baseline opens). batch_seq: the job's (micro-batch, sequence length).
        modules: the modules a card process imports (process baseline).
        log: where the one-line messages go (default: ``print`` with flush).
        concurrent: the job's card processes of this kind at once on this host (cpu:
            :func:`job_concurrency`; figures are measured and checked at it; elsewhere ignored).
        load: helpers :func:`start_early` started (passed to :func:`measure_for_job`); closed
            before this returns, used or not.

    Returns:
        ``{"path", "calibrated": bool, "why", "seconds"}`` (``seconds`` when measured).
    """
    with load if load is not None else contextlib.nullcontext():
        return _ensure(kind, index, threads=threads, dtype=dtype, mode=mode, quick=quick, model_cfg=model_cfg,
                       model_path=model_path, batch_seq=batch_seq, modules=modules, path=path, log=log,
                       concurrent=concurrent, load=load)


def _ensure(kind, index, *, threads, dtype, mode, quick, model_cfg, model_path, batch_seq, modules, path, log,
            concurrent, load) -> dict:
    """:func:`ensure_profile` without closing ``load``."""
    path = Path(path) if path is not None else calibration_path(kind)
    log = log or functools.partial(print, flush=True)
    if mode == "never":
        return {"path": str(path), "calibrated": False, "why": "placement.calibrate=never"}
    here = here_fingerprint(kind, index)
    conc = max(1, int(concurrent)) if kind == "cpu" else 1
    want = job_shapes(kind, quick, model_cfg, batch_seq)
    status, why = profile_status(path, kind, threads, dtype, quick=quick, here=here, concurrent=conc, shapes=want)
    if status == "ok" and mode == "auto":
        return {"path": str(path), "calibrated": False, "why": why}
    mtime = path.stat().st_mtime_ns if path.is_file() else None
    with _locked(path.with_name(path.name + ".lock"), LOCK_TIMEOUT_S) as held:
        if not held:
            log(f"warning: waited {LOCK_TIMEOUT_S:g} s for another launcher's calibration "
                f"({path}.lock); measuring without the lock")
        status, why = profile_status(path, kind, threads, dtype, quick=quick, here=here, concurrent=conc, shapes=want)
        changed = path.is_file() and path.stat().st_mtime_ns != mtime
        if status == "ok" and (mode == "auto" or changed):  # another launcher measured meanwhile
            return {"path": str(path), "calibrated": False, "why": "measured by another launcher"}
        if status == "corrupt":
            log(f"warning: calibration profile {path}: {why}; measuring it again")
        if mode == "always":
            why = "placement.calibrate=always"
        at_once = f", {conc} processes at once" if conc > 1 else ""
        log(f"calibrating {kind} ({why}{at_once}, ~{EXPECTED_SECONDS.get(kind, 15)} s; cached in {path})")
        avg, snap = _loadavg(), cpu_snapshot()
        entry, baseline, det = measure_for_job(kind, index, threads, dtype, quick=quick,
                                               model_cfg=model_cfg, model_path=model_path,
                                               batch_seq=batch_seq, modules=modules,
                                               need_baseline=needs_baseline(status, why, mode),
                                               concurrent=conc, load=load)
        rates, assumed = _merged(kind, path, status, entry, threads, baseline)
        details = {"machine": det.pop("machine"), "kind": kind, "quick": bool(quick),
                   "auto": det, "model": getattr(model_cfg, "name", None),
                   "assumed_fields": assumed}
        others = round(others_cores(snap, cpu_snapshot()), 2)
        details.update(loadavg_1_before=avg, others_cores=others)
        save_profile(kind, rates, path, details=details)
        if not quick and others > BUSY_OTHERS * usable_cores():
            log(f"warning: other processes used {others:.2f} of {usable_cores()} core(s) while "
                f"calibrating {kind}: its figures may be low and the plan's step time too long; "
                "rerun with placement.calibrate=always on a quiet machine")
    return {"path": str(path), "calibrated": True, "why": why, "seconds": det["seconds"]}


def needs_baseline(status: str, why: str, mode: str) -> bool:
    """Whether a calibration of a profile in ``status`` (:func:`profile_status`, with its
    ``why``) in ``mode`` measures the process baseline: adding a thread count or concurrency to
    this machine's profile (``"partial"``) keeps the baseline it has."""
    return status != "partial" or "baseline" in why or mode == "always"


def start_early(cards: Sequence, configured: str, *, threads: int, dtype: str,
                model_path: Optional[str] = None, modules: Optional[Sequence[str]] = None,
                quick: bool = False, path: Optional[Path] = None) -> Optional[BackgroundLoad]:
    """Start the cpu calibration's helper processes (and its process baseline) now, when
    :func:`auto_calibrate` will measure the cpu kind of ``cards`` (same arguments), so their
    start-up overlaps what the launcher does before it calibrates (reading the model); ``None``
    when it will not (a fitting profile, ``never``, no cpu card, or nothing to start). The
    helpers wait for their work (:meth:`~npu_train.planner.loadgen.BackgroundLoad.start`, called
    by :func:`measure_for_job` through ``auto_calibrate(..., early=)``). The caller closes the
    result on every path (a context manager); a helper whose launcher dies exits by itself.

    ``path``: the profile (default :func:`~npu_train.planner.rates.calibration_path`). The
    model is not read yet, so the profile's shapes are not checked (module docstring, "Shapes").

    Raises:
        ConfigError: an unknown mode.
    """
    mode = calibrate_mode(configured)
    quick = quick or getenv("CALIBRATE_QUICK") == "1"
    if mode == "never" or not any(c.kind == "cpu" for c in cards):
        return None
    conc = job_concurrency(cards, threads)
    path = Path(path) if path is not None else calibration_path("cpu")
    status, why = profile_status(path, "cpu", threads, dtype, quick=quick, concurrent=conc)
    if status == "ok" and mode == "auto":
        return None
    baseline = not quick and needs_baseline(status, why, mode)
    if conc == 1 and not baseline:
        return None
    load = BackgroundLoad(conc - 1, threads=int(threads), baseline=(model_path, modules) if baseline else None)
    load.spawn()
    return load


def auto_calibrate(cards: Sequence, configured: str, *, threads: int, dtype: str, model_cfg=None,
                   model_path: Optional[str] = None, batch_seq: Optional[tuple[int, int]] = None,
                   modules: Optional[Sequence[str]] = None, quick: bool = False,
                   early: Optional[BackgroundLoad] = None) -> list[dict]:
    """:func:`ensure_profile` for every distinct card kind of ``cards``
    (:class:`~npu_train.planner.spec.CardSpec`; the first card of a kind is measured) in the mode
    :func:`calibrate_mode` (``configured``) gives; ``quick`` (or ``$NPT_CALIBRATE_QUICK=1``, for
    tests): tiny sizes. ``cards``: every card of the job on this host (all data-parallel
    replicas): the cpu ones set the concurrency the cpu figures are measured at
    (:func:`job_concurrency`). ``early``: what :func:`start_early` started (the cpu kind's
    helpers; closed before this returns or raises). Returns one result dict per kind.

    Raises:
        ConfigError: an unknown mode.
    """
    with early if early is not None else contextlib.nullcontext():
        mode = calibrate_mode(configured)
        quick = quick or getenv("CALIBRATE_QUICK") == "1"  # tests: tiny sizes, a quick profile
        conc = job_concurrency(cards, threads)
        seen: dict = {}
        for c in cards:
            seen.setdefault(c.kind, c.index)
        return [ensure_profile(kind, idx, threads=threads, dtype=dtype, mode=mode, quick=quick,
                               model_cfg=model_cfg, model_path=model_path, batch_seq=batch_seq,
                               modules=modules, concurrent=conc, load=early if kind == "cpu" else None)
                for kind, idx in seen.items()]
