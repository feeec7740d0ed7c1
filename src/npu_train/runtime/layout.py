"""Where a card process sits in a dp x pp job: :class:`ParallelLayout`.

A job runs ``dp`` data-parallel *replicas* of one pipeline of ``pp`` stages on ``dp * pp`` cards.
``backend=`` lists the cards in global-rank order, and

    global rank r = replica * pp + stage        (replica = r // pp, stage = r % pp)

so replica 0 is the first ``pp`` cards, replica 1 the next ``pp``, and so on (the contract the
multi-node launch relies on: the ranks of one replica are consecutive).

Communication of one optimizer step:

- stage boundaries (activations forward, their gradients backward) stay inside a replica:
  rank r talks to :meth:`ParallelLayout.prev` / :meth:`ParallelLayout.next` only, over links named
  per replica (:meth:`ParallelLayout.link_name`), so the shared-memory rings of different
  replicas never collide;
- the *stage group* of stage s (:meth:`ParallelLayout.stage_group`) is the gloo subgroup of the
  ``dp`` ranks holding stage s, one per replica: the stage's gradient is summed over it
  (data-parallel all-reduce) and, with ZeRO-1, the updated weights are broadcast inside it;
- the *tied group* of replica k (:meth:`ParallelLayout.tied_group`) is the pair (first stage,
  last stage) of that replica: the tied input/output embedding's gradient is summed there;
- the grad norm, loss, target-token count and stop flag are reduced over the whole world.

Pure arithmetic; no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ParallelLayout:
    """``dp`` replicas of a ``pp``-stage pipeline (``world = dp * pp`` ranks).

    Raises ``ValueError`` for ``dp < 1`` or ``pp < 1``.
    """

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
        """Name of a boundary link (names the shared-memory ring ``npt_<job>_<name>``).

        ``kind`` is ``act`` (stage -> stage+1) or ``grad`` (stage -> stage-1). Replica 0 keeps the
        single-pipeline names (``act0``, ``grad1``); replica k > 0 appends ``r<k>`` (``act0r1``).
        """
        return f"{kind}{stage}" if replica == 0 else f"{kind}{stage}r{replica}"

    def where(self, rank: int) -> str:
        """How messages place a card: ``"stage 1"`` (dp = 1, as before) or ``"replica 1, stage 0"``."""
        k, s = self.coords(rank)
        return f"stage {s}" if self.dp == 1 else f"replica {k}, stage {s}"
