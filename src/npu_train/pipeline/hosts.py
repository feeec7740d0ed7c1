"""Which of a job's links stay on one host, torch-free (the planner's dry run imports it): the transport of each
boundary between consecutive ranks (:func:`boundary_transports`) and whether vocabulary parallelism's exchange goes
through shared memory (:func:`vocab_exchange_shm`): the one rule behind the launcher's /dev/shm check
(``runtime/job.py``), the card's choice of exchange (``runtime/trainer.py``) and the plan's price of it
(``planner/cost.py::CostModel.vocab_shm``), so the plan prices the path the cards take.

Ranks are ``replica * P + stage`` (``runtime/layout.py``); boundary ``b`` links ranks ``b`` and ``b + 1``: a
replica's pipeline boundaries and, between replicas, the link from one replica's last stage to the next one's
first."""
from __future__ import annotations

from typing import Sequence

__all__ = ["node_of_rank", "even_nodes", "boundary_transports", "vocab_exchange_shm"]


def node_of_rank(node_counts: Sequence[int]) -> list[int]:
    """The node of every rank when node ``n`` runs ``node_counts[n]`` consecutive ranks: ``[2, 1]`` -> ``[0, 0, 1]``."""
    return [n for n, c in enumerate(node_counts) for _ in range(int(c))]


def even_nodes(world: int, cards_per_host: int) -> list[int]:
    """The node of every one of ``world`` ranks with ``cards_per_host`` on each host (0 or at least ``world``: one
    host): what the planner, which knows the most cards on one host and not each node's count, assumes. Whether
    every rank is on one host, which is all :func:`vocab_exchange_shm` asks of it, is exact."""
    per = int(cards_per_host) if 0 < int(cards_per_host) < int(world) else max(1, int(world))
    return [r // per for r in range(int(world))]


def boundary_transports(node_of_rank: Sequence[int], local_mode: str) -> tuple:
    """Transport per boundary ``b``: ``inline`` (ZeroMQ TCP) across nodes, ``local_mode`` (``runtime.transport``:
    ``shm`` or ``inline``) within one."""
    return tuple("inline" if node_of_rank[b] != node_of_rank[b + 1] else local_mode
                 for b in range(len(node_of_rank) - 1))


def vocab_exchange_shm(vocab_exchange: str, boundary: Sequence[str]) -> bool:
    """Whether vocabulary parallelism's exchange goes through shared memory (``pipeline/vocabshm.py``):
    ``runtime.vocab_exchange`` (``vocab_exchange``) is ``shm`` and every boundary of the job (``boundary``, one per
    pair of consecutive ranks over all replicas, :func:`boundary_transports`) is ``shm``: every card on one host
    and ``runtime.transport=shm``. Anything else (a boundary across nodes, ``runtime.transport=inline``) takes
    gloo. A job of one card has no boundary: ``shm`` then (it has no exchange either)."""
    return vocab_exchange == "shm" and all(m == "shm" for m in boundary)
