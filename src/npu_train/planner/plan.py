"""The planner's result: :class:`Plan`, one :class:`StagePlan` per card in pipeline order (data only;
:func:`~npu_train.planner.table.plan_table` renders it)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from npu_train.hardware import Card
from npu_train.model.config import LlamaConfig
from npu_train.planner.fit import shape_key
from npu_train.planner.memory import MEMORY_TERMS
from npu_train.planner.rates import Rates
from npu_train.planner.spec import RunShape

__all__ = ["MEM_KEYS", "TIME_KEYS", "StagePlan", "Plan"]

MEM_KEYS = MEMORY_TERMS + ("total",)
TIME_KEYS = ("compute", "boundary", "bubble", "host_optimizer", "device_optimizer", "transfer", "dp_comm", "total")


@dataclass
class StagePlan:
    """One card's share of the model and its predicted memory (bytes) and time (seconds per step)."""

    card: Card
    first_layer: int
    last_layer: int  # exclusive
    has_embed: bool
    has_head: bool
    resident: list[int]  # global layer indices
    offloaded: list[int]
    mem: dict[str, int]  # bytes per MEM_KEYS key
    time: dict[str, float]  # seconds per step per TIME_KEYS key (+ host_hidden)
    host_bytes: int  # host RAM of the offloaded master + moments (0 on a cpu card: part of mem)
    in_flight: int = 0  # micro-batches whose activations the stage holds at peak
    nonlayer_resident: bool = False
    #: a two-chunk schedule's second chunk ``(first, last)`` on this card (None: one chunk)
    second: Optional[tuple] = None
    #: layers recomputed whole, the card's first in execution order (``RunShape.recompute_fewest``); None: the
    #: shape's ``recompute`` (all or none)
    recompute_layers: Optional[int] = None
    #: the offloaded layers' fp32 master + AdamW moments (bytes) wherever they are: ``host_bytes`` on a card with
    #: its own memory, part of ``mem`` (optimizer) on a cpu card, whose memory is the host's
    offloaded_state_bytes: int = 0
    #: bytes of heap holes the card's :class:`~npu_train.hostmem.HeapGuard` lets stand
    #: (``MemoryModel.heap_cap``); None: no guard (the card returns freed memory, or cannot guard)
    heap_cap: Optional[int] = None
    #: RSS growth past which the guard reads its live bytes again (``MemoryModel.heap_slack``)
    heap_slack: Optional[int] = None
    #: bytes the guard's limit keeps free below ``mem["total"]`` for allocations the heap's holes cannot serve
    #: (``MemoryModel.heap_reserve``: the experts' kernel's workspaces; 0 for a dense model)
    heap_reserve: int = 0
    #: cards the output layer is cut over by vocabulary rows (``RunShape.vocab_parallel``: every card holds
    #: ``1/head_shards`` of it); 0: the head card holds it whole
    head_shards: int = 0

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + (self.second[1] - self.second[0] if self.second else 0)

    @property
    def heap_limit(self) -> Optional[int]:
        """RSS (bytes, anonymous + shared) below which the card's heap guard never trims: the plan's total less the
        heap term's slack and one layer's frees (``mem["heap"] - heap_cap``) and less :attr:`heap_reserve`, so
        the RSS a check lets stand leaves room for the experts' kernel's fresh workspaces under the total; None
        without a guard (no :attr:`heap_cap`)."""
        if self.heap_cap is None:
            return None
        return self.mem["total"] - self.mem["heap"] + self.heap_cap - self.heap_reserve

    @property
    def fits(self) -> bool:
        return self.mem["total"] <= self.card.capacity_bytes

    @property
    def layers_label(self) -> str:
        """E.g. ``"0-15 +emb"``, ``"16-31 +head"``; two chunks ``"0-1,30-31 +emb +head"``, a one-layer range
        its number, an empty chunk ``none`` (``"0,none +emb +head"``); with the output layer cut by vocabulary
        (:attr:`head_shards`) every card's ``+head 1/P`` (its rows), the head card's ``+norm`` (it keeps the final
        norm): ``"0-15 +emb +head 1/2"``, ``"16-31 +norm +head 1/2"``."""
        s = _range_label(self.first_layer, self.last_layer)
        if self.second:
            s += "," + _range_label(*self.second)
        if self.has_embed:
            s += " +emb"
        if self.head_shards:
            return s + (" +norm" if self.has_head else "") + f" +head 1/{self.head_shards}"
        if self.has_head:
            s += " +head"
        return s


