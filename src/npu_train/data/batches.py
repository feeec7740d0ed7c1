"""Stage 5 of :mod:`npu_train.data.prepare`, in the card processes: micro-batches read from the packed file.

:func:`micro_batch_tensors` turns just the selected rows of a memory-mapped :class:`~npu_train.data.packfile.
PackedData` into int64 ``(input_ids, labels)``; :func:`micro_batch_positions` gives their position ids:
stored per row (packed SFT rows, ``*_positions``), computed from the EOS tokens (:func:`doc_positions`, text
with ``data.doc_mask``: attention stays within each document, :mod:`npu_train.model.masks`), or None (one
sample per row). Which rows: :mod:`npu_train.data.sampler`."""
from __future__ import annotations

import torch

from npu_train.model.llama import IGNORE_INDEX

from .packfile import PackedData

__all__ = ["doc_positions", "micro_batch_positions", "micro_batch_tensors"]


def doc_positions(rows: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids ``[N, L]`` int64 of token rows ``[N, L]``: ``0, 1, ...`` from each row's start, restarting
    at 0 on the token after every ``eos_id`` (the EOS ends its document)."""
    N, L = rows.shape
    start = torch.zeros(N, L, dtype=torch.bool)
    start[:, 0] = True
    start[:, 1:] = rows[:, :-1] == int(eos_id)
    ar = torch.arange(L, dtype=torch.int64).expand(N, L)
    last_start = torch.cummax(torch.where(start, ar, torch.zeros_like(ar)), dim=1).values
    return ar - last_start


def _split_of(data: PackedData, split: str) -> tuple:
    if split == "train":
        return data.train, data.train_labels, data.train_positions
    if split == "val":
        return data.val, data.val_labels, data.val_positions
    raise ValueError(f"split must be 'train' or 'val', got {split!r}")


def micro_batch_tensors(
    data: PackedData, indices: torch.Tensor, split: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both ``[len(indices), seq_len]`` int64, for rows ``indices``
    of ``data.train`` (or ``data.val`` with ``split="val"``); only those rows are read from a mapped file.
    ``labels[b, t]`` is the target of position ``t`` (the next token); chat data has ``IGNORE_INDEX`` where
    nothing is trained; packed rows (with positions) also where the next token starts another sample (no
    token predicts across a boundary)."""
    src, lab, _ = _split_of(data, split)
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    rows = src.index_select(0, idx).to(torch.int64)
    if lab is None:
        targets = rows
    elif lab.dtype in (torch.uint8, torch.bool):
        targets = torch.where(lab.index_select(0, idx).bool(), rows, IGNORE_INDEX)
    else:
        targets = lab.index_select(0, idx).to(torch.int64)
    targets = targets[:, 1:]
    pos = _row_positions(data, split, idx, rows)
    if pos is not None:
        targets = targets.masked_fill(pos[:, 1:] == 0, IGNORE_INDEX)
    return rows[:, :-1].contiguous(), targets.contiguous()


def _row_positions(data: PackedData, split: str, idx: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """Position ids ``[len(idx), seq_len + 1]`` int64 of the selected ``rows``: stored (packed SFT), computed
    from the EOS tokens (``doc_eos``), or None (one sample per row)."""
    _, _, pos = _split_of(data, split)
    if pos is not None:
        return pos.index_select(0, idx).to(torch.int64)
    if data.doc_eos is not None:
        return doc_positions(rows, data.doc_eos)
    return None


def micro_batch_positions(data: PackedData, indices: torch.Tensor, split: str = "train") -> torch.Tensor | None:
    """Position ids ``[len(indices), seq_len]`` int64 of the inputs of :func:`micro_batch_tensors` (each token's
    place in its sample), or None when the data has one sample per row (positions ``0..seq_len-1``)."""
    src, _, _ = _split_of(data, split)
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    pos = _row_positions(data, split, idx, src.index_select(0, idx).to(torch.int64)
                         if data.doc_eos is not None else None)
    return None if pos is None else pos[:, :-1].contiguous()
