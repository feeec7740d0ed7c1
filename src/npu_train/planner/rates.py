"""Throughput figures of a card kind (:class:`Rates`) and where they come from: an explicit
``placement.profile``, figures fitted from finished runs (:func:`apply_fitted`), the ``calibrate=true``
profile (:func:`calibration_path`), the assumed :data:`DEFAULT_RATES`; :func:`load_rates` combines them.
The thread and shape rules: ``docs/planner.md``, section 3."""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from npu_train.env import cache_dir
from npu_train.hardware import GIB, KINDS
from npu_train.planner.spec import PlacementError

__all__ = ["Rates", "DEFAULT_RATES", "RATE_NUMBERS", "THREAD_SCALED", "HOST_THREAD_SCALED", "CONCURRENT_FIELDS",
           "calibration_path", "VOCAB_SHM_X_BYTES_PER_S", "VOCAB_SHM_SUM_BYTES_PER_S",
           "load_rates", "shapes_differ", "BUSY_SKIPPED", "reference_shapes", "shape_signature", "job_shapes"]

#: The plain numeric fields of :class:`Rates` (what a profile may set and ``by_threads`` override).
RATE_NUMBERS = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
                "device_adamw_params_per_s", "head_flops_ratio", "process_baseline_bytes",
                "dp_bytes_per_s", "split_backward_ratio", "host_bytes_per_s")
#: Fields that may be 0 (0 has a meaning: "same as host" / "no baseline").
RATE_MAY_BE_ZERO = ("device_adamw_params_per_s", "process_baseline_bytes")
#: Compute-bound fields scaled linearly with the thread count (:meth:`Rates.resolve`) of a ``cpu`` card (or a
#: :class:`Rates` of no known kind), whose compute and optimizer run on the host's cores.
THREAD_SCALED = ("device_flops", "host_adamw_params_per_s", "device_adamw_params_per_s")
#: What the host's thread count scales on an accelerator card: its host AdamW only (the card's own FLOP/s
#: and AdamW do not depend on the host threads; the host rate is capped by the host's memory bandwidth in
#: the cost model, ``CostModel.host_rates``).
HOST_THREAD_SCALED = ("host_adamw_params_per_s",)
#: Fields labelled with the processes that ran at once when measured (``concurrent`` > 1).
CONCURRENT_FIELDS = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
                     "device_adamw_params_per_s", "head_flops_ratio", "split_backward_ratio")


