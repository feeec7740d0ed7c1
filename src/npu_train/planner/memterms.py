"""The memory model's per-kind constants (:class:`MemoryTerms`: workspace constant and fraction,
loaded-module cache) with the source of each (:data:`DEFAULT_MEMORY_TERMS`; measured, fitted, assumed:
``docs/planner.md``, section 1), and the ``"memory"`` object of a calibration profile that overrides them."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence, Union

from npu_train.hardware import GIB
from npu_train.planner.spec import PlacementError

__all__ = ["MemoryTerms", "DEFAULT_MEMORY_TERMS", "MEMORY_FIELDS", "load_memory_terms",
           "fit_memory_terms", "save_memory_terms"]

MIB = 1 << 20
#: the numeric fields of :class:`MemoryTerms` a profile's ``"memory"`` object may set
MEMORY_FIELDS = ("workspace_bytes", "workspace_fraction", "module_bytes", "loaded_modules", "heap_fraction")


@dataclass(frozen=True)
class MemoryTerms:
    """Per-kind constants of the memory model: ``workspace = workspace_bytes + workspace_fraction * body +
    heap_fraction * churn + loaded_modules * module_bytes`` (body = weights + grads + optimizer + activations
    + transient; churn = ``MemoryModel.hole_churn``, the memory a backward frees and the next forward requests
    again in other pieces)."""

    workspace_bytes: float  # runtime / library buffers per card, bytes
    workspace_fraction: float  # allocator slack and unmodelled temporaries, fraction of the body
    module_bytes: float = 0.0  # card memory of one loaded compiled module, bytes (furiosa eager cache)
    loaded_modules: int = 0  # loaded-module cache entries the card process keeps (0: no such cache)
    #: freed card memory the allocator keeps resident between reuses (holes in glibc's heap on a ``cpu``
    #: card that reuses freed host memory, npu_train.hostmem), fraction of the churn
    #: (``MemoryModel.hole_churn``: with the card's heap guard, one micro-batch's decoder-layer activations + 2
    #: layers'; without, the layers' activations in flight)
    heap_fraction: float = 0.0
    sources: dict = field(default_factory=dict)  # field -> "assumed" / "fitted: ..." / "measured: <profile>"

    @property
    def modules_bytes(self) -> int:
        """Bytes of the loaded-module cache: ``loaded_modules * module_bytes``."""
        return int(self.loaded_modules * self.module_bytes)

    def workspace(self, body: float, churn: float = 0.0) -> int:
        """``workspace_bytes + workspace_fraction * body + heap_fraction * churn + modules_bytes``, bytes."""
        return int(self.workspace_bytes + self.workspace_fraction * body + self.heap_fraction * churn
                   + self.modules_bytes)

    def describe(self) -> str:
        """One line: each figure with its source, for the plan; a constant of 0 whose source says why is left
        out, and the heap's share says in plain words what it holds."""
        parts = []
        if self.workspace_bytes or not str(self.sources.get("workspace_bytes", "")).startswith("none"):
            parts.append(f"{self.workspace_bytes / GIB:.2f} GiB ({self.sources.get('workspace_bytes', 'assumed')})")
        parts.append(f"{self.workspace_fraction * 100:.0f}% of the rest "
                     f"({self.sources.get('workspace_fraction', 'assumed')})")
        if self.heap_fraction:
            amount = "a micro-batch's layer activations + 2.5 layers' + 32 MiB"
            amount = amount if self.heap_fraction == 1 else f"{self.heap_fraction:g} x ({amount})"
            parts.append(f"freed memory the heap keeps, at most {amount} "
                         f"({self.sources.get('heap_fraction', 'assumed')})")
        elif "heap_fraction" in self.sources:  # say why a card that could keep freed memory plans none
            parts.append(f"no freed memory kept ({self.sources['heap_fraction']})")
        if self.loaded_modules:
            parts.append(f"loaded-module cache {self.loaded_modules} x {self.module_bytes / MIB:.1f} MiB "
                         f"({self.sources.get('loaded_modules', 'assumed')}; "
                         f"{self.sources.get('module_bytes', 'assumed')})")
        return ", ".join(parts)


#: a cpu card process's runtime state beyond its start and its model state (``MemoryTerms.workspace_bytes`` of
#: ``cpu``): measured 0.093-0.101 GiB at rest after the first step (RssAnon + RssShmem less the pre-load RSS, the
#: weights and the optimizer's state), the same on a 0.13 B LoRA and a 0.63 B full fine-tuning card; 0.066-0.075
#: of it from the load on
CPU_RUNTIME_BYTES = int(0.10 * GIB)
CPU_RUNTIME_SOURCE = "the process's threads and objects, measured"
_FIELD = "fitted to the field record: 1 card x 4 resident layers ran on an earlier RNGD deployment"
DEFAULT_MEMORY_TERMS: dict[str, MemoryTerms] = {
    # const: what a card process holds beyond its start (the process baseline) and its model state once it has
    # loaded and run a step: its threads' stacks and malloc arenas (gloo, ZeroMQ, torch), the built stage's
    # Python objects, the first operations' state (experiments/2026-12-06-plan-bound.md, "The load term's baseline")
    "cpu": MemoryTerms(CPU_RUNTIME_BYTES, 0.04, heap_fraction=1.0,
                       sources={"workspace_bytes": CPU_RUNTIME_SOURCE,
                                "workspace_fraction": "measured: 4 jobs of 0.14-1.24 B params",
                                "heap_fraction": "a guard returns the rest after each backward"}),
    "cuda": MemoryTerms(1 * GIB, 0.05, sources={"workspace_bytes": "assumed",
                                                "workspace_fraction": "assumed"}),
    "furiosa": MemoryTerms(0.5 * GIB, 0.02, 1 * MIB, 512,
                           sources={"workspace_bytes": "assumed", "workspace_fraction": _FIELD,
                                    "module_bytes": "assumed", "loaded_modules": "assumed"}),
}


