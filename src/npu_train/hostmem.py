"""Card processes keep freed host memory for reuse (:func:`keep_freed_memory`): glibc's
``M_MMAP_THRESHOLD`` 1 GiB and ``M_TRIM_THRESHOLD`` 2 GiB - 1 (``man 3 mallopt``), so per-micro-batch
tensors reuse heap pages instead of page-faulting fresh ones, at the cost of keeping the peak heap
(experiments/2026-12-01-bench-run6.md §1). A ``cpu`` card, whose host RAM is the card memory the plan
bounds, maps blocks from 256 KiB on their own instead (:func:`card_mmap_threshold`). Off with
``runtime.keep_host_memory=false``.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["keep_freed_memory", "card_mmap_threshold", "MMAP_THRESHOLD", "CPU_CARD_MMAP_THRESHOLD",
           "TRIM_THRESHOLD", "USER_ENV"]

log = logging.getLogger("npu_train.hostmem")

#: glibc ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: bytes: blocks up to this size come from the heap (``mallopt`` takes an ``int``)
MMAP_THRESHOLD = 1 << 30
#: bytes: a ``cpu`` card's mmap threshold. With heap blocks up to 1 GiB, a backward's interleaved frees
#: and allocations leave holes the next forward does not fill: a LoRA stage of SmolLM2-135M grew by
#: ~1.8x its live activations, memory no plan term counts; mapped on their own, freed tensors leave the
#: process. Cost: ~21 % of a CPU step against the 1 GiB setting (experiments/2026-12-03-lora-memory.md).
CPU_CARD_MMAP_THRESHOLD = 256 * 1024
#: bytes of free memory at the top of the heap before glibc returns it to the OS
TRIM_THRESHOLD = (1 << 31) - 1
#: the user's own glibc settings, which are left alone when set
USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def card_mmap_threshold(kind: str) -> int:
    """The mmap threshold (bytes) of a card process of ``kind``: :data:`CPU_CARD_MMAP_THRESHOLD` for ``cpu``,
    else :data:`MMAP_THRESHOLD`."""
    return CPU_CARD_MMAP_THRESHOLD if kind == "cpu" else MMAP_THRESHOLD


def keep_freed_memory(environ=None, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set the mallopt thresholds (``mmap_threshold`` bytes, :data:`TRIM_THRESHOLD`); True if both took
    effect, False (nothing changed) off glibc or when the environment already sets them. Never raises."""
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
    ok = mallopt(M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    return ok
