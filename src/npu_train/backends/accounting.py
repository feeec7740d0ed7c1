"""Device-memory accounting for a runtime without allocator statistics (furiosa-torch 2026.4):
:class:`StorageLedger` counts each live device storage once; :class:`DeviceAllocationMode` (a
``TorchDispatchMode``) registers every op output. Memory allocated inside an op is not seen. docs/furiosa.md.
"""
from __future__ import annotations

import threading
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageLedger", "DeviceAllocationMode", "install", "installed_here", "uninstall_all"]


class StorageLedger:
    """Bytes of live storages of one ``device_type``, each counted once; thread-safe; ``bytes``, ``peak``."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._live: dict[int, int] = {}  # storage key -> nbytes
        self._lock = threading.Lock()
        self.bytes = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage (no-op if already counted, not a tensor, or on another device)."""
        if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested / functional wrappers
            return
        key = st._cdata
        with self._lock:
            if key in self._live:
                return
            n = int(st.nbytes())
            self._live[key] = n
            self.bytes += n
            if self.bytes > self.peak:
                self.peak = self.bytes
        weakref.finalize(st, self._drop, key)

    def add_all(self, ts: Iterable) -> None:
        """:meth:`add` every tensor leaf of ``ts`` (nested lists/tuples/dicts)."""
        for t in tree_leaves(ts):
            if isinstance(t, torch.Tensor):
                self.add(t)

    def _drop(self, key: int) -> None:
        with self._lock:
            self.bytes -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.bytes

    def __len__(self) -> int:
        return len(self._live)


class DeviceAllocationMode(TorchDispatchMode):
    """Registers every ATen op output on ``ledger.device_type`` in ``ledger``: ``with`` for a scope,
    or :func:`install` once per computing thread (``FuriosaBackend.setup`` does it)."""

    def __init__(self, ledger: StorageLedger):
        super().__init__()
        self.ledger = ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ledger.add_all(out)
        return out


_INSTALLED = threading.local()


def install(ledger: StorageLedger) -> bool:
    """Install a :class:`DeviceAllocationMode` for ``ledger`` in the calling thread until the thread
    ends (one instance per thread; idempotent). Returns True when it was installed now."""
    mine = getattr(_INSTALLED, "ledgers", None)
    if mine is None:
        mine = _INSTALLED.ledgers = {}
    if id(ledger) in mine:
        return False
    mode = DeviceAllocationMode(ledger)
    mode.__enter__()
    mine[id(ledger)] = mode
    return True


def installed_here(ledger: StorageLedger) -> bool:
    """Whether :func:`install` ran for ``ledger`` in the calling thread."""
    return id(ledger) in getattr(_INSTALLED, "ledgers", {})


def uninstall_all() -> int:
    """Remove every mode :func:`install` put in the calling thread, innermost first (tests).
    Returns how many were removed."""
    mine = getattr(_INSTALLED, "ledgers", {})
    modes = list(mine.values())
    for mode in reversed(modes):
        mode.__exit__(None, None, None)
    mine.clear()
    return len(modes)
