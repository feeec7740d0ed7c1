"""Host-memory allocator settings of a card process: freed memory is kept for reuse.

PyTorch's CPU allocator is the C library's ``malloc`` (``c10::alloc_cpu``: ``posix_memalign``). With
glibc's defaults, a block above the dynamic mmap threshold (at most 32 MiB on 64-bit Linux) is its
own ``mmap`` and goes back to the OS when freed, and free memory above 128 KiB at the top of the heap
is trimmed (``man 3 mallopt``). A training step allocates the same large tensors every micro-batch:
the ``[V, H]`` fp32 ``lm_head`` weight gradient (113 MB for SmolLM2-135M) in each backward, and in
the split-backward (``zb*``) schedules the per-layer weight gradients of the deferred W passes. Each
then comes back as fresh pages, one minor page fault and one zeroed 4 KiB page at a time:
~141,000 faults per 4 micro-batches of the last stage of the default model (9 layers + head),
3,600-6,100 with the settings below.

Measured (experiments/2026-12-01-bench-run6.md, section 1; ``experiments/scripts/malloc_probe.py``):
two pinned processes running the last stage's forward + split backward of 4 micro-batches at the
same time (the pipeline's situation: both cores busy), one with and one without, cores swapped
between rounds: 14-22 % less time with the settings (keep / default 0.86, 0.78, 0.86, 0.81), minor
faults per repetition 141,000 -> 3,600-6,100, max RSS +150 MB (8 %). Alone on the machine the
difference was within the noise: the faults cost most when both cores fault at once.

:func:`keep_freed_memory` sets ``M_MMAP_THRESHOLD`` to 1 GiB (blocks up to 1 GiB come from the heap
and are reused; in threads other than the main one, glibc's per-thread heaps still map blocks over
64 MiB on their own: the card's compute runs in the main thread, an offloaded layer's gradient
download on the ``host-adamw`` thread does not gain) and ``M_TRIM_THRESHOLD`` to 2 GiB - 1 (the
heap is not trimmed below that), which is what the environment variables
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` do, from inside the process. The cost: the
process keeps its peak heap (RSS does not shrink after a step, which it does not in steady state
anyway; +8 % max RSS in the probe). Switched off with ``runtime.keep_host_memory=false``.
"""
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

    Returns True if both settings took effect; False (and changes nothing) off Linux, with a C
    library other than glibc, or when the user set ``MALLOC_MMAP_THRESHOLD_``,
    ``MALLOC_TRIM_THRESHOLD_`` or a ``glibc.malloc`` tunable in ``GLIBC_TUNABLES`` in ``environ``
    (default ``os.environ``): those win. Never raises.
    """
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
