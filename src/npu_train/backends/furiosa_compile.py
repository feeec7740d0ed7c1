"""Compiled execution on RNGD: compiler cache, eager module caches, CPU fallback, warm-up.

Written against furiosa-torch 2026.4.0 (read from ``furiosa_torch-2026.4.0-cp311-...whl``):

* Eager execution (``furiosa/torch/_backend/eager.py::run_aten_op``): every ATen op on the card is
  exported, compiled and *loaded* once per distinct (op, shapes) and kept in three LRU caches
  (``_backend/aten.py``): exported programs, compiled modules and loaded modules
  (``_compile_and_load_cached``, ``lru_cache(maxsize=32)`` at import). The loaded ones hold card
  memory (``_module/runnable.py::Runnable._apply`` moves the binary and weights to the card and
  reserves stack scratch). ``furiosa.torch.config.set_eager_cache_size(num_exported_program,
  num_compiled, num_load)`` (``config/_cache.py``) resizes them; its defaults come from
  ``FURIOSA_TORCH_EAGER_NUM_LOAD`` etc., 2048 loaded modules (``config/_env.py``), and its
  docstring warns that too many or too large cached modules can run the card out of memory.
* Compiler cache (``_C/config/cache``): ``CacheConfig(root_dir, summary, ensure,
  failure_link_dir)``, ``set_cache_config(root_dir=...)``; default
  ``CacheConfig.default_cache_dir()`` (``$XDG_CACHE_HOME`` or ``~/.cache``, furiosa's own
  sub-directory), which a pod loses on restart.
* CPU fallback (``config/_cpu_fallback.py``): ``set_cpu_fallback(bool) -> previous``,
  ``get_cpu_fallback()``. With it off, an op furiosa cannot compile raises
  ``furiosa.torch.error.UnsupportedOpError`` (``eager.py``); with it on, the op runs on the host
  and furiosa-torch logs it on the ``"furiosa_torch"`` logger: ``"failed to compile & run
  <op> on Furiosa, fallback to CPU"`` (``eager.py``, DEBUG) or a record with the attribute
  ``furiosa_cpu_fallback`` (``_custom_ops/typecast.py``, ``prng.py``).

Everything here takes the imported ``furiosa.torch`` module as an argument (tests pass a fake).
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
    """Compile settings of one RNGD card process (``runtime.furiosa.*``).

    Attributes:
        compiler_cache_dir: furiosa-torch's compiler cache root (``set_cache_config(root_dir=)``);
            shared by the card processes of a host and kept across runs. ``""``: furiosa-torch's
            own default (``CacheConfig.default_cache_dir()``).
        loaded_modules: size of the loaded-module cache (``set_eager_cache_size(num_load=)``),
            the number the plan counted in its ``modules`` memory term; 0: leave furiosa-torch's.
        cpu_fallback: let ops furiosa cannot compile run on the host (counted per step by
            :class:`FallbackCounter`); default off: such an op is an error.
        probe_free: measurement only (the runbook's memory calibration): after every step,
            allocate the card's free memory in chunks until the runtime refuses
            (:func:`probe_free_bytes`) and report it, so the real peak of the step is known
            (``furiosa-smi`` shows 0.00 GiB used on RNGD).
        compiled_layers: run each decoder layer as one compiled forward and one compiled backward
            graph instead of eager ops (:mod:`npu_train.backends.furiosa_layer`); off by default.
    """

    compiler_cache_dir: str = ""
    loaded_modules: int = 0
    cpu_fallback: bool = False
    probe_free: bool = False
    compiled_layers: bool = False


class FallbackCounter(logging.Filter):
    """Counts furiosa-torch's CPU-fallback log records (a filter on the ``"furiosa_torch"`` logger).

    A record counts when it has the ``furiosa_cpu_fallback`` attribute (typecast, PRNG ops) or its
    message says ``"fallback to CPU"`` / ``"fell back to CPU"`` (generic eager ops). The eager
    path logs at DEBUG, so the logger is lowered to DEBUG; this filter then drops every record
    below the level the logger had before, so nothing new reaches the log handlers.
    """

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
    """Apply ``opts`` to furiosa-torch (``ft`` = the imported ``furiosa.torch``) in this process.

    Creates the compiler cache directory. Returns ``(settings, counter)``: what was set (for the
    backend's ``describe()``) and the installed :class:`FallbackCounter`.

    Raises:
        OSError: the cache directory cannot be created.
    """
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
    """``{"loaded": currsize, "capacity": maxsize, "misses": misses}`` of furiosa-torch's
    loaded-module cache (``furiosa.torch._backend.aten._compile_and_load_cached.cache_info()``, a
    furiosa-torch internal read for reporting only), or ``None`` when it is not there."""
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
    """Free card memory, bytes, measured by allocating it: ``alloc(n)`` (a ``uint8`` tensor of
    ``n`` bytes on the card) in ``chunk_bytes`` pieces until it raises (furiosa-torch:
    ``torch.OutOfMemoryError("failed to allocate N bytes")``) or ``limit_bytes`` is reached, then in
    ``fine_bytes`` pieces; everything is freed before returning. Resolution: ``fine_bytes``.
    Used only for measuring (``probe_free``): a card run out of memory on purpose."""
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
