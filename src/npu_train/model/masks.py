"""Attention masks of packed rows (several samples per row): a block-diagonal causal mask built from the
per-token position ids, so attention never crosses a sample boundary.

A row's ``positions`` ``[B, S]`` int64 count each token's place in its own sample and restart at 0 where a
sample starts, so the document id of a token is ``cumsum(positions == 0)`` along the row. Token ``i`` may
attend to token ``j`` iff ``j <= i`` and both have the same document id. (A sliding window would add
``i - j < window`` here.) Start at :func:`packed_causal_mask`; :func:`additive_mask` is the form given to
``scaled_dot_product_attention``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["document_ids", "packed_causal_mask", "is_plain_causal", "additive_mask"]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` int64 document index of each token: ``cumsum(positions == 0, -1)`` (a row not starting at
    position 0 has its first, partial document numbered 0)."""
    return torch.cumsum((positions == 0).to(torch.int64), dim=-1)


def is_plain_causal(positions: torch.Tensor) -> bool:
    """Whether every row of ``positions`` ``[B, S]`` is ``0, 1, ..., S-1`` (one sample per row): then the
    plain causal mask and the unshifted RoPE tables are exact."""
    S = positions.shape[-1]
    return bool(torch.equal(positions, torch.arange(S, dtype=positions.dtype,
                                                    device=positions.device).expand_as(positions)))


def packed_causal_mask(positions: torch.Tensor) -> Optional[torch.Tensor]:
    """Boolean attention mask ``[B, 1, S, S]`` (True = may attend) for ``positions`` ``[B, S]`` int64: causal
    and block-diagonal over the documents of :func:`document_ids`; None when :func:`is_plain_causal`
    (the caller keeps ``is_causal=True``). ``S * S`` bytes per row: 16 MiB at S = 4096."""
    if is_plain_causal(positions):
        return None
    S = positions.shape[-1]
    doc = document_ids(positions)
    same = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(S, S, dtype=torch.bool, device=positions.device).tril_()
    return (same & causal)[:, None]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` (bool, True = attend) as an additive ``dtype`` mask: 0 where attended, ``-inf`` elsewhere.

    Given a bool mask, the CPU flash kernel of ``scaled_dot_product_attention`` converts it to a float copy
    *per call* and saves that for backward: ``4 S^2`` bytes per row and layer (64 MiB at S = 4096). An
    additive mask of the query's dtype is saved as it is, one tensor shared by all layers of the stage
    (``e S^2`` bytes per row and micro-batch, the planner's packed-rows term)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
