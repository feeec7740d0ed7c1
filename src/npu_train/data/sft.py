"""Supervised fine-tuning data (``data.format=chat|prompt_completion``): one sample per row, no packing.

Each rendered row becomes ``seq_len + 1`` tokens right-padded with ``pad_id`` (labels ``IGNORE_INDEX``).
Longer rows follow ``data.truncation`` (``drop``, default, or ``truncate``); rows left without a trained token
are dropped. The last ``val_fraction`` of samples is validation. Start at :func:`build_sft_data`."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Callable, Optional

import torch

from npu_train.model.llama import IGNORE_INDEX

from .chat import ChatRenderer, read_rows
from .dataset import PackedData, n_val_rows, tokenizer_hash, load_packed, packed_cache_path, save_packed
from .sources import resolve_source, source_key
from .text import DataError

__all__ = ["TRUNCATION", "build_sft_data", "sft_fingerprint"]

TRUNCATION = ("drop", "truncate")
_FORMAT = "npu-train-sft-v1"


def sft_fingerprint(src_key: str, fmt: str, renderer: ChatRenderer, seq_len: int, val_fraction: float,
                    truncation: str, pad_id: int, fields: Optional[dict] = None) -> str:
    """sha256 hex key over the source's cheap key (:func:`~npu_train.data.sources.source_key`: file sizes,
    mtimes, sample hash), the column mapping, format, template, tokenizer and the sequence knobs."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\nformat {fmt}\ntruncation {truncation}\nsource {src_key}\n".encode())
    h.update(f"fields {json.dumps(fields or {}, sort_keys=True)}\n".encode())
    h.update(f"template {renderer.template!r}\ntokenizer {tokenizer_hash(renderer.tok)}\n".encode())
    h.update(f"seq_len {int(seq_len)}\nval_fraction {float(val_fraction)!r}\npad {pad_id}\n".encode())
    return h.hexdigest()


def build_sft_data(spec: str, fmt: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                   truncation: str = "drop", pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                   vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                   fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train") -> PackedData:
    """Read, render, label and pad the rows of ``spec`` into a :class:`PackedData` with labels
    (``[N, seq_len + 1]`` int64). ``fields`` maps messages / prompt / completion to the source's columns,
    ``bad_rows`` refuse | skip, ``split`` the save_to_disk split. Raises :class:`DataError` for bad rows
    (naming file and row), an unknown ``truncation``, ids outside ``vocab_size``, or fewer than 2 usable rows."""
    if truncation not in TRUNCATION:
        raise DataError(f"data.truncation={truncation!r}: use one of {list(TRUNCATION)}")
    seq_len = int(seq_len)
    row = seq_len + 1
    fp = sft_fingerprint(source_key(resolve_source(spec, fmt, split)), fmt, renderer, seq_len, val_fraction,
                         truncation, pad_id, fields)
    cache_path = packed_cache_path(cache_dir, fp) if cache_dir is not None else None
    if cache_path is not None and cache_path.is_file():
        try:
            data = load_packed(cache_path)
        except Exception:  # noqa: BLE001 - unreadable cache: rebuild
            data = None
        if data is not None and data.fingerprint == fp and data.train_labels is not None:
            log(f"data: {data.n_train + data.n_val} {fmt} samples from {spec} (cached)")
            return data

    rows = read_rows(spec, fmt, fields, bad_rows, split, log)
    ids_rows, lab_rows = [], []
    n_long = n_cut = n_empty = n_tokens = 0
    for msgs, where in rows:
        s = renderer.sample(msgs, where, fmt)
        ids, labels = s.ids, s.labels
        if len(ids) > row:
            n_long += 1
            if truncation == "drop":
                continue
            ids, labels = ids[:row], labels[:row]
            n_cut += 1
        if all(x == IGNORE_INDEX for x in labels[1:]):
            n_empty += 1
            continue
        if vocab_size is not None and max(ids) >= vocab_size:
            raise DataError(f"{where}: tokenizer produced id {max(ids)} but the model's vocabulary has "
                            f"{vocab_size} entries: the tokenizer does not match the model")
        n_tokens += len(ids)
        pad = row - len(ids)
        ids_rows.append(ids + [int(pad_id)] * pad)
        lab_rows.append(labels + [IGNORE_INDEX] * pad)
    kept = len(ids_rows)
    msg = f"data: {kept} of {len(rows)} {fmt} samples kept (one per sequence of {seq_len} tokens, padded)"
    if n_long:
        msg += (f"; {n_long} longer than seq_len+1={row} tokens were "
                + ("dropped (data.truncation=drop)" if truncation == "drop" else f"truncated (data.truncation=truncate)"))
    if n_empty:
        msg += f"; {n_empty} dropped with no trained token left after truncation"
    log(msg)
    if kept < 2:
        raise DataError(f"only {kept} usable {fmt} samples in {spec} (need 2: train and validation); "
                        f"raise data.seq_len (now {seq_len}), use data.truncation=truncate, or add rows")
    t = torch.tensor(ids_rows, dtype=torch.int64)
    lab = torch.tensor(lab_rows, dtype=torch.int64)
    n_val = n_val_rows(kept, float(val_fraction))
    data = PackedData(train=t[: kept - n_val].clone(), val=t[kept - n_val:].clone(), seq_len=seq_len,
                      n_tokens=n_tokens, fingerprint=fp, train_labels=lab[: kept - n_val].clone(),
                      val_labels=lab[kept - n_val:].clone())
    if cache_path is not None:
        save_packed(data, cache_path)
    return data
