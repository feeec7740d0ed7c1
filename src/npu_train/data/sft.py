"""Supervised fine-tuning data (``data.format=chat|prompt_completion``): samples packed into rows, or one per row.

Samples longer than ``seq_len + 1`` tokens follow ``data.truncation`` (``drop``, default, or ``truncate``);
samples left without a trained token are dropped. The last ``val_fraction`` of the kept samples is
validation, or, with ``val_split`` (``data.val_split``, a split of a ``save_to_disk`` DatasetDict), every
kept sample of that split (the train samples then all come from ``split``; ``val_fraction`` is not used);
train and validation samples are laid into rows of ``seq_len + 1`` tokens separately:

- ``pack=True`` (``data.pack``, the default): sequential greedy fill. Samples go into the current row in
  file order while they fit; the next sample that does not fit starts a new row (no sample is split). Each
  row carries position ids restarting at 0 at every sample start (``PackedData.train_positions``), from
  which the model builds a block-diagonal causal mask (:mod:`npu_train.model.masks`); the label of every
  sample's first token is ``IGNORE_INDEX``, so no token is trained to predict the next sample. Chosen
  over first-fit decreasing for being O(n), keeping consecutive samples together and the layout a plain
  function of the file; on ``botchan-chat`` it needs 370 rows at seq_len 256 where first-fit decreasing
  over the whole set needs 337 (10 % more), 4 % more at 512 (172 vs 165) and 6 % fewer than one sample
  per row at 128 (979 vs 1038; FFD 866).
- ``pack=False``: one sample per row.

Rows are right-padded with ``pad_id`` (labels ``IGNORE_INDEX``; padding positions continue the row's last
sample). The step sampler draws rows, so data order stays a function of the seed and step (resumable).
Start at :func:`build_sft_data`."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
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


def sft_fingerprint(src_key: str, fmt: str, renderer: ChatRenderer, seq_len: int, val_fraction: Optional[float],
                    truncation: str, pad_id: int, fields: Optional[dict] = None, pack: bool = False) -> str:
    """sha256 hex key over the source's cheap key (:func:`~npu_train.data.sources.source_key`: file sizes,
    mtimes, sample hash, the split names), the column mapping, format, template, tokenizer and the sequence
    knobs; ``val_fraction`` None: validation is a split (``val_fraction`` not used, not in the key)."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\nformat {fmt}\ntruncation {truncation}\nsource {src_key}\n".encode())
    h.update(f"fields {json.dumps(fields or {}, sort_keys=True)}\n".encode())
    if pack:  # only when on: the keys of existing (unpacked) caches stay
        h.update(b"pack greedy-v1\n")
    h.update(f"template {renderer.template!r}\ntokenizer {tokenizer_hash(renderer.tok)}\n".encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\npad {pad_id}\n".encode())
    return h.hexdigest()


def build_sft_data(spec: str, fmt: str, renderer: ChatRenderer, seq_len: int, val_fraction: float = 0.05,
                   truncation: str = "drop", pad_id: int = 0, cache_dir: str | os.PathLike | None = None,
                   vocab_size: Optional[int] = None, log: Callable[[str], None] = print,
                   fields: Optional[dict] = None, bad_rows: str = "refuse", split: str = "train",
                   pack: bool = False, val_split: Optional[str] = None) -> PackedData:
    """Read, render, label and pad (``pack``: pack, see the module doc) the rows of ``spec`` into a
    :class:`PackedData` with labels (``[N, seq_len + 1]`` int64; ``pack``: and positions). ``fields`` maps
    messages / prompt / completion to the source's columns, ``bad_rows`` refuse | skip, ``split`` the
    save_to_disk split; ``val_split`` a split of the same DatasetDict read as the validation samples
    (``val_fraction`` then unused). Raises :class:`DataError` for bad rows (naming file and row), an unknown
    ``truncation``, ids outside ``vocab_size``, or fewer than 2 usable rows (with ``val_split``: no usable
    row in one of the splits)."""
    if truncation not in TRUNCATION:
        raise DataError(f"data.truncation={truncation!r}: use one of {list(TRUNCATION)}")
    seq_len = int(seq_len)
    row = seq_len + 1
    val_split = str(val_split) if val_split else None
    fp = sft_fingerprint(source_key(resolve_source(spec, fmt, split, val_split)), fmt, renderer, seq_len,
                         None if val_split else val_fraction, truncation, pad_id, fields, pack=bool(pack))
    cache_path = packed_cache_path(cache_dir, fp) if cache_dir is not None else None
    if cache_path is not None and cache_path.is_file():
        try:
            data = load_packed(cache_path)
        except Exception:  # noqa: BLE001 - unreadable cache: rebuild
            data = None
        if (data is not None and data.fingerprint == fp and data.train_labels is not None
                and (data.train_positions is not None) == bool(pack)):
            log(f"data: {data.n_train + data.n_val} {'packed rows of ' if pack else ''}{fmt} samples from {spec} (cached)")
            return data

    rows = read_rows(spec, fmt, fields, bad_rows, split, log)
    st = _SampleStats()
    samples = _samples(rows, renderer, fmt, row, truncation, vocab_size, st)
    if val_split:
        n_train_rows = len(rows)
        rows = rows + read_rows(spec, fmt, fields, bad_rows, val_split, log)
        val_samples = _samples(rows[n_train_rows:], renderer, fmt, row, truncation, vocab_size, st)
    kept = len(samples) + (len(val_samples) if val_split else 0)
    msg = f"data: {kept} of {len(rows)} {fmt} samples kept"
    if val_split:
        msg += (f" ({len(samples)} of {n_train_rows} from split {split!r} for training, {len(val_samples)} of "
                f"{len(rows) - n_train_rows} from split {val_split!r} for validation; data.val_fraction not used)")
    if st.n_long:
        msg += (f"; {st.n_long} longer than seq_len+1={row} tokens were "
                + ("dropped (data.truncation=drop)" if truncation == "drop" else f"truncated (data.truncation=truncate)"))
    if st.n_empty:
        msg += f"; {st.n_empty} dropped with no trained token left after truncation"
    if val_split:
        for got, name in ((len(samples), split), (len(val_samples), val_split)):
            if got < 1:
                log(msg)
                raise DataError(f"no usable {fmt} sample in split {name!r} of {spec} (train and validation need "
                                f"one each); raise data.seq_len (now {seq_len}), use data.truncation=truncate, or "
                                f"add rows to that split")
        train_s = samples
    else:
        if kept < 2:
            log(msg)
            raise DataError(f"only {kept} usable {fmt} samples in {spec} (need 2: train and validation); "
                            f"raise data.seq_len (now {seq_len}), use data.truncation=truncate, or add rows")
        n_val = n_val_rows(kept, float(val_fraction))
        train_s, val_samples = samples[: kept - n_val], samples[kept - n_val:]
    train = _lay_rows(train_s, row, int(pad_id), bool(pack))
    val = _lay_rows(val_samples, row, int(pad_id), bool(pack))
    n_rows = train[0].shape[0] + val[0].shape[0]
    n_tokens = st.n_tokens
    if pack:
        msg += (f", packed into {n_rows} sequences of {seq_len + 1} tokens "
                f"({n_tokens / (n_rows * row):.0%} filled; with data.pack=false each would take a sequence)")
    else:
        msg += f" (one per sequence of {seq_len} tokens, padded; {n_tokens / (n_rows * row):.0%} filled)"
    log(msg)
    data = PackedData(train=train[0], val=val[0], seq_len=seq_len, n_tokens=n_tokens, fingerprint=fp,
                      train_labels=train[1], val_labels=val[1], train_positions=train[2], val_positions=val[2])
    if cache_path is not None:
        save_packed(data, cache_path)
    return data


@dataclass
class _SampleStats:
    """Counts over the rows rendered by :func:`_samples` (summed over the splits)."""

    n_long: int = 0
    n_empty: int = 0
    n_tokens: int = 0


def _samples(rows: list, renderer: ChatRenderer, fmt: str, row: int, truncation: str,
             vocab_size: Optional[int], st: _SampleStats) -> list:
    """``[(ids, labels), ...]`` of the ``rows`` that are kept (``data.truncation``, a trained token left,
    ids checked ``< vocab_size``); the counts go into ``st``."""
    samples = []
    for msgs, where in rows:
        s = renderer.sample(msgs, where, fmt)
        ids, labels = s.ids, s.labels
        if len(ids) > row:
            st.n_long += 1
            if truncation == "drop":
                continue
            ids, labels = ids[:row], labels[:row]
        if all(x == IGNORE_INDEX for x in labels[1:]):
            st.n_empty += 1
            continue
        if vocab_size is not None and max(ids) >= vocab_size:
            raise DataError(f"{where}: tokenizer produced id {max(ids)} but the model's vocabulary has "
                            f"{vocab_size} entries: the tokenizer does not match the model")
        st.n_tokens += len(ids)
        samples.append((ids, labels))
    return samples


def _lay_rows(samples: list, row: int, pad_id: int, pack: bool) -> tuple:
    """``(ids, labels, positions or None)``, each ``[n_rows, row]`` int64, of ``samples`` (``(ids, labels)``
    lists of at most ``row`` tokens) in order: one per row, or (``pack``) greedily filled rows; the label of
    each sample's first token is ``IGNORE_INDEX`` (nothing predicts it across a boundary)."""
    groups: list = []
    used = row
    for s in samples:
        if not pack or used + len(s[0]) > row:
            groups.append([])
            used = 0
        groups[-1].append(s)
        used += len(s[0])
    ids = torch.full((len(groups), row), pad_id, dtype=torch.int64)
    lab = torch.full((len(groups), row), IGNORE_INDEX, dtype=torch.int64)
    pos = torch.zeros((len(groups), row), dtype=torch.int64)
    for r, group in enumerate(groups):
        c = 0
        for s_ids, s_lab in group:
            n = len(s_ids)
            ids[r, c:c + n] = torch.tensor(s_ids, dtype=torch.int64)
            lab[r, c + 1:c + n] = torch.tensor(s_lab[1:], dtype=torch.int64)
            pos[r, c:c + n] = torch.arange(n)
            c += n
        pos[r, c:] = torch.arange(n, n + row - c)  # padding continues the last sample
    return ids, lab, (pos if pack else None)