@dataclass
class Rates:
    """Throughput figures of one card kind and its host, for the step time, plus the card process's
    memory baseline (bytes); :meth:`resolve` gives the flat figures for one thread count and dtype."""

    device_flops: float  # sustained training FLOP/s of one card (forward + backward of decoder layers)
    h2d_bytes_per_s: float  # host -> card copies, B/s
    d2h_bytes_per_s: float  # card -> host copies, B/s
    host_adamw_params_per_s: float  # fp32 AdamW updates/s on the host, one process
    device_adamw_params_per_s: float = 0.0  # the card's AdamW; 0 = the host's (a cpu card's optimizer is)
    head_flops_ratio: float = 1.0  # FLOP/s of lm_head + loss relative to device_flops
    process_baseline_bytes: float = 0.0  # card memory of a card process before any model state (cpu: RSS)
    #: gloo collectives between a stage's replicas, B/s per process and direction; default 10 Gb/s Ethernet,
    #: an assumed floor for replicas on different nodes (loopback is usually faster)
    dp_bytes_per_s: float = 1.25e9
    #: seconds of forward + B + W (the zero-bubble split) over forward + one backward; 1.0 = the FLOP view
    split_backward_ratio: float = 1.0
    #: the host's memory bandwidth, B/s, shared by every card process on the host (caps the host AdamW of
    #: accelerator cards, which moves ~28-30 B/param: ``CostModel.host_rates``)
    host_bytes_per_s: float = 1e11
    threads: int = 0  # torch threads the figures are for (0 = unknown: no thread scaling)
    flops_by_dtype: dict = field(default_factory=dict)  # {"fp32": ..., "bf16": ...} FLOP/s per compute dtype
    by_threads: dict = field(default_factory=dict)  # {threads: {field: value}} measured at other counts
    sources: dict = field(default_factory=dict)  # field -> "measured" / "assumed" / "fitted ..." / "scaled ..."
    origin: str = ""  # the profile the measured figures come from, "<path> (<date>)"
    concurrent: int = 1  # processes that ran the same work at once while the figures were measured
    shapes: str = ""  # the layer and head shapes the figures were measured on ("": unknown, fits any)
    kind: str = ""  # the card kind ("": unknown: every THREAD_SCALED figure scales with the threads)

    def source(self, name: str) -> str:
        """Where field ``name``'s figure comes from (default ``"assumed"``)."""
        return str(self.sources.get(name, "assumed"))

    def assumed_fields(self) -> list[str]:
        """The :data:`RATE_NUMBERS` fields whose figure is assumed (not measured)."""
        return [k for k in RATE_NUMBERS if self.source(k).startswith("assumed")]

    @property
    def device_adamw(self) -> float:
        """``device_adamw_params_per_s``, or the host figure when that is 0."""
        return self.device_adamw_params_per_s or self.host_adamw_params_per_s

    def flops(self, dtype: str) -> float:
        """Sustained FLOP/s for compute dtype ``dtype`` (``flops_by_dtype`` or ``device_flops``)."""
        return float(self.flops_by_dtype.get(dtype, self.device_flops))

    def thread_scaled(self) -> tuple:
        """The figures :meth:`resolve` scales with the thread count: :data:`THREAD_SCALED` on a ``cpu`` card
        (or no known kind), :data:`HOST_THREAD_SCALED` on an accelerator card."""
        return THREAD_SCALED if self.kind in ("", "cpu") else HOST_THREAD_SCALED

    def measured_threads(self) -> list[int]:
        """Thread counts with measured figures: ``threads`` (when known) and ``by_threads``'s keys."""
        counts = {int(t) for t in self.by_threads}
        if self.threads:
            counts.add(int(self.threads))
        return sorted(counts)

    def concurrent_at(self, t: int) -> int:
        """Processes at once behind the figures measured at ``t`` threads."""
        entry = self.by_threads.get(t, self.by_threads.get(str(t)))
        if isinstance(entry, dict) and int(t) != int(self.threads):
            return int(entry.get("concurrent", 1))
        return int(self.concurrent)

    def shapes_at(self, t: int) -> str:
        """The shapes behind the figures measured at ``t`` threads (``""``: unknown)."""
        entry = self.by_threads.get(t, self.by_threads.get(str(t)))
        if isinstance(entry, dict) and int(t) != int(self.threads):
            return str(entry.get("shapes", ""))
        return str(self.shapes)

    def _figures_at(self, t: int) -> tuple[dict, dict]:
        """(numeric fields, flops_by_dtype) measured at ``t`` threads (``t`` must be measured)."""
        base = {k: float(getattr(self, k)) for k in RATE_NUMBERS}
        by_dtype = dict(self.flops_by_dtype)
        entry = self.by_threads.get(t, self.by_threads.get(str(t)))
        if isinstance(entry, dict) and t != self.threads:
            for k in RATE_NUMBERS:
                if k in entry:
                    base[k] = float(entry[k])
            if isinstance(entry.get("flops_by_dtype"), dict):
                by_dtype = {str(d): float(v) for d, v in entry["flops_by_dtype"].items()}
            elif "device_flops" in entry:
                by_dtype = {}  # the top level's per-dtype figures belong to another count
        return base, by_dtype

    def resolve(self, dtype: Optional[str] = None, threads: Optional[int] = None) -> "Rates":
        """Flat rates for one card process running ``threads`` torch threads, in ``dtype``: the figures
        measured at that count, else the nearest measured count's with :meth:`thread_scaled` figures times
        ``threads / count`` (an accelerator card's own FLOP/s never), else (no count known) unchanged;
        ``by_threads`` empty in the result."""
        t = int(threads) if threads else 0
        counts = self.measured_threads()
        sources = dict(self.sources)
        if t and counts:
            c = t if t in counts else min(counts, key=lambda u: (abs(u - t), -u))
            base, by_dtype = self._figures_at(c)
            if c != t:
                f = t / c
                scaled = self.thread_scaled()
                for k in scaled:
                    base[k] *= f
                    sources[k] = f"{self.source(k)}, scaled from {c} thread(s)"
                if "device_flops" in scaled:
                    by_dtype = {d: v * f for d, v in by_dtype.items()}
            out_t = t
            conc, shapes = self.concurrent_at(c), self.shapes_at(c)
        else:
            base, by_dtype = self._figures_at(self.threads) if self.threads else (
                {k: float(getattr(self, k)) for k in RATE_NUMBERS}, dict(self.flops_by_dtype))
            out_t = self.threads
            conc, shapes = int(self.concurrent), self.shapes
        if conc > 1:
            for k in CONCURRENT_FIELDS:
                src = sources.get(k, "")
                if src.startswith("measured") and "at once" not in src:
                    sources[k] = src.replace("measured", f"measured, {conc} processes at once", 1)
        if dtype is not None and dtype in by_dtype:
            base["device_flops"] = float(by_dtype[dtype])
            if f"device_flops[{dtype}]" in sources:  # fitted for this dtype (apply_fitted)
                sources["device_flops"] = sources[f"device_flops[{dtype}]"]
        elif dtype is not None and by_dtype and sources.get("device_flops"):
            sources["device_flops"] += f" for {'/'.join(sorted(by_dtype))}, not {dtype}"
        return Rates(**base, threads=out_t, flops_by_dtype=by_dtype, sources=sources,
                     origin=self.origin, concurrent=conc, shapes=shapes, kind=self.kind)


