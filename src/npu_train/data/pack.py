"""Stage 3 of :mod:`npu_train.data.prepare`: rendered samples laid into rows of ``seq_len + 1`` tokens, written
into the packed file (:mod:`npu_train.data.packfile`), every format.

Each split comes in as a :class:`SplitStream`: its name, the rendered items (stage 2) and the bad rows the
rows stage skipped. The pack stage reads them once, in order; it never reads a source or renders.

- ``text`` (:func:`write_text`): the token stream is written straight to the file as ``uint16`` / ``uint32``
  ids and cut into rows of ``seq_len + 1`` tokens (tail dropped), ``input_ids = row[:-1]``, ``labels =
  row[1:]``. The last ``val_fraction`` of rows is validation (or, with a validation split, its rows).
- ``chat`` / ``prompt_completion`` (:func:`write_sft`): samples longer than ``seq_len + 1`` tokens follow
  ``data.truncation`` (``drop``, default, or ``truncate``); samples left without a trained token are dropped.
  The last ``val_fraction`` of the kept samples is validation, or, with ``val_split``, every kept sample of
  that split; train and validation samples are laid into rows separately:

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
- ``preference`` (:func:`write_pairs`): one sequence per row, right-padded with ``pad_id``; row ``2i`` is
  prompt + chosen and row ``2i + 1`` prompt + rejected of pair ``i``, in train and validation (the last
  ``val_fraction`` of the pairs, at least one when > 0; or the pairs of the validation split). Labels: a
  uint8 mask, 1 at every completion position. Truncation: the prompt is kept whole and each completion is
  cut to the ``seq_len + 1 - len(prompt)`` tokens left; a pair whose prompt leaves no completion token is
  dropped.

The SFT and preference builds stream in two passes, so the launcher's memory does not grow with the corpus:
pass 1 appends each kept sample to flat temporary files next to the cache file
(:class:`~npu_train.data.spool.SampleSpool`); pass 2 knows the kept count, so the train / validation split,
and lays the samples into rows block by block (:data:`BLOCK_TOKENS` tokens at a time; a packed block's last
row is left to start the next one, as greedy filling from a row start is the same), writing them straight to
their places in the file (:class:`~npu_train.data.packfile.PackedFileWriter`: ids uint16 / uint32, labels a
uint8 mask, positions uint16 / uint32, the dtypes ``save_packed`` would choose). An id outside the
vocabulary is raised once its split has been read (after any error of the earlier stages)."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from npu_train.model.llama import IGNORE_INDEX

from .packfile import (PACKED_FORMAT, PACKED_MARGIN_BYTES, PackedFileWriter, TokenStreamFile, check_vocab,
                       losses_meta, packed_meta, short_of_space, token_dtype)
from .render import PairTokens, Sample
from .sources import BadRows, Source
from .spool import (BuildJob, BuildProgress, SampleSpool, n_val_rows, segment_indices, split_max,
                    train_val_ranges)
from .text import DataError

__all__ = ["BLOCK_TOKENS", "PROGRESS_S", "SftJob", "SplitStream", "TextJob", "free_check", "pairs_kept_note",
           "sft_kept_note", "write_pairs", "write_sft", "write_text"]

#: seconds between progress lines while tokenizing / rendering
PROGRESS_S = 10.0
#: tokens (padding included) laid into rows per block written in pass 2
BLOCK_TOKENS = 1 << 18


@dataclass
class SplitStream:
    """One split's input to the pack stage: ``name`` (``data.split`` / ``data.val_split``), ``items`` (the
    rendered items in row order: text ``(ids, chars)`` batches, :class:`~npu_train.data.render.Sample` or
    :class:`~npu_train.data.render.PairTokens`) and ``bad`` (the rows stage's count of skipped bad rows)."""

    name: str
    items: Iterator
    bad: BadRows


# ----------------------------------------------------------------------------- text
@dataclass(frozen=True)
class TextJob:
    """The knobs of one text build: the ``source`` (its spec, size and split names), its ``text_field``,
    ``seq_len``, ``val_fraction``, the file's id ``dtype``, the vocabulary check, the cache key and
    ``doc_eos`` (``data.doc_mask``: recorded in the metadata)."""

    source: Source
    text_field: str
    seq_len: int
    val_fraction: float
    dtype: np.dtype
    vocab_size: Optional[int]
    fingerprint: str
    doc_eos: Optional[int] = None

    @property
    def row(self) -> int:
        return self.seq_len + 1


class _Progress:
    """Progress lines while tokenizing (every :data:`PROGRESS_S` seconds) and the build lock's heartbeat."""

    def __init__(self, log, spec: str, total_bytes: int, lock: Optional[Path], every_s: float):
        self.log, self.spec, self.total, self.lock, self.every = log, spec, max(1, total_bytes), lock, every_s
        self.t0 = self.last = time.monotonic()
        self.chars = self.tokens = 0

    def step(self, chars: int, tokens: int) -> None:
        self.chars += chars
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            if self.lock is not None:
                with contextlib.suppress(OSError):
                    os.utime(self.lock)
            rate = self.chars / 1e6 / max(now - self.t0, 1e-9)
            self.log(f"data: tokenizing {self.spec}: {self.chars / 1e6:.1f} of ~{self.total / 1e6:.1f} MB "
                     f"({min(100.0, 100 * self.chars / self.total):.0f}%), {self.tokens:,} tokens, "
                     f"{rate:.2f} MB/s, {now - self.t0:.0f} s")

    def done(self) -> None:
        dt = time.monotonic() - self.t0
        self.log(f"data: tokenized {self.spec}: {self.chars / 1e6:.1f} MB into {self.tokens:,} tokens "
                 f"in {dt:.1f} s ({self.chars / 1e6 / max(dt, 1e-9):.2f} MB/s)")


def _stream_split(out: TokenStreamFile, batches: Iterator, vocab_size, progress: _Progress) -> int:
    """Write the ``(ids, chars)`` token ``batches`` into ``out``; returns the largest id written (-1 when none)."""
    mx = -1
    limit = np.iinfo(out.dtype).max
    for ids, chars in batches:
        if len(ids):
            m = int(ids.max())
            if m > limit:
                raise DataError(f"tokenizer produced id {m}, larger than the {out.dtype} token file holds: the "
                                "tokenizer does not match the model")
            check_vocab(m, vocab_size)
            mx = max(mx, m)
        out.write(ids)
        progress.step(chars, len(ids))
    return mx


def _too_short(n_tokens: int, row: int, seq_len: int, what: str = "dataset") -> DataError:
    return DataError(f"{what} too short: {n_tokens:,} tokens, need at least {2 * row if what == 'dataset' else row} "
                     f"({'2 sequences' if what == 'dataset' else '1 sequence'} of seq_len+1) for seq_len={seq_len}; "
                     "lower data.seq_len or add text")


def _text_rows(job: TextJob, out: TokenStreamFile, splits: list[SplitStream], progress: _Progress) -> tuple:
    """Write the token streams of ``splits`` (the training split, then a validation split if any) into ``out``
    cut to whole rows: ``(n_train, n_val, n_tokens, max_id)``."""
    src, row, seq_len, bad = job.source, job.row, job.seq_len, splits[0].bad
    mx = _stream_split(out, splits[0].items, job.vocab_size, progress)
    n_tokens = out.n
    if len(splits) == 1:
        n_seq = n_tokens // row
        if n_tokens == 0:
            raise _no_text(src, job.text_field, bad)
        if n_seq < 2:
            raise _too_short(n_tokens, row, seq_len)
        n_val = n_val_rows(n_seq, job.val_fraction)
        return n_seq - n_val, n_val, n_tokens, mx
    n_train = n_tokens // row
    if n_train < 1:
        raise _too_short(n_tokens, row, seq_len, f"the training split {splits[0].name!r}")
    out.cut(n_train * row)
    mx = max(mx, _stream_split(out, splits[1].items, job.vocab_size, progress))
    n_val = (out.n - n_train * row) // row
    n_tokens += out.n - n_train * row
    if n_val < 1:
        raise _too_short(out.n - n_train * row, row, seq_len, f"the validation split {splits[1].name!r}")
    return n_train, n_val, n_tokens, mx


def write_text(job: TextJob, splits: list[SplitStream], tmp: Path, lock: Optional[Path],
               log: Callable[[str], None], progress_s: float) -> None:
    """Stream the token batches of ``splits`` into ``tmp`` as a finished packed file (see the module doc);
    ``lock``: the build lock touched while working; ``log`` gets a progress line every ``progress_s``
    seconds, the summary and the bad rows skipped."""
    row, bad = job.row, splits[0].bad
    out = TokenStreamFile(tmp, job.dtype)
    progress = _Progress(log, job.source.spec, job.source.n_bytes, lock, progress_s)
    try:
        n_train, n_val, n_tokens, mx = _text_rows(job, out, splits, progress)
        out.cut((n_train + n_val) * row)
        meta = {"format": PACKED_FORMAT, "seq_len": str(job.seq_len), "n_tokens": str(n_tokens),
                "fingerprint": job.fingerprint, "max_id": str(mx), "source": job.source.spec}
        if bad.count:
            meta.update(losses_meta({"bad": bad.count, "first_bad": bad.first}))
        if job.doc_eos is not None:
            meta["doc_eos"] = str(int(job.doc_eos))
        out.finish({"train": (0, n_train, row), "val": (n_train * row, n_val, row)}, meta)
    finally:
        if not out.f.closed:
            out.f.close()
    progress.done()
    if bad.count:
        log(f"data: {bad.report()}")


def _no_text(src: Source, text_field: str, bad: BadRows) -> DataError:
    """The error for a text source without a token: its rows all bad (skipped), or no text at all."""
    if bad.count:
        return DataError(f"{src.root or src.spec}: no usable rows: {bad.count} bad row(s) skipped (data.bad_rows="
                         f"skip) and no other row has text; first: {bad.first}; fix the rows (or set "
                         f"data.text_field=<column> if the text is not in {text_field!r})")
    return DataError(f"{src.root or src.spec}: no text (file(s) empty or whitespace only); add training text")


def free_check(directory: Path, src: Source, limit_itemsize: int, where: str) -> None:
    """Refuse before tokenizing when the free space cannot hold ~1 token per 3 source bytes."""
    import shutil

    need = src.n_bytes * limit_itemsize // 3 + PACKED_MARGIN_BYTES
    free = shutil.disk_usage(directory).free
    if free < need:
        raise short_of_space(need, directory / "x", free, where)


# ----------------------------------------------------------------------------- chat / prompt_completion
@dataclass(frozen=True)
class SftJob(BuildJob):
    """The knobs of one chat / prompt_completion build (``prepare.build_sft_data``): the shared ones, the
    format, truncation and packing."""

    fmt: str = "chat"
    truncation: str = "drop"
    pack: bool = False


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
        """The counts a relaunch repeats (stored in the packed file, :func:`~npu_train.data.packfile.losses_meta`)."""
        return {"rows": sum(self.rows), "kept": sum(self.kept), "bad": self.n_bad, "first_bad": self.first_bad,
                "long": self.n_long, "empty": self.n_empty}


def write_sft(job: SftJob, splits: list[SplitStream], tmp: Path, lock: Optional[Path], log: Callable[[str], None],
              progress_s: float) -> None:
    """Pass 1: spool the kept rendered samples of ``splits`` (the training split, then a validation split if
    any) into a :class:`SampleSpool` next to ``tmp``; pass 2: lay them into the packed file ``tmp`` block by
    block (see the module doc). ``lock``: the build lock touched while working; ``log`` gets the summary and
    a progress line every ``progress_s`` seconds."""
    progress = BuildProgress(log, job.spec, lock, progress_s)
    st = _SampleStats()
    with SampleSpool(tmp.parent, tmp.name, n_meta=2, with_mask=True) as spool:
        for split in splits:
            _spool_split(split, spool, st, progress, lambda s: _add_sample(job, s, spool, st))
        spool.close()
        (train, val), msg = _split_ranges(job, st, log)
        plans = [_plan(spool, a, b, job.row, job.pack, job.pad_id) for a, b in (train, val)]
        n_rows = plans[0].rows + plans[1].rows
        if job.pack:
            msg += (f", packed into {n_rows:,} sequences of {job.seq_len} tokens "  # as the job line counts them
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


def _spool_split(split: SplitStream, spool: SampleSpool, st, progress: BuildProgress, add) -> None:
    """Spool the kept items of ``split`` (rendered samples or tokenized pairs) through ``add(item)`` (1 if kept,
    else 0; it counts into ``st``, a :class:`_SampleStats` or :class:`_PairStats`), then count the split's rows,
    kept items and bad rows into ``st``. The first item with an id outside the vocabulary is raised after the
    split's last row is read (and rendered), so an error of the rows or render stage comes first."""
    failed: Optional[DataError] = None
    rows = kept = 0
    for item in split.items:
        rows += 1
        if failed is not None:
            continue
        try:
            kept += add(item)
        except DataError as e:  # raised once the split is read (see the docstring)
            failed = e
        progress.step(sum(st.rows) + rows, spool.n_samples, st.n_tokens)
    if failed is not None:
        raise failed
    st.rows.append(rows + split.bad.count)
    st.kept.append(kept)
    st.n_bad += split.bad.count
    st.first_bad = st.first_bad or split.bad.first


def _add_sample(job: SftJob, s: Sample, spool: SampleSpool, st: _SampleStats) -> int:
    """Spool one rendered sample when kept (``data.truncation``, a trained token left, ids checked
    ``< vocab_size``): 1 if kept, else 0; the counts go into ``st``."""
    ids, labels, where = s.ids, s.labels, s.where
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


def _split_ranges(job: SftJob, st: _SampleStats, log: Callable[[str], None]) -> tuple[tuple, str]:
    """``(((a, b) train, (a, b) validation) sample ranges of the spool, summary line)``; refuses too few
    usable samples (logging the summary first)."""
    head, tail = sft_kept_note(job, st.losses())
    msg = f"data: {head}"
    if job.val_split:
        msg += (f" ({st.kept[0]} of {st.rows[0]} from split {job.split!r} for training, {st.kept[1]} of "
                f"{st.rows[1]} from split {job.val_split!r} for validation; data.val_fraction not used)")
    msg += tail
    splits = [job.split] + ([job.val_split] if job.val_split else [])
    fix = f"raise data.seq_len (now {job.seq_len}), use data.truncation=truncate"
    unit = (f"{job.fmt} sample", f"{job.fmt} samples")
    return train_val_ranges(st.kept, splits, job.val_fraction, job.spec, unit, fix, msg, log), msg


def sft_kept_note(job: SftJob, c: dict) -> tuple[str, str]:
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


def _lay_split(spool: SampleSpool, out: PackedFileWriter, name: str, a: int, b: int, job: SftJob,
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


# ----------------------------------------------------------------------------- preference
@dataclass
class _PairStats:
    """Counts over the pairs read in pass 1 (summed over the splits); ``rows`` (read, bad ones included) and
    ``kept`` per split."""

    n_bad: int = 0
    first_bad: str = ""
    n_cut: int = 0
    n_drop: int = 0
    n_left: int = 0
    n_tokens: int = 0
    rows: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def losses(self) -> dict:
        """The counts a relaunch repeats (stored in the packed file, :func:`~npu_train.data.packfile.losses_meta`)."""
        return {"rows": sum(self.rows), "kept": sum(self.kept), "bad": self.n_bad, "first_bad": self.first_bad,
                "cut": self.n_cut, "drop": self.n_drop, "left": self.n_left}


def write_pairs(job: BuildJob, splits: list[SplitStream], tmp: Path, lock: Optional[Path], log: Callable[[str], None],
                progress_s: float) -> None:
    """Pass 1: spool the tokenized pairs of ``splits`` (the training split, then a validation split if any)
    with their completions cut to fit, into a :class:`SampleSpool` next to ``tmp``; pass 2: lay the kept
    pairs, two rows each, into the packed file ``tmp`` block by block. ``lock``, ``log``, ``progress_s``: as
    :func:`write_sft`."""
    progress = BuildProgress(log, job.spec, lock, progress_s)
    st = _PairStats()
    with SampleSpool(tmp.parent, tmp.name, n_meta=4) as spool:
        for split in splits:
            _spool_split(split, spool, st, progress,
                         lambda t: _add_pair(t, job.row, job.vocab_size, spool, st))
        spool.close()
        (train, val), msg = _pair_ranges(job, st, log)
        kept = sum(st.kept)
        log(msg + f"; {train[1] - train[0]} train / {val[1] - val[0]} validation pairs, one sequence per answer "
            f"({st.n_tokens / (2 * kept * job.row):.0%} filled)")
        plans = [_pair_max(spool, a, b, job.row, job.pad_id) for a, b in (train, val)]
        arrays = {}
        for split_name, (a, b), top in zip(("train", "val"), (train, val), plans):
            arrays[split_name] = (token_dtype(max(top, 0) + 1), 2 * (b - a))
            arrays[f"{split_name}_labels"] = (np.uint8, 2 * (b - a))
        meta = packed_meta(job.seq_len, st.n_tokens, job.fingerprint, max(plans), pairs=True, losses=st.losses())
        out = PackedFileWriter(tmp, job.row, arrays, meta, job.where)
        try:
            for split_name, (a, b) in zip(("train", "val"), (train, val)):
                _lay_pairs(spool, out, split_name, a, b, job, progress)
        finally:
            out.close()


def _add_pair(p: PairTokens, row: int, vocab_size: Optional[int], spool: SampleSpool, st: _PairStats) -> int:
    """Spool one pair with its completions cut to the room the prompt leaves in ``row`` tokens: 1, or 0 when
    the prompt leaves no room (dropped); ids checked ``< vocab_size``; counts into ``st``."""
    room = row - len(p.prompt)
    if room < 1:
        st.n_drop += 1
        return 0
    st.n_cut += (len(p.chosen) > room) + (len(p.rejected) > room)
    chosen, rejected = p.chosen[:room], p.rejected[:room]
    top = max(p.prompt + chosen + rejected)
    if vocab_size is not None and top >= vocab_size:
        raise DataError(f"{p.where}: tokenizer produced id {top} but the model's vocabulary has {vocab_size} "
                        "entries: the tokenizer does not match the model")
    st.n_tokens += 2 * len(p.prompt) + len(chosen) + len(rejected)
    st.n_left += p.left_out > 0
    spool.add(p.prompt + chosen + rejected, (len(p.prompt), len(chosen), len(rejected), top))
    return 1


def _pair_ranges(job: BuildJob, st: _PairStats, log: Callable[[str], None]) -> tuple[tuple, str]:
    """``(((a, b) train, (a, b) validation) pair ranges of the spool, summary line)``; refuses too few usable
    pairs (logging the summary first)."""
    head, tail = pairs_kept_note(job, st.losses())
    msg = (f"data: {head}"
           + (f" ({st.kept[0]} of {st.rows[0]} from split {job.split!r} for training, {st.kept[1]} of "
              f"{st.rows[1]} from split {job.val_split!r} for validation; data.val_fraction not used)"
              if job.val_split else "")
           + tail)
    splits = [job.split] + ([job.val_split] if job.val_split else [])
    fix = f"raise data.seq_len (now {job.seq_len}) so the prompts fit"
    unit = ("preference pair", "preference pairs")
    return train_val_ranges(st.kept, splits, job.val_fraction, job.spec, unit, fix, msg, log), msg


def pairs_kept_note(job: BuildJob, c: dict) -> tuple[str, str]:
    """The summary's parts from the counts ``c`` (:meth:`_PairStats.losses`): ``"k of n preference pairs kept
    (b bad row(s) skipped)"`` and the ``"; ..."`` clauses on completions cut, pairs dropped and prompts whose
    end is left out (:attr:`~npu_train.data.render.PairTokens.left_out`)."""
    head = f"{c['kept']} of {c['rows']} preference pairs kept" + (f" ({c['bad']} bad row(s) skipped)"
                                                                 if c.get("bad") else "")
    tail = (f"; {c.get('cut', 0)} completions truncated to fit seq_len+1={job.row} tokens (the prompt is kept)"
            f"; {c.get('drop', 0)} pair(s) dropped (the prompt alone fills the {job.row} tokens)")
    if c.get("left"):
        tail += (f"; {c['left']} kept pair(s) have a prompt whose last token(s) merge into the answer or are rendered "
                 "differently before it: the answer starts where the two tokenizations diverge and that end of the "
                 "prompt is left out, as TRL 1.16's DPOTrainer does (end the prompts on a token boundary to avoid it)")
    return head, tail


def _pair_blocks(spool: SampleSpool, a: int, b: int, row: int) -> Iterator[np.ndarray]:
    """Records of pairs ``a .. b - 1`` in blocks of about :data:`BLOCK_TOKENS` row tokens: int64 ``[k, 5]``
    (first token, prompt / chosen / rejected lengths, largest id)."""
    step = max(1, BLOCK_TOKENS // (2 * row))
    for s in range(a, b, step):
        yield spool.meta(s, min(b, s + step))


def _pair_max(spool: SampleSpool, a: int, b: int, row: int, pad_id: int) -> int:
    """The largest id in the rows of pairs ``a .. b - 1`` (padding included; -1 when none)."""
    top, padded = -1, False
    for meta in _pair_blocks(spool, a, b, row):
        top = max(top, int(meta[:, 4].max()))
        padded = padded or bool((meta[:, 1] + meta[:, 2:4].min(1) < row).any())
    return split_max(top, padded, pad_id, b - a)


def _lay_pairs(spool: SampleSpool, out: PackedFileWriter, name: str, a: int, b: int, job: BuildJob,
               progress: BuildProgress) -> None:
    """Write pairs ``a .. b - 1`` as rows ``2i`` (prompt + chosen) / ``2i + 1`` (prompt + rejected) of ``name``,
    right-padded with ``pad_id``, and ``<name>_labels`` (mask 1 on the completion tokens)."""
    row, first_row = job.row, 0
    for meta in _pair_blocks(spool, a, b, row):
        k = len(meta)
        t0 = int(meta[0, 0])
        start, lp, lc, lr = meta[:, 0] - t0, meta[:, 1], meta[:, 2], meta[:, 3]
        flat = spool.ids(t0, t0 + int(start[-1] + lp[-1] + lc[-1] + lr[-1]))
        r0 = np.arange(0, 2 * k * row, 2 * row, dtype=np.int64)  # row 2i's first element in the block
        # segments: prompt -> row 2i, chosen -> after it; prompt -> row 2i + 1, rejected -> after it
        p_src, p_dst = segment_indices(np.concatenate([start, start]), np.concatenate([lp, lp]),
                                       np.concatenate([r0, r0 + row]))
        c_src, c_dst = segment_indices(np.concatenate([start + lp, start + lp + lc]), np.concatenate([lc, lr]),
                                       np.concatenate([r0 + lp, r0 + row + lp]))
        ids = np.full((2 * k, row), job.pad_id, dtype=np.int64)
        ids.reshape(-1)[p_dst] = flat[p_src]
        ids.reshape(-1)[c_dst] = flat[c_src]
        lab = np.zeros((2 * k, row), dtype=np.uint8)
        lab.reshape(-1)[c_dst] = 1
        out.write(name, first_row, ids)
        out.write(f"{name}_labels", first_row, lab)
        first_row += 2 * k
        progress.touch()
