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

The build streams, so the launcher's memory does not grow with the corpus (issue 25). Pass 1 reads the
source batch by batch (:func:`~npu_train.data.chat.iter_rows`), renders and labels each row and appends each
kept sample to flat temporary files next to the cache file (:class:`~npu_train.data.spool.SampleSpool`:
uint32 ids, a uint8 trained-token mask, per sample its offset, length and largest id). Pass 2 knows the
kept count, so the train / validation split; it lays the train then the validation samples into rows
block by block (:data:`BLOCK_TOKENS` tokens at a time; a block's last row is left to start the next one,
as greedy filling from a row start is the same) and writes them straight to their places in the packed
file (:class:`~npu_train.data.dataset.PackedFileWriter`: ids uint16 / uint32, labels a uint8 mask, positions
uint16 / uint32, the dtypes ``save_packed`` would choose), then removes the temporaries. The file is built
by one process at a time under a lock (:func:`~npu_train.data.dataset.build_cached`: nodes sharing the
cache tokenize once, the others wait) and memory-mapped. A row that fails to render is raised once its
split has been read, so a bad row found by reading comes first, as when every row was read before
rendering. Start at :func:`build_sft_data`."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from npu_train.config import TRUNCATION
from npu_train.model.llama import IGNORE_INDEX

from .chat import ChatRenderer, iter_rows
from .dataset import (PROGRESS_S, PackedData, PackedFileWriter, build_cached, load_packed, packed_meta,
                      read_losses, space_hint, token_dtype, tokenizer_hash)
from .sources import BadRows, resolve_source, source_key
from .spool import (BuildJob, BuildProgress, SampleSpool, segment_indices, split_max, train_val_ranges,
                    when_built)
from .text import DataError

__all__ = ["BLOCK_TOKENS", "TRUNCATION", "build_sft_data", "sft_fingerprint"]

_FORMAT = "npu-train-sft-v1"
#: tokens (padding included) laid into rows per block written in pass 2
BLOCK_TOKENS = 1 << 18


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
                   pack: bool = False, val_split: Optional[str] = None,
                   progress_s: float = PROGRESS_S) -> PackedData:
    """Read, render, label and pad (``pack``: pack, see the module doc) the rows of ``spec`` into a memory-mapped
    :class:`PackedData` with labels (``[N, seq_len + 1]``: ids uint16 / uint32, labels a uint8 target mask;
    ``pack``: uint16 / uint32 positions), cached under ``cache_dir`` (else a temporary file, unlinked once
    mapped). ``fields`` maps messages / prompt / completion to the source's columns, ``bad_rows`` refuse |
    skip, ``split`` the save_to_disk split; ``val_split`` a split of the same DatasetDict read as the
    validation samples (``val_fraction`` then unused); ``log`` gets the summary (and a progress line every
    ``progress_s`` seconds of a long build). Raises :class:`DataError` for bad rows (naming file and row), an
    unknown ``truncation``, ids outside ``vocab_size``, or fewer than 2 usable rows (with ``val_split``: no
    usable row in one of the splits)."""
    if truncation not in TRUNCATION:
        raise DataError(f"data.truncation={truncation!r}: use one of {list(TRUNCATION)}")
    seq_len = int(seq_len)
    val_split = str(val_split) if val_split else None
    fp = sft_fingerprint(source_key(resolve_source(spec, fmt, split, val_split)), fmt, renderer, seq_len,
                         None if val_split else val_fraction, truncation, pad_id, fields, pack=bool(pack))
    job = _SftJob(spec=spec, renderer=renderer, seq_len=seq_len, val_fraction=float(val_fraction or 0.0),
                  pad_id=int(pad_id), vocab_size=vocab_size, fields=fields, bad_rows=bad_rows, split=split,
                  val_split=val_split, fingerprint=fp, where=space_hint(cache_dir), fmt=fmt, truncation=truncation,
                  pack=bool(pack))
    data, hit = build_cached(cache_dir, fp, lambda path: _cached(path, fp, bool(pack)),
                             lambda tmp, lock: _write_sft(job, tmp, lock, log, progress_s), log, job.where)
    if hit:
        log(f"data: {data.n_train + data.n_val} {'packed rows of ' if pack else ''}{fmt} samples from {spec} (cached)"
            + when_built(read_losses(data.path), ("long", "empty"), lambda c: _kept_note(job, c)))
    return data


