"""Host-memory allocator settings of a card process: freed memory is kept for reuse.

:func:`keep_freed_memory` sets glibc's ``M_MMAP_THRESHOLD`` to 1 GiB and ``M_TRIM_THRESHOLD`` to 2 GiB - 1
(``man 3 mallopt``; what ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do), so the large tensors
allocated every micro-batch (the ``[V, H]`` head gradient, deferred W gradients) reuse heap pages instead of
page-faulting fresh ones (main thread only: glibc's per-thread arenas still mmap blocks over 64 MiB).
Cost: the process keeps its peak heap. Off with ``runtime.keep_host_memory=false``.
Measurements: experiments/2026-12-01-bench-run6.md, section 1."""
from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["keep_freed_memory", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "USER_ENV"]

log = logging.getLogger("npu_train.hostmem")

#: glibc ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: bytes: blocks up to this size come from the heap (``mallopt`` takes an ``int``)
MMAP_THRESHOLD = 1 << 30
#: bytes of free memory at the top of the heap before glibc returns it to the OS
TRIM_THRESHOLD = (1 << 31) - 1
#: the user's own glibc settings, which are left alone when set
USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory(environ=None) -> bool:
    """Make this process's ``malloc`` keep freed memory for reuse (module docstring).

    Returns True if both settings took effect; False (changing nothing) off Linux/glibc, or when
    ``environ`` sets ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a ``glibc.malloc`` tunable.
    Never raises."""
    env = os.environ if environ is None else environ
    if any(k in env for k in USER_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        log.debug("host memory: the user's malloc settings kept")
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname (find_library would run ldconfig)
        mallopt = libc.mallopt
        # glibc only: gnu_get_libc_version exists there (musl has mallopt as a no-op returning 0)
        libc.gnu_get_libc_version  # noqa: B018 (AttributeError off glibc)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return ok