#: Uncalibrated defaults (``calibrate`` writes measured ones, see :func:`load_rates`).
#:
#: - furiosa: RNGD spec sheet 512 TFLOPS FP8 / 256 TFLOPS BF16; 0.4 assumed utilization.
#:   h2d 6e9 B/s as measured on an earlier RNGD deployment (one 117 MB upload: ``shared/DESIGN.md`` section 4);
#:   d2h assumed equal. The link's ceiling is far above it: RNGD's host interface is PCIe Gen5 x16
#:   (FuriosaAI, developer.furiosa.ai "FuriosaAI RNGD" overview), 32 GT/s x 16 lanes x 128/130 / 8 = 63.0 GB/s
#:   per direction (PCI-SIG PCIe 5.0); 6 GB/s is kept as the only figure measured through a card's runtime
#:   (these copies are pageable and synchronous: ``transport/channel.py``), so the stage-boundary and vocabulary
#:   copies it prices (``CostModel.boundary_copies``) are not under-counted; ``calibrate=true`` measures it.
#:   ``dp_bytes_per_s`` (gloo) stays at the 10 GbE floor, 1.25e9: gloo between two card processes of one host
#:   goes over TCP loopback, measured 0.65 GB/s (16 MiB, ``experiments/bench/transport.py``, this project's
#:   shared 2-core VM, 2026-12-06) to 1.73 GB/s (2026-11-30 record) with a one-process copy at 4.9 GB/s in the
#:   same run, so no faster same-host figure is measured (``experiments/2026-12-06-eight-cards.md`` section 12).
#:   Device AdamW (unfused, one tensor at a time) 1e10 params/s assumed.
#: - cuda: H100/H200-class 989 TFLOPS dense BF16 * 0.4 assumed; 25e9 B/s PCIe Gen5 pinned copies;
#:   fused device AdamW 5e10 params/s (HBM-bound, ~28 B moved per param).
#: - cpu: 50 GFLOP/s per process; copies are memcpy (~10e9 B/s); process baseline 0.15 GiB: a card process's
#:   RssAnon + RssShmem before its load (python + torch + npu_train + gloo/ZeroMQ), measured 0.145 GiB in every
#:   card of the issue-43 runs (what it gains with its load and first step is the cpu workspace constant,
#:   ``memterms.CPU_RUNTIME_BYTES``); the card's optimizer is the host AdamW.
#: - host AdamW of an accelerator card's offloaded layers (the one-pass update, npu_train.optim.onepass):
#:   1e9 params/s per host thread, assumed: 1.56e9 measured on one core of a 2-core Xeon VM (issue 39),
#:   rounded down for the lower clocks of a many-core server; scaled by the threads per card process
#:   (``threads=1``) and capped by the host memory bandwidth shared by the host's card processes
#:   (``host_bytes_per_s``, assumed 1e11 B/s: one server socket's DDR4/DDR5, well below its peak).
#: - cpu cards: host AdamW 2e8 params/s per process (assumed, fp32, multi-threaded torch).
#: Vocabulary parallelism's exchange through shared memory (``runtime.vocab_exchange=shm``,
#: ``pipeline/vocabshm.py``), B/s for one ``[b S, H]`` tensor, every card kind (host memory copies):
#: ``VOCAB_SHM_X_BYTES_PER_S``, the hidden state from the head until every card can compute on it (written once
#: into /dev/shm, read in place; independent of P), and ``VOCAB_SHM_SUM_BYTES_PER_S``, the partial input gradients
#: written into the cards' slots and summed on the head, at P = 2 (the head reads P partials: the planner takes
#: ``P / 2`` times as long). Measured, medians of 3 rounds: ``experiments/bench/vocab_exchange.py --P 2 4 --mib 16``
#: on this project's shared 2-vCPU VM, load average 9.6-10.8 (2026-12-07, ``experiments/bench/results/
#: 2026-12-07-vocab-exchange-p2-p4.txt``; gloo over TCP loopback 0.96 / 0.40 GB/s in the same run): a floor, not
#: an RNGD server's figure (``experiments/rngd-runbook.md`` step 5c measures one there).
VOCAB_SHM_X_BYTES_PER_S = 3.47e9
VOCAB_SHM_SUM_BYTES_PER_S = 1.32e9
_RNGD_H2D = "assumed: measured on an earlier RNGD deployment, not this machine"
_HOST_ADAMW = "assumed: 2e8, multi-threaded torch"
_HOST_ONEPASS = "assumed: 1e9 per thread for the one-pass update, 1.56e9 measured on one core of a 2-core VM"
_HOST_BW = "assumed: one server socket"
DEFAULT_RATES: dict[str, Rates] = {
    "furiosa": Rates(device_flops=256e12 * 0.4, h2d_bytes_per_s=6e9, d2h_bytes_per_s=6e9,
                     host_adamw_params_per_s=1e9, device_adamw_params_per_s=1e10, threads=1, kind="furiosa",
                     sources={"device_flops": "assumed: spec 256 TFLOPS bf16 x 0.4",
                              "h2d_bytes_per_s": _RNGD_H2D, "d2h_bytes_per_s": "assumed: = h2d",
                              "host_adamw_params_per_s": _HOST_ONEPASS, "host_bytes_per_s": _HOST_BW}),
    "cuda": Rates(device_flops=989e12 * 0.4, h2d_bytes_per_s=25e9, d2h_bytes_per_s=25e9,
                  host_adamw_params_per_s=1e9, device_adamw_params_per_s=5e10, threads=1, kind="cuda",
                  sources={"device_flops": "assumed: H100 989 TFLOPS bf16 x 0.4",
                           "h2d_bytes_per_s": "assumed: PCIe Gen5", "d2h_bytes_per_s": "assumed: PCIe Gen5",
                           "host_adamw_params_per_s": _HOST_ONEPASS, "host_bytes_per_s": _HOST_BW}),
    "cpu": Rates(device_flops=50e9, h2d_bytes_per_s=10e9, d2h_bytes_per_s=10e9,
                 host_adamw_params_per_s=2e8, process_baseline_bytes=0.15 * GIB, kind="cpu"),
}