def _range_label(first: int, last: int) -> str:
    """Layers ``[first, last)`` as ``"first-(last-1)"``, ``"first"`` for one layer, ``"none"`` when empty."""
    if last <= first:
        return "none"
    return str(first) if last == first + 1 else f"{first}-{last - 1}"


@dataclass
class Plan:
    """A placement for one pipeline of ``dp`` data-parallel replicas (``zero=1``: ZeRO-1). Memory and time
    are per card (every replica's card ``i`` is like ``stages[i]``); ``tokens_per_step`` counts all replicas,
    ``host_bytes`` one pipeline (:attr:`host_bytes_all`: all)."""

    model: LlamaConfig
    shape: RunShape
    stages: list[StagePlan]
    step_time_s: float
    tokens_per_step: int
    fits: bool
    rates: list[Rates] = field(default_factory=list)  # per card, resolved for threads and the dtype
    host_ram_bytes: Optional[int] = None
    threads: int = 0  # torch threads of every card process
    host_cores: int = 0  # the cores they share
    headroom: float = 0.0  # fraction of capacity the auto choice keeps free
    memory_terms: list = field(default_factory=list)  # per card MemoryTerms
    compiler_cache_dir: str = ""  # where RNGD card processes keep compiled graphs ("": not set)
    dp: int = 1
    zero: int = 0
    #: the split search stopped at its cap (``search.MAX_TIMELINES`` timelines or ``MAX_NODES`` partial splits):
    #: how many timelines it had evaluated, the split the best of them, not proven fastest; 0: proven, or given
    search_capped_at: int = 0

    @property
    def split(self) -> list[int]:
        return [st.num_layers for st in self.stages]

    @property
    def resident_counts(self) -> list[int]:
        return [len(st.resident) for st in self.stages]

    @property
    def recompute_counts_label(self) -> str:
        """Each card's count of layers recomputed whole, ``"6/5/4/0"`` (``train.recompute_layers=fewest``)."""
        return "/".join(str(st.recompute_layers) for st in self.stages)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def host_bytes(self) -> int:
        return sum(st.host_bytes for st in self.stages)

    @property
    def host_bytes_all(self) -> int:
        """Host RAM of the offloaded optimizer state of all ``dp`` replicas."""
        return self.dp * self.host_bytes

    def to_dict(self) -> dict:
        """JSON-friendly summary (``plan.json`` in the run directory, read back by :mod:`npu_train.planner.fit`)."""
        return {
            "model": self.model.name,
            "model_shape": shape_key(self.model, self.shape.tokens_per_micro_batch),
            "shape": asdict(self.shape),
            "split": self.split,
            "dp": self.dp,
            "zero": self.zero,
            "threads": self.threads,
            "host_cores": self.host_cores,
            "step_time_s": self.step_time_s,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_s,
            "fits": self.fits,
            "host_bytes": self.host_bytes,
            "headroom": self.headroom,
            "compiler_cache_dir": self.compiler_cache_dir,
            "stages": [
                {
                    "card": st.card.name, "capacity_bytes": st.card.capacity_bytes,
                    "first_layer": st.first_layer, "last_layer": st.last_layer,
                    **({"second": list(st.second)} if st.second else {}),
                    **({"recompute_layers": st.recompute_layers} if st.recompute_layers is not None else {}),
                    **({"heap_cap": st.heap_cap, "heap_slack": st.heap_slack, "heap_reserve": st.heap_reserve,
                        "heap_limit": st.heap_limit} if st.heap_cap is not None else {}),
                    "has_embed": st.has_embed, "has_head": st.has_head,
                    "resident": list(st.resident), "offloaded": list(st.offloaded),
                    "nonlayer_resident": st.nonlayer_resident, "in_flight": st.in_flight,
                    "mem": dict(st.mem), "time": dict(st.time), "host_bytes": st.host_bytes,
                }
                for st in self.stages
            ],
        }