@dataclass(frozen=True)
class _SftJob(BuildJob):
    """The knobs of one :func:`build_sft_data` call: the shared ones, the format, truncation and packing."""

    fmt: str = "chat"
    truncation: str = "drop"
    pack: bool = False


def _cached(path: Path, fp: str, pack: bool) -> Optional[PackedData]:
    """The packed file at ``path`` when it holds SFT rows for ``fp`` (positions iff ``pack``), else None."""
    try:
        data = load_packed(path)
    except Exception:  # noqa: BLE001 - unreadable cache: rebuild
        return None
    ok = data.fingerprint == fp and data.train_labels is not None and (data.train_positions is not None) == pack
    return data if ok else None


@dataclass
class _SampleStats:
    """Counts over the rows read in pass 1 (summed over the splits): bad rows skipped (``data.bad_rows=skip``;
    ``first_bad`` names the first), samples too long, samples left without a trained token, tokens kept;
    ``rows`` (read, bad ones included) / ``kept`` per split."""

    n_bad: int = 0
    first_bad: str = ""
    n_long: int = 0
    n_empty: int = 0
    n_tokens: int = 0
    rows: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def losses(self) -> dict:
        """The counts a relaunch repeats (stored in the packed file, :func:`~npu_train.data.dataset.losses_meta`)."""
        return {"rows": sum(self.rows), "kept": sum(self.kept), "bad": self.n_bad, "first_bad": self.first_bad,
                "long": self.n_long, "empty": self.n_empty}


def _write_sft(job: _SftJob, tmp: Path, lock: Optional[Path], log: Callable[[str], None], progress_s: float) -> None:
    """Pass 1: render every row of the split(s) into a :class:`SampleSpool` next to ``tmp``; pass 2: lay the
    kept samples into the packed file ``tmp`` block by block (see the module doc)."""
    progress = BuildProgress(log, job.spec, lock, progress_s)
    st = _SampleStats()
    with SampleSpool(tmp.parent, tmp.name, n_meta=2, with_mask=True) as spool:
        for name in [job.split] + ([job.val_split] if job.val_split else []):
            _spool_split(job, name, spool, st, progress, log)
        spool.close()
        (train, val), msg = _split_ranges(job, st, log)
        plans = [_plan(spool, a, b, job.row, job.pack, job.pad_id) for a, b in (train, val)]
        n_rows = plans[0].rows + plans[1].rows
        if job.pack:
            msg += (f", packed into {n_rows} sequences of {job.row} tokens "
                    f"({st.n_tokens / (n_rows * job.row):.0%} filled; with data.pack=false each would take a sequence)")
        else:
            msg += f" (one per sequence of {job.seq_len} tokens, padded; {st.n_tokens / (n_rows * job.row):.0%} filled)"
        log(msg)
        arrays = {}
        for split_name, plan in zip(("train", "val"), plans):
            arrays[split_name] = (token_dtype(max(plan.max_id, 0) + 1), plan.rows)
            arrays[f"{split_name}_labels"] = (np.uint8, plan.rows)
            if job.pack:
                arrays[f"{split_name}_positions"] = (token_dtype(max(plan.max_pos, 0) + 1), plan.rows)
        meta = packed_meta(job.seq_len, st.n_tokens, job.fingerprint, max(p.max_id for p in plans),
                           losses=st.losses())
        out = PackedFileWriter(tmp, job.row, arrays, meta, job.where)
        try:
            for split_name, (a, b) in zip(("train", "val"), (train, val)):
                _lay_split(spool, out, split_name, a, b, job, progress)
        finally:
            out.close()


