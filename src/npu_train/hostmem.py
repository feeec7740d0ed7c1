"""How a card process treats freed host memory (:func:`card_mmap_threshold`, applied by
:func:`keep_freed_memory` before tensors exist). Reusing freed memory avoids page-faulting fresh pages
for every micro-batch's activations and gradients; returning it bounds the process at its live tensors.

- Every card (``runtime.keep_host_memory=true``, the default): glibc's ``M_MMAP_THRESHOLD`` 1 GiB and
  ``M_TRIM_THRESHOLD`` 2 GiB - 1 (``man 3 mallopt``), so each micro-batch's tensors reuse heap pages
  (accelerators: the gradient copies, experiments/2026-12-01-bench-run6.md section 1; ``cpu``: glibc's own
  dynamic threshold stops at 32 MiB, so the head's ``[tokens, vocab]`` tensors were mapped and faulted
  afresh every micro-batch, 10 % of the last card's time, experiments/2026-12-04-quiet-host.md). On a
  ``cpu`` card, whose host RAM is the card memory the plan bounds, the plan counts the heap's holes
  (``MemoryTerms.heap_fraction``).
- ``false``: accelerator cards get the C library's defaults; ``cpu`` cards map every block from 256 KiB on
  their own, so freed tensors leave the process at once, at the price of a page fault per fresh page
  (experiments/2026-12-04-cpu-heap.md).

After the model load a card process calls :func:`release_freed_memory` (glibc ``malloc_trim(0)``): what the load
freed (the read chunks, a resume's tensors) leaves the process instead of staying in the heap's holes for the
whole run, which no step reuses (issue 43: 2.2-2.5 GiB stayed on a LoRA card that loaded a bf16 checkpoint).
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Optional

__all__ = ["keep_freed_memory", "release_freed_memory", "card_mmap_threshold", "user_malloc_settings", "MMAP_THRESHOLD", "CPU_CARD_MMAP_THRESHOLD",
           "TRIM_THRESHOLD", "USER_ENV"]

log = logging.getLogger("npu_train.hostmem")

#: glibc ``mallopt`` parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: bytes: blocks up to this size come from the heap (``mallopt`` takes an ``int``)
MMAP_THRESHOLD = 1 << 30
#: bytes: the mmap threshold of a ``cpu`` card that returns freed memory (``runtime.keep_host_memory=false``).
#: On the heap, a backward's interleaved frees and allocations leave holes the next forward does not fill
#: (a LoRA stage of SmolLM2-135M grew by ~1.8x its live activations, experiments/2026-12-03-lora-memory.md);
#: mapped on their own, freed tensors leave the process, for a page fault per fresh page (the default
#: pipeline bench: 0.74x the tokens/s of glibc's defaults, experiments/2026-12-04-cpu-heap.md).
CPU_CARD_MMAP_THRESHOLD = 256 * 1024
#: bytes of free memory at the top of the heap before glibc returns it to the OS
TRIM_THRESHOLD = (1 << 31) - 1
#: the user's own glibc settings, which are left alone when set
USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def card_mmap_threshold(kind: str, keep: bool = True, recompute: bool = False) -> Optional[int]:
    """The mmap threshold (bytes) a card process of ``kind`` sets with ``runtime.keep_host_memory=keep``,
    or None: the C library's defaults (accelerator cards that do not keep freed memory; see the module
    docstring). ``recompute`` (``train.recompute``, chosen when nothing else fits): a ``cpu`` card returns freed
    memory, since on the heap each recomputed layer's freed temporaries stayed as holes, about a whole
    micro-batch's activations (issue 43: a Qwen2.5-1.5B LoRA card 3.5 GiB above its plan; 6 layers of its
    shape, one micro-batch: 0.58 GiB held with the 1 GiB threshold, 0.10 GiB with 256 KiB)."""
    if recompute and kind == "cpu":
        return CPU_CARD_MMAP_THRESHOLD
    if keep:
        return MMAP_THRESHOLD
    return CPU_CARD_MMAP_THRESHOLD if kind == "cpu" else None


def user_malloc_settings(environ=None) -> bool:
    """Whether the environment holds the user's own glibc malloc settings (:data:`USER_ENV` or a
    ``glibc.malloc.*`` tunable), which card processes keep instead of setting theirs; then neither the plan
    nor the fitted speed can assume ``runtime.keep_host_memory``'s behaviour."""
    env = os.environ if environ is None else environ
    return any(k in env for k in USER_ENV) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def keep_freed_memory(environ=None, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set the mallopt thresholds (``mmap_threshold`` bytes, :data:`TRIM_THRESHOLD`); True if both took
    effect, False (nothing changed) off glibc or when the environment already sets them. Never raises."""
    if user_malloc_settings(environ):
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


def _glibc():
    """glibc's handle (``libc.so.6``, with ``gnu_get_libc_version``), or None elsewhere (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")  # glibc's soname (find_library would run ldconfig)
        libc.gnu_get_libc_version  # noqa: B018 (AttributeError off glibc)
        return libc
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Return the heap's free memory to the OS: glibc ``malloc_trim(0)`` (``man 3 malloc_trim``: the top of every
    arena and, since glibc 2.8, the whole free pages inside it). True if glibc released something, False if not
    or off glibc (a no-op there). Never raises."""
    libc = _glibc()
    if libc is None:
        return False
    try:
        trim = libc.malloc_trim
    except AttributeError:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim(0) == 1