def calibration_path(kind: str) -> Path:
    """Default calibration profile of ``kind``: ``cache_dir("calibration") / "<kind>.json"``
    (``$NPT_CACHE/calibration/<kind>.json``, default ``~/.cache/npu-train/calibration/``)."""
    return cache_dir("calibration") / f"{kind}.json"


def _bad_profile(path: Path, what: str) -> PlacementError:
    return PlacementError(f"calibration profile {path}: {what}; fix: recalibrate "
                          f"(calibrate=true) or remove the file to use the defaults")


def _profile_number(path: Path, key: str, value, may_be_zero: bool) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise _bad_profile(path, f"{key}={value!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not may_be_zero):
        raise _bad_profile(path, f"{key}={value!r} must be " + (">= 0" if may_be_zero else "> 0"))
    return v


def _profile_doc(path: Path) -> tuple[dict, str, list]:
    """(the rates object, its origin text, fields it marks assumed) of the profile at ``path``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _bad_profile(path, f"unreadable ({exc})") from exc
    assumed: list = []
    if isinstance(data, dict) and isinstance(data.get("rates"), dict):
        created = data.get("created") or (data.get("machine") or {}).get("date") or "undated"
        origin = f"{path} ({created})"
        det = data.get("details")
        assumed = det.get("assumed_fields") or [] if isinstance(det, dict) else []
        data = data["rates"]
    else:
        origin = f"{path} (hand-written)"
    if not isinstance(data, dict):
        raise _bad_profile(path, "not a JSON object")
    return data, origin, assumed


def _thread_entry(path: Path, t, entry) -> dict:
    """One checked ``by_threads`` entry of the profile at ``path``."""
    if not isinstance(entry, dict):
        raise _bad_profile(path, f"by_threads.{t} is not an object")
    e = {k: _profile_number(path, f"by_threads.{t}.{k}", entry[k], k in RATE_MAY_BE_ZERO)
         for k in RATE_NUMBERS if k in entry}
    if isinstance(entry.get("flops_by_dtype"), dict):
        e["flops_by_dtype"] = {str(dt): _profile_number(path, f"by_threads.{t}.flops_by_dtype.{dt}", v, False)
                               for dt, v in entry["flops_by_dtype"].items()}
    if "concurrent" in entry:
        e["concurrent"] = max(1, int(_profile_number(path, f"by_threads.{t}.concurrent", entry["concurrent"], False)))
    if isinstance(entry.get("shapes"), str):
        e["shapes"] = entry["shapes"]
    return e


def load_rates(kind: str, profile_path: Union[str, os.PathLike, None] = None, *,
               threads: Optional[int] = None, model_shape: Optional[str] = None, head: bool = False) -> Rates:
    """Rates for ``kind``: :data:`DEFAULT_RATES` overridden by the profile at ``profile_path`` (``None``:
    :func:`calibration_path`; a missing file gives the defaults) and, without an explicit profile, by the
    figures fitted from finished runs (of ``model_shape`` only, when given: :func:`~npu_train.planner.fit.shape_key`).
    ``threads``: resolved for that many torch threads per card
    process (``None``: the whole profile, unresolved); ``head``: for the card holding the lm_head (its own fitted
    process baseline, :func:`apply_fitted`). The profile is a JSON object of :class:`Rates` fields
    (top level or under ``"rates"``), as :func:`npu_train.calibrate.save_profile` writes it.

    Raises:
        ValueError: unknown ``kind``.
        PlacementError: the profile is unreadable or malformed."""
    if kind not in DEFAULT_RATES:
        raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")
    d = DEFAULT_RATES[kind]
    values = {k: getattr(d, k) for k in RATE_NUMBERS}
    n_threads, by_dtype, by_threads = d.threads, dict(d.flops_by_dtype), dict(d.by_threads)
    concurrent, shapes = d.concurrent, d.shapes
    path = Path(profile_path) if profile_path is not None else calibration_path(kind)
    sources, origin = dict(d.sources), ""
    if path.is_file():
        data, origin, assumed = _profile_doc(path)
        for k in values:
            if k in data:
                values[k] = _profile_number(path, k, data[k], k in RATE_MAY_BE_ZERO)
                sources[k] = "assumed (profile)" if k in assumed else "measured"
        # a profile's figures are for its own thread count (none given: unknown, not the defaults' 1)
        n_threads = int(_profile_number(path, "threads", data["threads"], True)) if "threads" in data else 0
        if "concurrent" in data:
            concurrent = max(1, int(_profile_number(path, "concurrent", data["concurrent"], False)))
        if isinstance(data.get("shapes"), str):
            shapes = data["shapes"]
        if isinstance(data.get("flops_by_dtype"), dict):
            by_dtype = {str(dt): _profile_number(path, f"flops_by_dtype.{dt}", v, False)
                        for dt, v in data["flops_by_dtype"].items()}
        if isinstance(data.get("by_threads"), dict):
            by_threads = {int(t): _thread_entry(path, t, e) for t, e in data["by_threads"].items()}
    rates = Rates(**values, threads=n_threads, flops_by_dtype=by_dtype, by_threads=by_threads,
                  sources=sources, origin=origin, concurrent=concurrent, shapes=shapes, kind=kind)
    if threads is None:
        return rates
    rates = rates.resolve(threads=threads)
    return rates if profile_path is not None else apply_fitted(rates, kind, int(threads), model_shape=model_shape,
                                                               head=head)


#: ``Rates.sources`` key (no field of its own) saying how many finished runs on a busy host were left out of the
#: fitted speed when none of it was fitted (where a figure was, its own label says it: :func:`_runs_label`)
BUSY_SKIPPED = "busy runs"


def _busy_text(busy: int) -> str:
    return f"{busy} busy run{'s' if busy != 1 else ''} skipped"


def _runs_label(n: int, busy: int = 0) -> str:
    """``"fitted from 3 runs"``, with ``"; 2 busy runs skipped"`` for runs on a busy host left out."""
    return f"fitted from {n} run{'s' if n != 1 else ''}" + (f"; {_busy_text(busy)}" if busy else "")


def apply_fitted(rates: Rates, kind: str, threads: int, root: Optional[Path] = None,
                 model_shape: Optional[str] = None, head: bool = False) -> Rates:
    """``rates`` (flat, for ``threads``) with the figures fitted from finished runs of ``kind``
    (:mod:`npu_train.planner.fit`): per-dtype FLOP/s, the AdamW rate, and a cpu process baseline only where it
    is larger (the plan stays an upper bound); ``head``: the card holding the lm_head takes the baseline fitted
    on head cards instead (its plan at its measured peak / ``planner.fit.HEAD_FIT``; the other cards' shortfall
    says nothing of it), also only where it is larger than the unfitted baseline (``rates``' own): a fitted
    baseline never plans a card below what the process holds before the model arrives. ``model_shape``: only runs of that
    :func:`~npu_train.planner.fit.shape_key` count (None: every run). Runs on a busy host give no speed
    (:func:`~npu_train.planner.fit.fitted_figures`); the label of a fitted speed counts them
    (``"fitted from 3 runs; 2 busy runs skipped"``), and where they were the only ones ``sources[BUSY_SKIPPED]``
    does. A broken file is one warning line."""
    from npu_train.planner.fit import fitted_figures, fitted_path, read_runs

    folder = fitted_path(kind, threads, "x", root).parent
    every: list = []
    for path in sorted(folder.glob(f"{kind}-{int(threads)}t-*.json")) if folder.is_dir() else []:
        try:
            runs = read_runs(path)
        except (OSError, ValueError) as exc:
            print(f"warning: {path}: {exc}; its fitted figures are not used (delete it to start again)",
                  file=sys.stderr, flush=True)
            continue
        if model_shape is not None:
            runs = [r for r in runs if r.get("model_shape") == model_shape]
        every += runs
        fit = fitted_figures(runs)
        if fit.device_flops:
            dtype = path.stem.rsplit("-", 1)[-1]
            rates.flops_by_dtype[dtype] = fit.device_flops
            rates.sources[f"device_flops[{dtype}]"] = _runs_label(fit.flops_runs, fit.busy_runs)
    fit = fitted_figures(every)
    if fit.adamw_params_per_s:
        rates.host_adamw_params_per_s = fit.adamw_params_per_s
        rates.sources["host_adamw_params_per_s"] = _runs_label(fit.adamw_runs, fit.busy_runs)
        if kind == "cpu":
            rates.device_adamw_params_per_s = 0.0  # the card's AdamW is the host's
    elif fit.busy_runs:  # every run with a speed was busy: the plan's speed is not fitted, and says why
        rates.sources[BUSY_SKIPPED] = _busy_text(fit.busy_runs)
    if kind == "cpu" and head:
        # the head card's own figure (never another card's shortfall), and like every card's only where it is
        # larger: a run whose other terms over-counted fits a baseline below the process's RSS before the model
        # arrives (0 in the MoE done-when run, experiments/2026-12-06-moe.md), which the unfitted one bounds
        if fit.head_baseline_bytes is not None and fit.head_baseline_bytes > rates.process_baseline_bytes:
            rates.process_baseline_bytes = fit.head_baseline_bytes
            rates.sources["process_baseline_bytes"] = _runs_label(fit.head_runs) + " (head card)"
    elif kind == "cpu" and fit.process_baseline_bytes and fit.process_baseline_bytes > rates.process_baseline_bytes:
        rates.process_baseline_bytes = fit.process_baseline_bytes
        rates.sources["process_baseline_bytes"] = _runs_label(fit.baseline_runs)
    return rates


def shapes_differ(have: Optional[str], want: Optional[str]) -> bool:
    """Whether figures measured on shapes ``have`` do not fit a job on ``want`` (both known and different)."""
    return bool(have) and bool(want) and str(have) != str(want)


# reference decoder layer for the training-FLOP/s measurement: (hidden, intermediate, heads,
# kv_heads, micro_batch, seq_len) per kind; cpu is Llama-like at 256 tokens per micro-batch (the
# default job's b*s), accelerators a Llama-3.1-8B layer at S=512.
_LAYER = {
    "cpu": (1024, 2816, 16, 4, 2, 128),
    "cuda": (4096, 14336, 32, 8, 1, 512),
    "furiosa": (4096, 14336, 32, 8, 1, 512),
}
_LAYER_QUICK = (128, 352, 4, 2, 1, 32)
# reference lm_head (vocab, hidden) when no model is given
_HEAD = {"cpu": (32000, 1024), "cuda": (128256, 4096), "furiosa": (128256, 4096)}
_HEAD_QUICK = (1000, 128)
# most FLOPs one repetition of the layer / head benchmark may take (the model's own dims are used
# when they fit, else the reference ones): ~0.2 s on one CPU core, milliseconds on accelerators
_FLOP_BUDGET = {"cpu": 20e9, "cuda": 2e12, "furiosa": 2e12}


def reference_shapes(kind: str, quick: bool, model_cfg,
                     batch_seq: Optional[tuple[int, int]] = None) -> tuple[tuple, tuple, str]:
    """(layer dims, (vocab, hidden, tokens) of the head, description) for the FLOP/s benchmarks: the
    model's own layer and head when one repetition stays within the kind's FLOP budget, else the reference
    ones; ``batch_seq``: the job's (micro-batch, sequence length), halved until the layer fits the budget."""
    if quick:
        H, I, a, kv, b, S = _LAYER_QUICK
        return _LAYER_QUICK, (_HEAD_QUICK[0], _HEAD_QUICK[1], b * S), "quick"
    H, I, a, kv, b, S = _LAYER[kind]
    if batch_seq is not None:
        b, S = max(1, int(batch_seq[0])), max(2, int(batch_seq[1]))
    if model_cfg is not None and batch_seq is not None:
        while 6.0 * b * S * model_cfg.params_per_layer() > _FLOP_BUDGET[kind] and b * S > 2:
            b, S = (b // 2, S) if b > 1 else (b, max(2, S // 2))
    tok = b * S
    layer, head, what = (H, I, a, kv, b, S), (_HEAD[kind][0], _HEAD[kind][1], tok), "reference"
    if model_cfg is not None:
        m = model_cfg
        if 6.0 * tok * m.params_per_layer() <= _FLOP_BUDGET[kind] and m.head_dim * m.num_heads > 0:
            layer = (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads, b, S)
            what = f"model {m.name}"
        if 6.0 * tok * m.vocab_size * m.hidden_size <= 4 * _FLOP_BUDGET[kind]:
            head = (m.vocab_size, m.hidden_size, tok)
    return layer, head, what


def shape_signature(layer: tuple, head: tuple) -> str:
    """The profile's ``shapes`` text, e.g. ``"layer 576x1536 heads 9/3, head 49152x576"``."""
    H, I, a, kv = (int(x) for x in layer[:4])
    return f"layer {H}x{I} heads {a}/{kv}, head {int(head[0])}x{int(head[1])}"


def job_shapes(kind: str, quick: bool, model_cfg, batch_seq: Optional[tuple[int, int]] = None) -> str:
    """:func:`shape_signature` of the shapes ``calibrate=true`` measures for a job."""
    layer, head, _ = reference_shapes(kind, quick, model_cfg, batch_seq)
    return shape_signature(layer, head)