def _spool_split(job: _SftJob, name: str, spool: SampleSpool, st: _SampleStats, progress: BuildProgress,
                 log: Callable[[str], None]) -> None:
    """Render the rows of split ``name`` into ``spool`` (counts into ``st``). The first row that fails to
    render (or has an id outside the vocabulary) is raised after the split's last row is read, so a bad row
    found by reading comes first, as when all rows were read before rendering."""
    failed: Optional[Exception] = None
    rows = kept = 0
    bad = BadRows()
    for msgs, where in iter_rows(job.spec, job.fmt, job.fields, job.bad_rows, name, log, bad):
        rows += 1
        if failed is not None:
            continue
        try:
            kept += _add_sample(job, msgs, where, spool, st)
        except OSError:
            raise  # the spool's disk, not the row
        except Exception as e:  # noqa: BLE001 - raised once the split is read (see the docstring)
            failed = e
        progress.step(sum(st.rows) + rows, spool.n_samples, st.n_tokens)
    if failed is not None:
        raise failed
    st.rows.append(rows + bad.count)
    st.kept.append(kept)
    st.n_bad += bad.count
    st.first_bad = st.first_bad or bad.first


def _add_sample(job: _SftJob, msgs: list, where: str, spool: SampleSpool, st: _SampleStats) -> int:
    """Render one row and spool it when kept (``data.truncation``, a trained token left, ids checked
    ``< vocab_size``): 1 if kept, else 0; the counts go into ``st``."""
    s = job.renderer.sample(msgs, where, job.fmt)
    ids, labels = s.ids, s.labels
    if len(ids) > job.row:
        st.n_long += 1
        if job.truncation == "drop":
            return 0
        ids, labels = ids[:job.row], labels[:job.row]
    if all(x == IGNORE_INDEX for x in labels[1:]):
        st.n_empty += 1
        return 0
    top = max(ids)
    if job.vocab_size is not None and top >= job.vocab_size:
        raise DataError(f"{where}: tokenizer produced id {top} but the model's vocabulary has "
                        f"{job.vocab_size} entries: the tokenizer does not match the model")
    st.n_tokens += len(ids)
    spool.add(ids, (len(ids), top), mask=np.asarray(labels) != IGNORE_INDEX)
    return 1


def _split_ranges(job: _SftJob, st: _SampleStats, log: Callable[[str], None]) -> tuple[tuple, str]:
    """``(((a, b) train, (a, b) validation) sample ranges of the spool, summary line)``; refuses too few
    usable samples (logging the summary first)."""
    head, tail = _kept_note(job, st.losses())
    msg = f"data: {head}"
    if job.val_split:
        msg += (f" ({st.kept[0]} of {st.rows[0]} from split {job.split!r} for training, {st.kept[1]} of "
                f"{st.rows[1]} from split {job.val_split!r} for validation; data.val_fraction not used)")
    msg += tail
    splits = [job.split] + ([job.val_split] if job.val_split else [])
    fix = f"raise data.seq_len (now {job.seq_len}), use data.truncation=truncate"
    unit = (f"{job.fmt} sample", f"{job.fmt} samples")
    return train_val_ranges(st.kept, splits, job.val_fraction, job.spec, unit, fix, msg, log), msg


def _kept_note(job: _SftJob, c: dict) -> tuple[str, str]:
    """The summary's parts from the counts ``c`` (:meth:`_SampleStats.losses`): ``"k of n <fmt> samples kept
    (b bad row(s) skipped)"`` and the ``"; ..."`` clauses on samples too long or left without a trained token."""
    head = f"{c['kept']} of {c['rows']} {job.fmt} samples kept" + (f" ({c['bad']} bad row(s) skipped)"
                                                                  if c.get("bad") else "")
    tail = ""
    if c.get("long"):
        how = "dropped (data.truncation=drop)" if job.truncation == "drop" else "truncated (data.truncation=truncate)"
        tail += f"; {c['long']} longer than seq_len+1={job.row} tokens were {how}"
    if c.get("empty"):
        tail += f"; {c['empty']} dropped with no trained token left after truncation"
    return head, tail


