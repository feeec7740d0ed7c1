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

During the steps a ``cpu`` card that keeps freed memory runs a :class:`HeapGuard`: at every decoder layer's forward
and backward it reads its heap's holes (anonymous RSS - glibc's live bytes, ``mallinfo2``) and returns the free
pages (``malloc_trim``) when they exceed the plan's cap (``MemoryModel.heap_cap``), so the heap term is a bound
the card keeps, not a guess of how glibc's best fit cuts the freed activations (issue 43).

How its OpenMP threads wait (:func:`card_wait_env`, :func:`passive_waits`): a cpu card at several torch threads
sleeps instead of spinning, so a loaded host's descheduled thread does not cost its peer's CPU time.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from typing import Optional

__all__ = ["keep_freed_memory", "release_freed_memory", "card_mmap_threshold", "user_malloc_settings", "MMAP_THRESHOLD", "CPU_CARD_MMAP_THRESHOLD",
           "TRIM_THRESHOLD", "USER_ENV", "HeapGuard", "heap_guard_available"]

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


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33, ``man 3 mallinfo``): ``size_t`` fields, all arenas summed."""
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    """glibc's ``mallinfo2`` with its return type set, or None (off glibc, or glibc < 2.33)."""
    libc = _glibc()
    if libc is None:
        return None
    try:
        fn = libc.mallinfo2
        libc.malloc_trim  # noqa: B018 (AttributeError without it)
    except AttributeError:
        return None
    fn.restype = _MallInfo2
    return fn


def heap_guard_available() -> bool:
    """Whether a card process here can run a :class:`HeapGuard` (glibc >= 2.33: ``mallinfo2`` and
    ``malloc_trim``); where not, the plan counts the heap's holes unguarded (``MemoryModel.hole_churn``)."""
    return _mallinfo2() is not None


class HeapGuard:
    """Keeps a cpu card's heap holes (freed memory the heap keeps resident) at most ``cap_bytes`` at each full
    :meth:`check`: past it, the free pages go back to the OS (``malloc_trim(0)``: every free chunk's whole
    pages, in every arena; they fault in again when reused), and with ``limit_bytes`` only while the RSS is above
    that too (a card: its plan's total less the slack and one layer's frees and less the experts' kernel's
    workspaces, ``StagePlan.heap_limit``, so trims, and the page faults after them, happen only near the plan). A check reads the anonymous RSS (0.02 ms) and is full
    only when the RSS is above the limit (if any) and grew by ``slack_bytes`` or more since the last full one (``mallinfo2`` walks every free
    chunk: 0.3 ms with 4,400 of them); so at every check the RSS is at most live + ``cap_bytes`` + ``slack_bytes``,
    the live bytes those of the last full check or more.

    Holes = anonymous RSS (``/proc/self/statm``: resident - shared pages) - live malloc bytes (``mallinfo2``:
    ``uordblks + hblkhd``) - the same difference when :meth:`arm` was called (memory outside malloc: the
    interpreter's own arenas, thread stacks; measured right after a trim, so about no holes then). Live blocks
    whose pages were never written count as holes the other way (less RSS): allocated after :meth:`arm` and not
    yet written, they hide that many bytes of holes until written.

    Between two checks the holes grow by at most the bytes freed in between (a freed block can only be resident
    if it was written; allocating from a free chunk only shrinks the holes), so with a check before each decoder
    layer's forward and backward the card's RSS stays within live + ``cap_bytes`` + ``slack_bytes`` + one layer's
    freed bytes (``MemoryModel.heap_cap`` and ``hole_churn``). ``checks``, ``full``, ``trims``, ``released`` (bytes of
    holes at the trims)
    and ``seconds`` (spent in :meth:`check`) say what it cost. Raises RuntimeError from :meth:`create` off glibc
    >= 2.33 (use :func:`heap_guard_available`)."""

    def __init__(self, cap_bytes: int, mallinfo2, trim, slack_bytes: int = 0, limit_bytes: Optional[int] = None) -> None:
        self.cap, self.slack = int(cap_bytes), int(slack_bytes)
        self.limit = None if limit_bytes is None else int(limit_bytes)
        self._shmem = 0  # RssShmem at arm (the transport's rings), added to the anonymous RSS against the limit
        self._full_at = 0  # the anonymous RSS at the last full check
        self._mallinfo2, self._trim = mallinfo2, trim
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._statm: Optional[int] = None  # /proc/self/statm, kept open (_anon)
        self._statm_pid = 0
        self.offset = 0
        self.checks = self.full = self.trims = self.released = 0
        self.seconds = 0.0

    @classmethod
    def create(cls, cap_bytes: int, slack_bytes: int = 0, limit_bytes: Optional[int] = None) -> "HeapGuard":
        """A guard with cap ``cap_bytes`` and slack ``slack_bytes`` (both >= 0), armed (:meth:`arm`); with
        ``limit_bytes`` it trims only while the RSS (anonymous + shared at arming) is also above that."""
        if cap_bytes < 0 or slack_bytes < 0:
            raise ValueError(f"cap_bytes={cap_bytes}, slack_bytes={slack_bytes}: use byte counts >= 0")
        fn = _mallinfo2()
        if fn is None:
            raise RuntimeError("HeapGuard needs glibc >= 2.33 (mallinfo2, malloc_trim): check heap_guard_available()")
        g = cls(cap_bytes, fn, release_freed_memory, slack_bytes, limit_bytes)
        g.arm()
        return g

    def _anon(self) -> int:
        """The anonymous RSS, bytes: ``/proc/self/statm`` read again through a descriptor kept open (``pread`` at
        offset 0 regenerates the file: 1.2 us a read against 13 us to open, read and close it)."""
        if self._statm is None or self._statm_pid != os.getpid():  # (a forked child reads its own)
            self._statm, self._statm_pid = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC), os.getpid()
        v = os.pread(self._statm, 128, 0).split()
        return (int(v[1]) - int(v[2])) * self._page

    def __del__(self) -> None:
        if getattr(self, "_statm", None) is not None and self._statm_pid == os.getpid():
            os.close(self._statm)

    def _live(self) -> int:
        m = self._mallinfo2()
        return int(m.uordblks + m.hblkhd)

    def arm(self) -> None:
        """Return the free pages now and take what stays outside malloc's live bytes as no holes."""
        self._trim()
        self._full_at = self._anon()
        self.offset = self._full_at - self._live()
        try:
            with open("/proc/self/status", "rb") as f:
                self._shmem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith(b"RssShmem")), 0)
        except (OSError, ValueError):
            self._shmem = 0

    def holes(self) -> int:
        """Bytes of holes now (see the class docstring), may be slightly negative."""
        return self._anon() - self._live() - self.offset

    def check(self, *_args) -> None:
        """Where the RSS is above the limit (if any) and grew by the slack or more since the last full check: trim
        when :meth:`holes` exceed the cap. The arguments are ignored (a tensor hook's gradient)."""
        t0 = time.perf_counter()
        self.checks += 1
        anon = self._anon()
        below = self.limit is not None and anon + self._shmem <= self.limit  # no trim there: no need of live bytes
        if not below and anon - self._full_at >= self.slack:
            self.full += 1
            h = anon - self._live() - self.offset
            if h > self.cap:
                self._trim()
                self.trims += 1
                self.released += h
                anon = self._anon()
            self._full_at = anon
        self.seconds += time.perf_counter() - t0

    def summary(self) -> str:
        """Two lines, each short enough that a card's log prefix keeps it within 100 columns:
        ``heap guard: K trims (Y GiB of holes), N checks in T s`` and ``heap guard: cap X GiB, limit L GiB``."""
        lim = "none" if self.limit is None else f"{self.limit / 2**30:.2f} GiB"
        return (f"heap guard: {self.trims} trims ({self.released / 2**30:.2f} GiB of holes), {self.checks} checks in "
                f"{self.seconds:.1f} s\nheap guard: cap {self.cap / 2**30:.2f} GiB, limit {lim}")


