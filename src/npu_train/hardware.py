"""Hardware facts with one home and the card type :class:`Card` (torch-free, so the planner's dry run
imports no torch).

RNGD: 48 GB HBM3 per card, 47.5 GiB usable by a process (``furiosa-smi``'s total; experiments/rngd-runbook.md)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

#: 2**30 bytes. Memory figures printed by npu-train are GiB unless they say GB; sizes on disk (checkpoints, exports,
#: free space) are decimal GB / MB (``errors.fmt_disk_bytes``).
GIB = 1 << 30
#: 10**9 bytes (vendor capacities and the design notes' "2.62 GB per layer").
GB = 10**9

#: the device kinds a ``backend=`` entry can name (``cpu``, ``cuda:N``, ``furiosa:N``).
KINDS = ("cpu", "cuda", "furiosa")

#: kinds whose resident fp32 parameters are their own AdamW masters (fused AdamW runs in place on
#: the weights: ``optim.adamw.StageOptimizer.shared``; ``planner.memory`` counts 8 B/param for them)
SHARED_MASTER_KINDS = ("cpu", "cuda")

#: kinds whose first stage takes the embedding's gradient as rows (``nn.Embedding(sparse=True)`` added
#: into a dense fp32 ``.grad`` made once per step): on a cpu card the dense embedding backward allocated,
#: page-faulted and zeroed a [V, H] tensor per micro-batch: 1.01 s of a step's 8 micro-batches for
#: SmolLM2's 113 MB embedding against 0.12 s as rows, the once-per-step zeroing included, 11x
#: (experiments/2026-12-01-bench.md, "Embedding gradient"); on GPUs zeroing 113 MB takes microseconds,
#: so they keep torch's default.
SPARSE_EMBED_GRAD_KINDS = ("cpu",)

#: kinds whose last stage runs the head with its weight gradient accumulated inside the matmul and the
#: one-pass cross-entropy (``StageModule.fused_head``, :mod:`npu_train.model.headops`): on a cpu card
#: 219-221 against 237-252 ms per micro-batch for SmolLM2's head (experiments/2026-12-02-head.md); cuda
#: runs the same eager ops. Not furiosa: its graphs come from the compiler, not from these autograd nodes.
FUSED_HEAD_KINDS = ("cpu", "cuda")

#: kinds whose card memory *is* the host RAM of the card process: host-held optimizer state counts
#: as card memory (``planner.memory``), and the host update of offloaded layers takes the final
#: fp32 gradient itself instead of a downloaded copy (``optim.offload.HostUpdater``)
HOST_MEMORY_KINDS = ("cpu",)

#: RNGD usable HBM per card: 47.5 GiB (= 51.0 GB) of the 48 GB HBM3.
FURIOSA_CAPACITY_BYTES = int(47.5 * GIB)

#: memory of a cuda card when no device is visible to ask (H100-class, assumed): what a plan made away
#: from the target machine uses (:func:`npu_train.backends.spec.default_capacity` asks the device)
CUDA_ASSUMED_CAPACITY_BYTES = 80 * GIB


def host_ram_bytes() -> int:
    """Total RAM of this host, bytes (``psutil.virtual_memory().total``)."""
    import psutil

    return int(psutil.virtual_memory().total)


@functools.lru_cache(maxsize=None)
def host_bf16_matmul() -> bool:
    """Whether this host's CPU multiplies bf16 in hardware: ``/proc/cpuinfo`` lists ``avx512_bf16`` or
    ``amx_tile``, the features torch's ``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported`` probe
    (``model/moe.py::matmul_dtype`` asks those; without them a cpu card's bf16 expert matmuls run in fp32).
    False where the file is unreadable (no such host then widens: the planner counts the fp32 copies)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "avx512_bf16" in flags or "amx_tile" in flags
    except OSError:
        pass
    return False


def address_space_limit() -> "int | None":
    """This process's soft ``RLIMIT_AS`` (``ulimit -v``; card processes inherit it), bytes; None when unlimited."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


#: address space (bytes) a card process needs beyond its planned memory (torch's and ZeroMQ's mappings, thread
#: stacks, malloc arenas): the tiny test job (0.36 GiB planned per cpu card) ran under ``prlimit --as`` of 1.0 GiB
#: and failed at 0.8 GiB (a card's model load) with torch 2.13 (experiments/2026-12-06-reliability-round4.md)
ADDRESS_SPACE_OVERHEAD_BYTES = int(0.5 * 2**30)

#: host RAM (bytes) kept for the launcher before cpu cards split the rest: its peak anon + shared RSS
#: was 0.20-0.49 GiB in the default, LoRA and 0.63 B jobs (experiments/2026-12-03-lora-memory.md)
LAUNCHER_RESERVE_BYTES = 512 * 2**20


#: a 1-minute load average at or above this many runnable threads per core is a busy host (a job whose threads
#: fit the cores keeps about one per core busy itself): the slow-steps note (``metrics.report``) says so and a
#: finished run on such a host fits no speed (``planner.fit``)
BUSY_LOAD_PER_CORE = 1.5


def host_load() -> "tuple[float, int] | None":
    """``(1-minute load average, cores this process may run on)``, or None where the OS keeps no load
    average (``os.getloadavg`` raises). Cheap (a read of /proc/loadavg): sampled once a step."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return load, cores


def host_busy(load: float, cores: int, own_threads: int = 0) -> bool:
    """Whether a host at 1-minute load average ``load`` on ``cores`` cores is busy with other work: the load
    past the job's own runnable threads (``own_threads``, at least one per core: 0 = unknown, as
    :func:`host_load`'s reader of a slow step assumes) reaches ``BUSY_LOAD_PER_CORE - 1`` per core. With the
    job's threads within the cores that is ``load >= 1.5 x cores``; a job of 4 one-thread cpu cards on 2
    cores (4 runnable threads of its own) is busy from 5. The one rule of the slow-steps note and the fit."""
    cores = max(1, int(cores))
    return load - max(cores, int(own_threads)) >= (BUSY_LOAD_PER_CORE - 1.0) * cores


def nominal_capacity(kind: str) -> int:
    """Usable memory of one card of ``kind`` without asking a device, bytes: furiosa
    :data:`FURIOSA_CAPACITY_BYTES`, cuda :data:`CUDA_ASSUMED_CAPACITY_BYTES`, cpu the host's whole RAM
    (dividing it among several cpu cards is the caller's job). Raises ``ValueError`` for an unknown kind."""
    if kind == "furiosa":
        return FURIOSA_CAPACITY_BYTES
    if kind == "cuda":
        return CUDA_ASSUMED_CAPACITY_BYTES
    if kind == "cpu":
        return host_ram_bytes()
    raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")


@dataclass(frozen=True)
class Card:
    """One card = one card process = one pipeline stage, from the ``backend=`` entry to the worker.

    Attributes:
        kind: ``"cpu"``, ``"cuda"`` or ``"furiosa"`` (:data:`KINDS`; checked where cards enter: the
            backend list parser, :func:`make_cards`, the planner).
        index: device index; ``None`` for cpu, and for an ``auto`` entry before
            :func:`npu_train.backends.spec.resolve_cards` numbers it.
        capacity_bytes: usable memory, bytes (0 until the launcher sets it; the planner needs it).
        name: how plans and messages name the card; default ``"<kind>:<index>"``, ``"cpu"`` for a cpu card
            without index, ``"<kind>:auto"`` for an unresolved entry.
        text: the backend entry as written (``"rngd:1"``), for messages; ``""`` for a card not parsed from one.
    """

    kind: str
    index: Optional[int] = None
    capacity_bytes: int = 0
    name: str = ""
    text: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            name = (self.kind if self.kind == "cpu" else f"{self.kind}:auto") if self.index is None \
                else f"{self.kind}:{self.index}"
            object.__setattr__(self, "name", name)


def make_cards(kind: str, n: int, capacity_bytes: Optional[int] = None) -> list[Card]:
    """``n`` cards of ``kind`` with indices ``0..n-1`` and ``capacity_bytes`` each (default
    :func:`nominal_capacity`; for ``cpu`` the host RAM divided by ``n``). Raises ``ValueError`` for
    ``n < 1`` or an unknown kind."""
    if n < 1:
        raise ValueError(f"need at least one card, got {n}")
    if kind not in KINDS:
        raise ValueError(f"card kind must be one of {KINDS}, got {kind!r}")
    if capacity_bytes is None:
        capacity_bytes = nominal_capacity(kind) // (n if kind == "cpu" else 1)
    return [Card(kind, i, int(capacity_bytes)) for i in range(n)]
