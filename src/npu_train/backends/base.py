"""Backend interface: one :class:`Backend` per card and process (built by
:func:`~npu_train.backends.registry.make_backend`; :meth:`Backend.setup` before the first device call).
:meth:`Backend.upload` / :meth:`Backend.download` never share memory with their argument;
:meth:`Backend.alloc_lock` is real only where the memory-type flag is process-wide (furiosa-torch 2026.2).
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from typing import ContextManager

import torch

from npu_train.errors import BackendSpecError, BackendUnavailableError  # noqa: F401  (their home: errors.py)


class AllocLock:
    """A re-entrant lock (``threading.RLock``) with :meth:`locked`, used as the allocation lock."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # only changed while holding _lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self._depth += 1
        return ok

    def release(self) -> None:
        self._depth -= 1
        self._lock.release()

    def locked(self) -> bool:
        """True while some thread holds the lock."""
        if self._lock.acquire(blocking=False):
            try:
                return self._depth > 0  # we hold it now: locked iff we held it before (re-entry)
            finally:
                self._lock.release()
        return True

    def __enter__(self) -> "AllocLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<AllocLock locked={self.locked()}>"


class Backend(abc.ABC):
    """One card's device runtime: ``kind``, ``index`` (None for cpu), ``name`` (``"cuda:0"``),
    ``memory_flag_thread_local`` (None on furiosa before :meth:`setup`), ``memory_accounting``."""

    kind: str = ""
    memory_accounting: str = ""

    def __init__(self, index: int | None = None) -> None:
        self.index = index
        self.memory_flag_thread_local: bool | None = True
        self._alloc_lock: AllocLock | None = None
        self._setup_pid: int | None = None
        self._setup_guard = threading.Lock()

    # ------------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # ------------------------------------------------------------------ per-process setup
    @property
    def is_setup(self) -> bool:
        return self._setup_pid == os.getpid()

    def setup(self) -> None:
        """Set up the device context of this process; idempotent, once per process (a forked
        child sets up again). Call before the first device call."""
        if self.is_setup:
            return
        with self._setup_guard:
            if self.is_setup:
                return
            self._setup()
            self._setup_pid = os.getpid()

    def _setup(self) -> None:
        """Backend-specific setup; default: nothing."""

    def _ensure_setup(self) -> None:
        if not self.is_setup:
            self.setup()

    # pickling: locks do not travel, and a copy in another process must set up again.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_setup_guard"] = None
        state["_alloc_lock"] = state["_alloc_lock"] is not None  # remember only whether one was needed
        state["_setup_pid"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        needed = state.pop("_alloc_lock")
        self.__dict__.update(state)
        self._setup_guard = threading.Lock()
        self._alloc_lock = AllocLock() if needed else None

    def thread_init(self) -> None:
        """Run first in a helper thread that copies to / from this card (``runtime/copies.py``): the
        thread's device context and memory accounting; default: nothing."""

    # ------------------------------------------------------------------ device
    @abc.abstractmethod
    def device(self) -> torch.device:
        """The ``torch.device`` of this card."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work queued on this card has finished."""

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """Total usable memory of the card (cpu: host RAM; cuda: total memory; furiosa: 47.5 GiB)."""

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently allocated on the card (see :attr:`memory_accounting`)."""

    @abc.abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of :meth:`memory_allocated` since the last :meth:`reset_peak_memory`."""

    @abc.abstractmethod
    def reset_peak_memory(self) -> None:
        """Restart the peak tracking of :meth:`max_memory_allocated` at the current value."""

    def prepare_module(self, module) -> int:
        """Adapt the stage module to this card before training (furiosa: whole-layer compiled
        execution when configured). Returns the number of layers changed; default: none."""
        return 0

    def step_stats(self) -> dict:
        """Runtime facts of the last step for the step metrics (furiosa: CPU fallbacks, compiled
        modules); ``{}`` for backends without any."""
        return {}

    # ------------------------------------------------------------------ allocation lock
    def alloc_lock(self) -> ContextManager:
        """Context manager to hold while allocating device memory (and around compiled-graph calls
        where the memory-type flag is process-wide): one shared :class:`AllocLock` there, else ``nullcontext()``."""
        if self._alloc_lock is not None:
            return self._alloc_lock
        return contextlib.nullcontext()

    @property
    def needs_alloc_lock(self) -> bool:
        return self._alloc_lock is not None

    # ------------------------------------------------------------------ copies
    def upload(self, t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """Copy host tensor ``t`` to this card (under :meth:`alloc_lock`). Never aliases ``t``."""
        self._ensure_setup()
        with self.alloc_lock():
            return self._upload(t, non_blocking)

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """Copy device tensor ``t`` to host CPU memory (blocking). Never aliases ``t``."""
        self._ensure_setup()
        return self._download(t)

    @abc.abstractmethod
    def _upload(self, t: torch.Tensor, non_blocking: bool) -> torch.Tensor: ...

    @abc.abstractmethod
    def _download(self, t: torch.Tensor) -> torch.Tensor: ...

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict:
        """Small dict for logs/metrics."""
        return {
            "name": self.name,
            "kind": self.kind,
            "index": self.index,
            "capacity_bytes": self.capacity_bytes(),
            "memory_accounting": self.memory_accounting,
            "memory_flag_thread_local": self.memory_flag_thread_local,
            "alloc_lock": self.needs_alloc_lock,
        }