# ------------------------------------------------------------------------------- pass 2: rows
def _assign(lengths: np.ndarray, row: int, pack: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(row_of, col)``, int64 per sample: the row (0 = a fresh row at the first sample) and first column
    of each of consecutive samples of ``lengths`` tokens (each ``<= row``): one per row, or (``pack``) the
    greedy fill: a sample that does not fit in the current row starts the next."""
    n = len(lengths)
    if not pack:
        return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    row_of, col = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    r = used = 0
    for k, m in enumerate(lengths.tolist()):
        if used + m > row:
            r, used = r + 1, 0
        row_of[k], col[k] = r, used
        used += m
    return row_of, col


def _blocks(spool: SampleSpool, a: int, b: int, row: int, pack: bool) -> Iterator[tuple]:
    """Samples ``a .. b - 1`` of ``spool`` in blocks of whole rows (about :data:`BLOCK_TOKENS` tokens):
    ``(meta, row_of, col)``: meta int64 ``[k, 3]`` (first token, length, largest id), and :func:`_assign`'s
    row (from 0 in each block) and column of each. A block's last row may continue past the samples read,
    so it is left to start the next block (greedy filling from a row start gives the same rows)."""
    step = max(1, BLOCK_TOKENS // row)
    s = a
    while s < b:
        n = step
        while True:
            e = min(b, s + n)
            meta = spool.meta(s, e)
            row_of, col = _assign(meta[:, 1], row, pack)
            if e == b or row_of[-1] > 0:
                break
            n *= 2  # every sample read is in one row: read further
        if e < b:
            k = int(np.searchsorted(row_of, row_of[-1]))
            meta, row_of, col, e = meta[:k], row_of[:k], col[:k], s + k
        yield meta, row_of, col
        s = e


def _row_ends(meta: np.ndarray, row_of: np.ndarray, col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(last_col, used)`` per row of a block: the first column of the row's last sample and the tokens used."""
    last = np.append(np.flatnonzero(np.diff(row_of)), len(row_of) - 1)
    return col[last], col[last] + meta[last, 1]


@dataclass
class _Plan:
    """A split's rows: how many, the largest id in them (padding included; -1 when none) and the largest
    position (-1 when none)."""

    rows: int = 0
    max_id: int = -1
    max_pos: int = -1


def _plan(spool: SampleSpool, a: int, b: int, row: int, pack: bool, pad_id: int) -> _Plan:
    """The :class:`_Plan` of samples ``a .. b - 1`` laid into rows (decides the arrays' dtypes)."""
    p, top, padded = _Plan(), -1, False
    for meta, row_of, col in _blocks(spool, a, b, row, pack):
        last_col, used = _row_ends(meta, row_of, col)
        p.rows += int(row_of[-1]) + 1
        top = max(top, int(meta[:, 2].max()))
        padded = padded or bool((used < row).any())
        p.max_pos = max(p.max_pos, int((row - 1 - last_col).max()))  # padding continues the last sample
    p.max_id = split_max(top, padded, pad_id, p.rows)
    return p


def _lay_split(spool: SampleSpool, out: PackedFileWriter, name: str, a: int, b: int, job: _SftJob,
               progress: BuildProgress) -> None:
    """Write samples ``a .. b - 1`` as the rows of ``name`` (and ``<name>_labels``, ``<name>_positions``):
    ids right-padded with ``pad_id``; label mask 1 where trained, 0 on every sample's first token and the
    padding; positions from 0 at each sample start, the padding continuing the row's last sample."""
    row, first_row = job.row, 0
    for meta, row_of, col in _blocks(spool, a, b, row, job.pack):
        n_rows = int(row_of[-1]) + 1
        t0 = int(meta[0, 0])
        t1 = int(meta[-1, 0] + meta[-1, 1])
        src, dst = segment_indices(meta[:, 0] - t0, meta[:, 1], row_of * row + col)
        ids = np.full((n_rows, row), job.pad_id, dtype=np.int64)
        ids.reshape(-1)[dst] = spool.ids(t0, t1)[src]
        lab = np.zeros((n_rows, row), dtype=np.uint8)
        lab.reshape(-1)[dst] = spool.mask(t0, t1)[src]
        lab.reshape(-1)[row_of * row + col] = 0  # nothing predicts a sample's first token
        out.write(name, first_row, ids)
        out.write(f"{name}_labels", first_row, lab)
        if job.pack:
            last_col, _ = _row_ends(meta, row_of, col)
            pos = np.arange(row, dtype=np.int64)[None, :] - last_col[:, None]  # the padding's positions
            pos.reshape(-1)[dst] = src - np.repeat(meta[:, 0] - t0, meta[:, 1])
            out.write(f"{name}_positions", first_row, pos)
        first_row += n_rows
        progress.touch()