def _bad(path: Path, what: str) -> PlacementError:
    return PlacementError(f"calibration profile {path}: memory: {what}; fix: rerun the memory "
                          f"calibration (experiments/rngd-runbook.md) or remove the 'memory' entry")


def load_memory_terms(kind: str, profile_path: Union[str, os.PathLike, None] = None,
                      loaded_modules: Optional[int] = None, reuse_freed_memory: bool = True) -> MemoryTerms:
    """:data:`DEFAULT_MEMORY_TERMS` of ``kind``, overridden by the ``"memory"`` object of the profile at
    ``profile_path`` (``None``: ``calibration_path(kind)``; missing: the defaults) and by a configured
    ``loaded_modules`` (``runtime.furiosa.loaded_modules``); ``reuse_freed_memory=False``
    (``runtime.keep_host_memory=false``: a card process returns freed blocks to the OS) sets ``heap_fraction``
    to 0. Raises ``PlacementError`` for a malformed ``"memory"`` object (not an object, a negative or
    non-finite number, a workspace fraction >= 1)."""
    from npu_train.planner.rates import calibration_path

    terms = DEFAULT_MEMORY_TERMS[kind]
    path = Path(profile_path) if profile_path is not None else calibration_path(kind)
    values, sources = {}, dict(terms.sources)
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = None  # load_rates reports an unreadable profile
        mem = doc.get("memory") if isinstance(doc, dict) else None
        if mem is not None:
            if not isinstance(mem, dict):
                raise _bad(path, "not a JSON object")
            for k in MEMORY_FIELDS:
                if k not in mem:
                    continue
                try:
                    v = float(mem[k])
                except (TypeError, ValueError):
                    raise _bad(path, f"{k}={mem[k]!r} is not a number") from None
                if not math.isfinite(v) or v < 0 or (k == "workspace_fraction" and v >= 1):
                    raise _bad(path, f"{k}={mem[k]!r} out of range")
                values[k] = int(v) if k == "loaded_modules" else v
                sources[k] = f"measured: {path}"
    if loaded_modules is not None and loaded_modules > 0:
        values["loaded_modules"] = int(loaded_modules)
        sources["loaded_modules"] = "configured"
    if not reuse_freed_memory and values.get("heap_fraction", terms.heap_fraction):
        values["heap_fraction"] = 0.0
        sources["heap_fraction"] = "runtime.keep_host_memory=false: freed blocks returned"
    return replace(terms, **values, sources=sources)


def fit_memory_terms(samples: Sequence[tuple[float, float]], base: MemoryTerms) -> MemoryTerms:
    """``base`` with ``workspace_bytes`` and ``workspace_fraction`` fitted to ``samples`` = (body bytes,
    measured peak bytes) per card: the least-squares line ``peak - modules = c + f * body`` (two or more
    distinct bodies; ``c, f >= 0``), else the constant at ``base``'s fraction. Raises ``ValueError`` for no samples."""
    if not samples:
        raise ValueError("fit_memory_terms needs at least one (body, peak) sample")
    mods = base.modules_bytes
    xs = [float(b) for b, _ in samples]
    ys = [float(p) - mods for _, p in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n >= 2 and sxx > 0:
        f = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx)
        c = max(0.0, my - f * mx)
    else:
        f = base.workspace_fraction
        c = max(0.0, max(y - f * x for x, y in zip(xs, ys)))
    src = dict(base.sources)
    src["workspace_bytes"] = f"measured: {n} peak(s)"
    if n >= 2 and sxx > 0:
        src["workspace_fraction"] = f"measured: {n} peak(s)"
    return replace(base, workspace_bytes=c, workspace_fraction=min(f, 0.99), sources=src)


def save_memory_terms(kind: str, terms: MemoryTerms, samples: Sequence[dict],
                      path: Union[str, os.PathLike, None] = None) -> Path:
    """Write ``terms`` (and the ``samples`` behind them) as the ``"memory"`` object of ``kind``'s calibration
    profile, keeping its rates; atomic. Returns the path."""
    from npu_train.planner.rates import calibration_path

    path = Path(path) if path is not None else calibration_path(kind)
    doc: dict = {}
    if path.is_file():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            doc = {}
        if not isinstance(doc, dict):
            doc = {}
    doc.setdefault("kind", kind)
    doc["memory"] = {"workspace_bytes": int(terms.workspace_bytes),
                     "workspace_fraction": float(terms.workspace_fraction),
                     "module_bytes": int(terms.module_bytes),
                     "loaded_modules": int(terms.loaded_modules),
                     "samples": list(samples)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    os.replace(tmp, path)
    return path
