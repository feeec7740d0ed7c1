"""Compiled execution on RNGD: compiler cache, loaded-module cache size, CPU fallback counting, free-memory
probe (:class:`FuriosaCompileOptions`; start at :func:`apply_compile_options`). Functions take the
imported ``furiosa.torch`` module (tests pass a fake). API facts: docs/furiosa.md.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["FuriosaCompileOptions", "FallbackCounter", "apply_compile_options",
           "loaded_module_stats", "probe_free_bytes"]

log = logging.getLogger(__name__)

#: the logger furiosa-torch writes to (``logging.getLogger("furiosa_torch")`` in its modules)
FURIOSA_LOGGER = "furiosa_torch"


@dataclass(frozen=True)
class FuriosaCompileOptions:
    """Compile settings of one RNGD card process (``runtime.furiosa.*``): ``compiler_cache_dir`` (``""``:
    furiosa-torch's default), ``loaded_modules`` (cache size, the plan's ``modules`` term; 0: furiosa-torch's),
    ``cpu_fallback`` (default off: an error), ``probe_free`` (:func:`probe_free_bytes` after each step),
    ``compiled_layers`` (:mod:`npu_train.backends.furiosa_layer`)."""

    compiler_cache_dir: str = ""
    loaded_modules: int = 0
    cpu_fallback: bool = False
    probe_free: bool = False
    compiled_layers: bool = False


class FallbackCounter(logging.Filter):
    """Counts furiosa-torch's CPU-fallback records (a filter on the ``"furiosa_torch"`` logger, lowered to
    DEBUG; records below the logger's former level are dropped after counting)."""

    def __init__(self, pass_level: int):
        super().__init__()
        self.pass_level = pass_level
        self.total = 0
        self.by_op: dict[str, int] = {}
        self._lock = threading.Lock()
        self._reported = 0

    def filter(self, record: logging.LogRecord) -> bool:
        op = getattr(record, "furiosa_cpu_fallback", None)
        if op is None:
            msg = record.getMessage()
            if "fallback to CPU" in msg or "fell back to CPU" in msg:
                op = msg.split()[5] if msg.startswith("failed to compile & run") else msg.split()[0]
        if op is not None:
            with self._lock:
                self.total += 1
                self.by_op[op] = self.by_op.get(op, 0) + 1
        return record.levelno >= self.pass_level

    def since_last(self) -> int:
        """Fallbacks since the previous call (per-step reporting)."""
        with self._lock:
            n = self.total - self._reported
            self._reported = self.total
            return n


def apply_compile_options(ft: Any, opts: FuriosaCompileOptions) -> tuple[dict, FallbackCounter]:
    """Apply ``opts`` to ``ft`` (the imported ``furiosa.torch``); returns ``(settings, counter)``.
    Raises ``OSError`` when the cache directory cannot be created."""
    cfg = ft.config
    done: dict = {}
    if opts.compiler_cache_dir:
        os.makedirs(opts.compiler_cache_dir, exist_ok=True)
        cfg.set_cache_config(root_dir=opts.compiler_cache_dir)
    try:
        done["compiler_cache_dir"] = str(cfg.get_cache_config().root_dir)
    except Exception:  # noqa: BLE001
        done["compiler_cache_dir"] = opts.compiler_cache_dir or "(furiosa-torch default)"
    if opts.loaded_modules > 0:
        cfg.set_eager_cache_size(num_load=int(opts.loaded_modules))
        done["loaded_modules"] = int(opts.loaded_modules)
    cfg.set_cpu_fallback(bool(opts.cpu_fallback))
    done["cpu_fallback"] = bool(cfg.get_cpu_fallback())
    lg = logging.getLogger(FURIOSA_LOGGER)
    counter = FallbackCounter(lg.getEffectiveLevel())
    lg.addFilter(counter)
    if lg.getEffectiveLevel() > logging.DEBUG:
        lg.setLevel(logging.DEBUG)
    return done, counter


def loaded_module_stats(aten_module: Any = None) -> Optional[dict]:
    """``{"loaded", "capacity", "misses"}`` of furiosa-torch's loaded-module cache (an internal, read
    for reports only), or None."""
    try:
        if aten_module is None:
            import importlib

            aten_module = importlib.import_module("furiosa.torch._backend.aten")
        info = aten_module._compile_and_load_cached.cache_info()
    except Exception:  # noqa: BLE001
        return None
    return {"loaded": int(info.currsize), "capacity": int(info.maxsize or 0), "misses": int(info.misses)}


def probe_free_bytes(alloc: Callable[[int], Any], limit_bytes: int,
                     chunk_bytes: int = 256 << 20, fine_bytes: int = 16 << 20) -> int:
    """Free card memory, bytes, by allocating ``alloc(n)`` in ``chunk_bytes`` then ``fine_bytes`` pieces
    until it raises or ``limit_bytes`` is reached; all freed before returning. Measurement only."""
    held, total = [], 0
    try:
        for size in (chunk_bytes, fine_bytes):
            while total + size <= limit_bytes:
                try:
                    held.append(alloc(size))
                except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
                    break
                total += size
    finally:
        held.clear()
    return total
