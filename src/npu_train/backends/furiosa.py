"""FuriosaAI RNGD backend (:class:`FuriosaBackend`) for furiosa-torch 2026.4.0 (torch==2.10.0), imported
lazily in :meth:`FuriosaBackend.setup`. Memory: :mod:`.accounting`; compiled execution:
:mod:`.furiosa_compile`; the furiosa-torch API facts used, with their places in the wheel: docs/furiosa.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import re
import sys
import threading
from typing import Any, Callable

import torch

from npu_train.backends import accounting as acct
from npu_train.backends.base import AllocLock, Backend, BackendSpecError, BackendUnavailableError
from npu_train.backends.furiosa_compile import (FuriosaCompileOptions, apply_compile_options,
                                                loaded_module_stats, probe_free_bytes)
from npu_train.env import getenv
from npu_train.hardware import FURIOSA_CAPACITY_BYTES

log = logging.getLogger(__name__)

RUNTIME_LIBRARY = "librenegade.so"
DEFAULT_NUM_FUSION = 8  # 8 PEs = one whole RNGD chip per logical device
FUSION_ENV = "NPT_FURIOSA_FUSION"  # (the deprecated NPU_TRAIN_FURIOSA_FUSION is still read)
SETUP_HINT = "install the Furiosa runtime / check /dev/rngd*"
ENV_HINT = "run `bash scripts/setup_furiosa_env.sh` and use .venv-furiosa/bin/python"


# ============================================================================ runtime probes
def find_runtime_library() -> str | None:
    """Path (or soname) of the RNGD runtime library ``librenegade.so``, or None when the dynamic
    loader cannot find it (then furiosa-torch's device init fails the same way)."""
    path = ctypes.util.find_library("renegade")
    if path:
        return path
    try:
        ctypes.CDLL(RUNTIME_LIBRARY)
    except OSError:
        return None
    return RUNTIME_LIBRARY


def list_rngd_cards(dev_root: str = "/dev") -> list[int]:
    """Indices of the RNGD cards whose device nodes exist (``/dev/rngd/npu<N>mgmt``; also
    accepts other ``/dev/rngd/npu<N>*`` nodes and ``/dev/rngd<N>``)."""
    found: set[int] = set()
    for p in glob.glob(os.path.join(dev_root, "rngd", "npu*mgmt")):
        m = re.match(r"npu(\d+)mgmt$", os.path.basename(p))
        if m:
            found.add(int(m.group(1)))
    if not found:
        for p in glob.glob(os.path.join(dev_root, "rngd", "npu*")):
            m = re.match(r"npu(\d+)", os.path.basename(p))
            if m:
                found.add(int(m.group(1)))
        for p in glob.glob(os.path.join(dev_root, "rngd[0-9]*")):
            m = re.match(r"rngd(\d+)$", os.path.basename(p))
            if m:
                found.add(int(m.group(1)))
    return sorted(found)


def furiosa_torch_importable() -> bool:
    """True if ``furiosa.torch`` can be found (without importing it)."""
    if "furiosa.torch" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("furiosa.torch") is not None
    except (ImportError, ValueError):
        return False


def _dev_nodes_text(dev_root: str = "/dev") -> str:
    nodes = sorted(glob.glob(os.path.join(dev_root, "rngd*")) + glob.glob(os.path.join(dev_root, "rngd", "*")))
    return ", ".join(nodes[:8]) + (" ..." if len(nodes) > 8 else "") if nodes else "none"


def runtime_problem(dev_root: str = "/dev") -> str | None:
    """Why RNGD cards cannot be used in this process (one sentence with the fix), or None."""
    if not furiosa_torch_importable():
        # Say first whether this machine has cards at all: installing furiosa-torch (~7 GB) is
        # pointless on a host without RNGD device nodes or runtime.
        hw = "although RNGD cards are present" if list_rngd_cards(dev_root) else (
            f"and this machine has no RNGD device nodes ({dev_root}/rngd/npu*mgmt: none)")
        prefix = "" if list_rngd_cards(dev_root) else "no RNGD device/runtime: "
        return (f"{prefix}furiosa-torch is not installed in this Python ({sys.executable}) {hw}; "
                f"on an RNGD server: {ENV_HINT}")
    if find_runtime_library() is None:
        return (f"no RNGD device/runtime: {RUNTIME_LIBRARY} not found by the dynamic loader "
                f"(ldconfig cache / LD_LIBRARY_PATH); {SETUP_HINT}")
    if not list_rngd_cards(dev_root):
        return (f"no RNGD device/runtime: no RNGD device nodes {dev_root}/rngd/npu*mgmt "
                f"({dev_root}/rngd* found: {_dev_nodes_text(dev_root)}); {SETUP_HINT}")
    return None


# ============================================================================ memory-type flag
def memory_type_api(ft: Any = None) -> Any:
    """The module holding furiosa-torch's memory-type flag: ``furiosa.torch._C.memory`` (2026.4)
    or ``furiosa.native_torch.memory`` (2026.2); None if neither exists."""
    for name in ("furiosa.torch._C.memory", "furiosa.native_torch.memory"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                import importlib

                mod = importlib.import_module(name)
            except Exception:
                mod = None
        if mod is not None and hasattr(mod, "_get_memory_type") and hasattr(mod, "_set_memory_type"):
            return mod
    return None


def probe_memory_flag_scope(mem: Any, timeout: float = 5.0) -> tuple[bool, str]:
    """``(thread_local, detail)``: whether the device-memory-type flag is thread-local, probed with a helper
    thread (inconclusive: False, the safe answer). Run before other threads use the device."""
    if mem is None:
        return False, "no memory-type getter/setter in furiosa-torch; assuming a process-wide flag"
    get: Callable = getattr(mem, "_get_memory_type", None)
    set_: Callable = getattr(mem, "_set_memory_type", None)
    if get is None or set_ is None:
        return False, f"{getattr(mem, '__name__', mem)} lacks _get/_set_memory_type; assuming a process-wide flag"
    try:
        baseline = get()
    except Exception as e:  # noqa: BLE001
        return False, f"_get_memory_type() failed ({e!r}); assuming a process-wide flag"
    mt = getattr(mem, "MemoryType", None)
    if mt is not None and hasattr(mt, "DramShared") and hasattr(mt, "Dram"):
        other = mt.DramShared if baseline != mt.DramShared else mt.Dram

        def flip():
            return set_(other)
    elif hasattr(mem, "_set_dram_shared_mode"):
        flip = mem._set_dram_shared_mode
    else:
        return False, "no way to change the memory type (no MemoryType.DramShared); assuming a process-wide flag"

    state: dict = {}
    flipped, read_done = threading.Event(), threading.Event()

    def helper() -> None:
        try:
            state["prev"] = flip()
            state["in_thread"] = get()
        except BaseException as e:  # noqa: BLE001
            state["error"] = e
        finally:
            flipped.set()
            read_done.wait(timeout)
            if "prev" in state:
                try:
                    set_(state["prev"])
                except BaseException as e:  # noqa: BLE001
                    state.setdefault("error", e)

    th = threading.Thread(target=helper, name="npu-train-memflag-probe", daemon=True)
    th.start()
    ok = flipped.wait(timeout)
    seen = get() if ok else None
    read_done.set()
    th.join(timeout)
    try:
        if get() != baseline:  # process-wide flag left changed (helper died?): put it back
            set_(baseline)
    except Exception:  # noqa: BLE001
        pass
    if not ok:
        return False, "memory-type probe thread timed out; assuming a process-wide flag"
    if "error" in state:
        return False, f"memory-type probe failed ({state['error']!r}); assuming a process-wide flag"
    if state.get("in_thread") == baseline:
        return False, (f"setting the memory type had no visible effect (stays {baseline}); "
                       "assuming a process-wide flag")
    thread_local = seen == baseline
    detail = (f"helper thread set the memory type to {state['in_thread']}; main thread saw {seen} "
              f"(baseline {baseline}): {'thread-local' if thread_local else 'PROCESS-WIDE'}")
    return thread_local, detail


# ============================================================================ process context
_PROCESS_LOCK = threading.Lock()
_PROCESS_STATE: dict = {"pid": None, "num_fusion": None}


def _reset_process_state_for_tests() -> None:
    with _PROCESS_LOCK:
        _PROCESS_STATE.update(pid=None, num_fusion=None)


def _device_api(ft: Any) -> Any:
    """The module with set_fusion/set_mesh_kind/...: ``furiosa.torch`` (2026.4) or
    ``furiosa.native_torch.device`` (2026.2)."""
    if hasattr(ft, "set_fusion"):
        return ft
    try:
        import importlib

        return importlib.import_module("furiosa.native_torch.device")
    except Exception:  # noqa: BLE001
        return ft


def _fusion_value(f: Any) -> int | None:
    if isinstance(f, int):
        return f
    return getattr(f, "num_fusion", None)


def _configure_process(ft: Any, num_fusion: int) -> None:
    """set_fusion + set_mesh_kind(Single), once per process (the API allows one call)."""
    with _PROCESS_LOCK:
        if _PROCESS_STATE["pid"] == os.getpid():
            if _PROCESS_STATE["num_fusion"] != num_fusion:
                raise BackendUnavailableError(
                    f"furiosa-torch fusion is already set to {_PROCESS_STATE['num_fusion']} in this process; "
                    f"cannot use num_fusion={num_fusion} too (one card per process)")
            return
        api = _device_api(ft)
        try:
            api.set_fusion(num_fusion)
        except Exception as e:  # noqa: BLE001  "num_fusion is already set, Fusion { num_fusion: 1 ..."
            current = None
            try:
                current = _fusion_value(api.get_fusion())
            except Exception:  # noqa: BLE001
                pass
            if current != num_fusion:
                raise BackendUnavailableError(
                    f"cannot set furiosa-torch fusion to {num_fusion} ({e}): something in this process "
                    f"touched the device or called get_fusion() before FuriosaBackend.setup(); call "
                    f"setup() first (or set {FUSION_ENV}={current})") from e
        mesh_kind = getattr(api, "MeshKind", None)
        if mesh_kind is not None and hasattr(api, "set_mesh_kind"):
            try:
                api.set_mesh_kind(mesh_kind.Single())
            except Exception as e:  # noqa: BLE001  already set: fine if it is Single
                log.debug("set_mesh_kind(Single) failed (%r); current mesh kind: %r", e,
                          getattr(api, "get_mesh_kind", lambda: None)())
        _PROCESS_STATE.update(pid=os.getpid(), num_fusion=num_fusion)


def _import_furiosa_torch() -> Any:
    try:
        import furiosa.torch as ft  # noqa: F401  (also registers the "furiosa" device)
    except Exception as e:  # noqa: BLE001  ImportError, or OSError/undefined symbol on a torch mismatch
        raise BackendUnavailableError(
            f"furiosa-torch is not importable in this Python ({sys.executable}, torch "
            f"{torch.__version__}): {type(e).__name__}: {e}; {ENV_HINT}") from e
    return ft


def _to_device(t: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """Host -> device copy. furiosa-torch implements ``Tensor.to`` for PrivateUse1
    (``_custom_ops/copy_from.py::aten_to_copy``). One place, so tests can stand in for it."""
    return t.to(device, non_blocking=non_blocking)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Device -> host copy (``aten_to_copy`` with a cpu target: ``empty_like`` + ``copy_``)."""
    return t.to("cpu")


def _looks_like_missing_runtime(e: BaseException) -> bool:
    text = str(e)
    return (isinstance(e, torch.OutOfMemoryError) or "failed to allocate" in text
            or RUNTIME_LIBRARY in text or "HAL error" in text or "Failed to get device" in text)


# ============================================================================ backend
class FuriosaBackend(Backend):
    """One RNGD card (``furiosa:N``, one whole chip: ``set_fusion(8)``), one process."""

    kind = "furiosa"
    memory_accounting = "dispatch"

    def __init__(self, index: int, *, num_fusion: int | None = None, dev_root: str = "/dev",
                 accounting: str = "dispatch", compile_options: FuriosaCompileOptions | None = None) -> None:
        """``index``: card; ``num_fusion``: default ``$NPT_FURIOSA_FUSION`` or 8; ``accounting``:
        ``"dispatch"`` (every device tensor) or ``"uploads"`` (uploads and :meth:`track` only; for torch.compile),
        else ``ValueError``; ``compile_options``: :class:`~npu_train.backends.furiosa_compile.FuriosaCompileOptions`."""
        super().__init__(index)
        if num_fusion is None:
            num_fusion = int(getenv("FURIOSA_FUSION", str(DEFAULT_NUM_FUSION)))
        if accounting not in ("dispatch", "uploads"):
            raise ValueError(f"accounting must be 'dispatch' or 'uploads', got {accounting!r}")
        self.num_fusion = num_fusion
        self.dev_root = dev_root
        self.accounting = accounting
        self.memory_accounting = accounting
        self.compile_options = compile_options or FuriosaCompileOptions()
        self.compile_settings: dict = {}
        self.memory_flag_thread_local = None  # unknown until setup() probes it
        self.memory_flag_probe_detail = ""
        self.device_type = "furiosa"
        self.threads_restored: tuple[int, int] | None = None
        self._ft: Any = None
        self._ledger: acct.StorageLedger | None = None
        self._fallbacks = None
        self._misses_seen = 0

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(_ft=None, _ledger=None, _fallbacks=None)
        return state

    # ------------------------------------------------------------------ setup
    def _unavailable(self, detail: str, cause: BaseException | None = None) -> BackendUnavailableError:
        return BackendUnavailableError(
            f"no RNGD device/runtime: {self.name}: {detail}; {SETUP_HINT} "
            f"(device nodes: {_dev_nodes_text(self.dev_root)})")

    def _setup(self) -> None:
        threads = torch.get_num_threads()
        ft = _import_furiosa_torch()
        if torch.get_num_threads() != threads:  # one thread rule for every card kind
            self.threads_restored = (torch.get_num_threads(), threads)
            log.warning("%s: importing furiosa-torch changed torch threads %d -> %d; set back to %d",
                        self.name, threads, torch.get_num_threads(), threads)
            torch.set_num_threads(threads)
        self._ft = ft
        self.device_type = torch._C._get_privateuse1_backend_name() or "furiosa"
        self._ledger = acct.StorageLedger(self._ledger_device_type())

        # 1. device context, once per process, before anything touches the device.
        _configure_process(ft, self.num_fusion)

        # 2. is the device-memory-type flag thread-local? If not, serialize allocations. Needs no
        #    device, so the result is known even when the checks below fail.
        thread_local, detail = probe_memory_flag_scope(memory_type_api(ft))
        self.memory_flag_thread_local = thread_local
        self.memory_flag_probe_detail = detail
        self._alloc_lock = None if thread_local else AllocLock()
        (log.info if thread_local else log.warning)("%s memory-type flag probe: %s", self.name, detail)

        # 3. the runtime library: without it every allocation fails as "out of memory".
        if find_runtime_library() is None:
            raise self._unavailable(
                f"{RUNTIME_LIBRARY} not found by the dynamic loader (ldconfig cache / LD_LIBRARY_PATH), "
                f"so furiosa-torch would report every allocation as 'failed to allocate N bytes' "
                f"(OutOfMemoryError)")

        # 4. index range as furiosa-torch sees it at this fusion.
        try:
            devices = list(_device_api(ft).get_available_devices())
        except Exception:  # noqa: BLE001
            devices = None
        if devices is not None and self.index >= len(devices):
            raise BackendSpecError(
                f"backend entry '{self.name}' names a device that does not exist: furiosa-torch sees "
                f"{len(devices)} RNGD devices at num_fusion={self.num_fusion}")

        dev = self.device()
        try:  # thread-local current device for this (the worker's main) thread
            ft.exchange_device(dev)
        except Exception:  # noqa: BLE001
            pass

        # 5. a 1-element round trip: the first real allocation on the card.
        try:
            probe = _to_host(_to_device(torch.ones(1), dev))
        except Exception as e:  # noqa: BLE001
            avail = None
            try:
                avail = bool(ft.is_available(dev))
            except Exception:  # noqa: BLE001
                pass
            raise self._unavailable(
                f"a 1-element probe allocation failed with {type(e).__name__}: {e} (furiosa-torch "
                f"reports a missing device/runtime as an out-of-memory error; "
                f"furiosa.torch.is_available({str(dev)!r}) = {avail})", e) from e
        if float(probe[0]) != 1.0:
            raise self._unavailable(f"1-element probe round trip returned {float(probe[0])} instead of 1.0")

        # 6. compiler cache, loaded-module cache, CPU fallback (furiosa_compile.py).
        self.compile_settings, self._fallbacks = apply_compile_options(ft, self.compile_options)
        stats = loaded_module_stats()
        self._misses_seen = stats["misses"] if stats else 0

        # 7. from here on every device tensor of this thread is counted (accounting.py).
        if self.accounting == "dispatch":
            acct.install(self._ledger)


    def thread_init(self) -> None:
        """A copy thread's context: this card as its current device and, with ``dispatch`` accounting, its device
        tensors counted in the card's ledger (both are per thread)."""
        self._ensure_setup()
        try:
            self._ft.exchange_device(self.device())
        except Exception:  # noqa: BLE001
            pass
        if self.accounting == "dispatch":
            acct.install(self._ledger)

    def alloc_lock(self):
        if self.memory_flag_thread_local is None:  # not probed yet: be safe
            if self._alloc_lock is None:
                self._alloc_lock = AllocLock()
        return super().alloc_lock()

    # ------------------------------------------------------------------ device
    def device(self) -> torch.device:
        return torch.device(self.device_type, self.index)

    def synchronize(self) -> None:
        """Wait for this thread's current stream and the default stream of the card
        (``furiosa.torch.current_stream(dev).synchronize()``, ``default_stream(dev)``)."""
        self._ensure_setup()
        dev = self.device()
        try:
            cur = self._ft.current_stream(dev)
            cur.synchronize()
            default = self._ft.default_stream(dev)
            if getattr(default, "stream_id", None) != getattr(cur, "stream_id", None):
                default.synchronize()
        except Exception as e:  # noqa: BLE001
            if find_runtime_library() is None or RUNTIME_LIBRARY in str(e):
                raise self._unavailable(f"synchronize failed: {e}", e) from e
            raise

    # ------------------------------------------------------------------ memory
    def capacity_bytes(self) -> int:
        return FURIOSA_CAPACITY_BYTES

    def _ledger_device_type(self) -> str:
        """The device type whose storages :meth:`memory_allocated` counts (the card's; a CPU
        stand-in in the tests overrides this with ``"cpu"``)."""
        return self.device_type

    def track(self, t: torch.Tensor) -> torch.Tensor:
        """Count ``t``'s storage (on this card) in :meth:`memory_allocated` until freed, once per storage."""
        if self._ledger is not None:
            self._ledger.add(t)
        return t

    def memory_allocated(self) -> int:
        """Bytes of the live device storages made or uploaded since setup; not the runtime's own
        buffers or loaded-module cache (the plan's ``workspace`` and ``modules`` terms)."""
        return self._ledger.bytes if self._ledger is not None else 0

    def max_memory_allocated(self) -> int:
        return self._ledger.peak if self._ledger is not None else 0

    def reset_peak_memory(self) -> None:
        if self._ledger is not None:
            self._ledger.reset_peak()

    def prepare_module(self, module) -> int:
        """With ``compile_options.compiled_layers``, run each decoder layer of ``module`` as compiled
        forward/backward graphs (:mod:`~npu_train.backends.furiosa_layer`); returns the number of layers switched."""
        if not self.compile_options.compiled_layers:
            return 0
        from npu_train.backends.furiosa_layer import install_compiled_layers

        return install_compiled_layers(module, self.track)

    def step_stats(self) -> dict:
        """Since the previous call: ``cpu_fallbacks``, ``compiles`` (loaded-module cache misses) and
        ``loaded_modules``, where furiosa-torch exposes them."""
        out: dict = {}
        if self._fallbacks is not None:
            out["cpu_fallbacks"] = self._fallbacks.since_last()
        stats = loaded_module_stats()
        if stats is not None:
            out["compiles"] = stats["misses"] - self._misses_seen
            out["loaded_modules"] = stats["loaded"]
            self._misses_seen = stats["misses"]
        if self.compile_options.probe_free:
            out["card_free"] = self.free_bytes()
            out["mem_quiet"] = self.memory_allocated()
        return out

    def free_bytes(self) -> int:
        """Free card memory now, bytes (16 MiB resolution), by allocating until refused
        (:func:`~npu_train.backends.furiosa_compile.probe_free_bytes`). Measurement only."""
        self._ensure_setup()
        dev = self.device()
        peak = self._ledger.peak if self._ledger is not None else 0
        with self.alloc_lock():
            free = probe_free_bytes(lambda n: torch.empty(n, dtype=torch.uint8, device=dev),
                                    self.capacity_bytes())
        if self._ledger is not None:
            self._ledger.peak = peak
        return free

    # ------------------------------------------------------------------ copies
    def _upload(self, t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        try:
            out = _to_device(t, self.device(), non_blocking)
        except Exception as e:  # noqa: BLE001
            if _looks_like_missing_runtime(e) and (find_runtime_library() is None or RUNTIME_LIBRARY in str(e)):
                raise self._unavailable(f"upload of {tuple(t.shape)} {t.dtype} failed with "
                                        f"{type(e).__name__}: {e}", e) from e
            raise
        return self.track(out)  # from another thread the dispatch mode may not see it

    def _download(self, t: torch.Tensor) -> torch.Tensor:
        return _to_host(t)

    def describe(self) -> dict:
        d = super().describe()
        d.update(num_fusion=self.num_fusion, memory_flag_probe=self.memory_flag_probe_detail,
                 device_type=self.device_type, compile=dict(self.compile_settings))
        return d