#: OpenMP's wait policy variable (libgomp, the OpenMP of PyPI's torch, and MKL's GNU threading layer read it once,
#: when the library loads) and the setting that makes idle threads sleep instead of spinning
WAIT_POLICY = "OMP_WAIT_POLICY"
#: the user's own OpenMP wait settings, which :func:`card_wait_env` leaves alone
USER_WAIT_SETTINGS = (WAIT_POLICY, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def passive_waits(environ=None) -> bool:
    """Whether this process's OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``): then the process's
    threads spend CPU time only on work, and the calling thread's CPU time is its serial part plus its share of
    the parallel regions (what an unloaded host's wall clock takes); spinning threads (the default) burn CPU
    time while they wait for a descheduled peer, so on a loaded host neither clock measures the work."""
    env = os.environ if environ is None else environ
    return str(env.get(WAIT_POLICY, "")).strip().upper() == "PASSIVE"


def card_wait_env(kind: str, threads: int, environ=None) -> dict:
    """The environment a card process of ``kind`` at ``threads`` torch threads starts with, beyond the
    launcher's: ``{"OMP_WAIT_POLICY": "PASSIVE"}`` for a cpu card at several threads unless the user set an
    OpenMP wait setting (:data:`USER_WAIT_SETTINGS`); else ``{}``.

    Why: with spinning threads a cpu card at 2 threads on a loaded 2-core host took 20-35 s a step against 4.6-7.0
    s with passive waits (the same job, the same load), and its process spent 11-17 s of CPU time a step against
    3.1-3.4 s: the fit divided that spinning by the threads and planned 2 threads slower than one
    (experiments/2026-12-06-first-impressions.md, "several threads per card")."""
    env = os.environ if environ is None else environ
    if kind != "cpu" or int(threads) <= 1 or any(k in env for k in USER_WAIT_SETTINGS):
        return {}
    return {WAIT_POLICY: "PASSIVE"}
