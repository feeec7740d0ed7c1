"""Device-memory accounting for a runtime without allocator statistics (furiosa-torch 2026.4).

furiosa-torch 2026.4 has no ``memory_allocated`` (``torch.accelerator.memory_allocated(0)`` raises
"Allocator for furiosa is not a DeviceAllocator", read from the 2026.4.0 wheel), and
``furiosa-smi`` shows 0.00 / 47.50 GiB throughout a run (field record, issue 12): device memory
can only be seen from inside the process. Counting only what :meth:`Backend.upload` returned
missed the resident master copies (a ``clone`` on the card), the AdamW moments created on the card
(``torch.zeros_like``), gradients and activations: a CPU stand-in reported 8 MiB of 56 MiB.

:class:`StorageLedger` counts every *storage* (``Tensor.untyped_storage()``) on one device once,
from the moment a tensor on it is registered until the storage is freed: a
``weakref.finalize`` on the ``UntypedStorage`` object fires when the storage itself dies (torch
keeps one Python object per live storage, "PyObject preservation"; checked on torch 2.13 here and
by ``tests/contract`` on 2.10), so views, in-place results and re-registrations never count twice
and a view that outlives its base keeps the bytes counted.

:class:`DeviceAllocationMode` (a ``torch.utils._python_dispatch.TorchDispatchMode``, public API on
torch 2.10 and 2.13) registers every output of every ATen op that lands on the device: factory
functions (``empty``, ``zeros_like``), copies (``_to_copy``, ``clone``), results of compute,
autograd's gradients and saved activations (the autograd engine runs backward ops with the
forward thread's dispatch-mode state). Inside the mode's handler the mode is off, so what the
runtime allocates *internally* while running an op (furiosa-torch's loaded modules:
``_backend/aten.py::_compile_and_load`` moves a compiled module's binary and weights to the card)
is not seen; the memory model carries that as its own assumed term (``modules``).

The mode is per thread (dispatch modes are thread-local): :func:`install` installs it for the
calling thread for good; :meth:`~npu_train.backends.base.Backend.upload` from
another thread registers its result directly. Dynamo does not compile frames under an active
dispatch mode, so a ``torch.compile`` path must use ``accounting="uploads"`` (see
:class:`~npu_train.backends.furiosa.FuriosaBackend`).
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
    """Bytes of the live storages of one device type, each storage counted once.

    Args:
        device_type: ``torch.device.type`` to count (``"furiosa"``, ``"privateuseone"``, or
            ``"cpu"`` for a stand-in); tensors on other devices and meta tensors are ignored.

    Thread-safe. ``bytes`` is the current sum, ``peak`` the largest value since
    :meth:`reset_peak` (bytes).
    """

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
        """Restart the peak at the current bytes."""
        with self._lock:
            self.peak = self.bytes

    def __len__(self) -> int:
        return len(self._live)


class DeviceAllocationMode(TorchDispatchMode):
    """Registers every ATen op output on ``ledger.device_type`` in ``ledger``.

    Use ``with DeviceAllocationMode(ledger): ...`` for a scope, or :func:`install` once per thread
    that computes on the card (the card process's main thread:
    :meth:`FuriosaBackend.setup <npu_train.backends.furiosa.FuriosaBackend.setup>` does it).
    """

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
