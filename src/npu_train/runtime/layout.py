"""Where a card process sits in a dp x pp job (:class:`ParallelLayout`): global rank ``r = replica * pp +
stage``, so one replica's ranks are consecutive. Boundaries stay inside a replica; the stage group and
the tied group are gloo subgroups (docs/design.md §17). Pure arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelLayout:
    """``dp`` replicas of a ``pp``-stage pipeline (``world = dp * pp``). Raises ValueError for ``dp`` or ``pp``
    < 1."""

    dp: int
    pp: int

    def __post_init__(self) -> None:
        if int(self.dp) < 1 or int(self.pp) < 1:
            raise ValueError(f"ParallelLayout needs dp >= 1 and pp >= 1, got dp={self.dp}, pp={self.pp}")

    @property
    def world(self) -> int:
        """Number of card processes, ``dp * pp``."""
        return self.dp * self.pp

    def rank(self, replica: int, stage: int) -> int:
        """Global rank of ``stage`` in ``replica``: ``replica * pp + stage``."""
        if not (0 <= replica < self.dp and 0 <= stage < self.pp):
            raise ValueError(f"(replica {replica}, stage {stage}) outside dp={self.dp} x pp={self.pp}")
        return replica * self.pp + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replica, stage)`` of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of {self.world}")
        return divmod(rank, self.pp)

    def replica(self, rank: int) -> int:
        return self.coords(rank)[0]

    def stage(self, rank: int) -> int:
        return self.coords(rank)[1]

    def prev(self, rank: int) -> Optional[int]:
        """Global rank of the previous stage in the same replica (None for a first stage)."""
        k, s = self.coords(rank)
        return self.rank(k, s - 1) if s > 0 else None

    def next(self, rank: int) -> Optional[int]:
        """Global rank of the next stage in the same replica (None for a last stage)."""
        k, s = self.coords(rank)
        return self.rank(k, s + 1) if s < self.pp - 1 else None

    def stage_group(self, stage: int) -> list[int]:
        """Global ranks holding ``stage``, replica order (the data-parallel group of that stage)."""
        return [self.rank(k, stage) for k in range(self.dp)]

    def stage_groups(self) -> list[list[int]]:
        """Every stage's group, stage order (all ranks create them in this order)."""
        return [self.stage_group(s) for s in range(self.pp)]

    def tied_group(self, replica: int) -> list[int]:
        """``[first stage, last stage]`` of ``replica`` (the tied-embedding pair; needs pp > 1)."""
        return [self.rank(replica, 0), self.rank(replica, self.pp - 1)]

    def tied_groups(self) -> list[list[int]]:
        """Every replica's tied pair, replica order (empty for pp == 1: no pair)."""
        return [self.tied_group(k) for k in range(self.dp)] if self.pp > 1 else []

    def link_name(self, kind: str, stage: int, replica: int) -> str:
        """Boundary link name (the shm ring ``npt_<job>_<name>``): ``act<stage>`` / ``grad<stage>``, + ``r<k>``
        in replica k > 0."""
        return f"{kind}{stage}" if replica == 0 else f"{kind}{stage}r{replica}"

    def where(self, rank: int) -> str:
        """How messages place a card: ``"stage 1"`` (dp = 1, as before) or ``"replica 1, stage 0"``."""
        k, s = self.coords(rank)
        return f"stage {s}" if self.dp == 1 else f"replica {k}, stage {s}"
