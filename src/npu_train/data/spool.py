"""Part of stage 3 (:mod:`npu_train.data.pack`): tokenized samples spooled to flat temporary files (pass 1 of
the chat / prompt_completion / preference builds), read back in blocks (pass 2 lays them
into rows), so a build's memory does not grow with the corpus.

A :class:`SampleSpool` appends each sample's token ids (``uint32``) and, optionally, a per-token ``uint8``
mask to two files, and one ``int64`` record per sample (its first token's offset in the ids file, then the
caller's integers: lengths, largest id) to a third; the files sit next to the cache target, are written
through a buffer of about :data:`BUFFER_TOKENS` tokens and are read with ``os.pread`` (nothing is mapped, so
the pages read do not count as the process's own). :class:`BuildProgress` touches the build lock and logs a
line every few seconds while a build renders."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .packfile import note_full_disk
from .text import DataError

__all__ = ["BUFFER_TOKENS", "BuildJob", "BuildProgress", "SampleSpool", "n_val_rows", "segment_indices", "split_max",
           "train_val_ranges", "when_built"]


def n_val_rows(n_seq: int, val_fraction: float) -> int:
    """Validation rows of ``n_seq``: ``round(n_seq * val_fraction)``, at least 1 when > 0, at most ``n_seq - 1``."""
    if val_fraction <= 0:
        return 0
    return min(max(1, int(round(n_seq * val_fraction))), n_seq - 1)


@dataclass(frozen=True)
class BuildJob:
    """The knobs of one streamed SFT / preference build (``prepare.build_sft_data``, ``prepare.
    build_preference_data``): the source, its renderer (a ``render.ChatRenderer``), ``seq_len`` (rows hold
    :attr:`row` tokens), the validation choice, padding, the vocabulary check, column mapping, bad-row policy,
    the cache key and the setting that moves the build to a larger disk (``cache.space_hint``)."""

    spec: str
    renderer: Any
    seq_len: int
    val_fraction: float
    pad_id: int
    vocab_size: Optional[int]
    fields: Optional[dict]
    bad_rows: str
    split: str
    val_split: Optional[str]
    fingerprint: str
    where: str = ""

    @property
    def row(self) -> int:
        return self.seq_len + 1


#: tokens buffered in memory before the spool writes them out
BUFFER_TOKENS = 1 << 20


class SampleSpool:
    """Samples appended to ``<directory>/<stem>.ids`` (uint32 token ids back to back), ``.mask`` (uint8, one
    per token; only ``with_mask``) and ``.meta`` (int64 ``[n_samples, 1 + n_meta]``: the sample's first token
    offset in ``.ids``, then the caller's ``n_meta`` integers). Use as a context manager: the files are
    removed on exit."""

    def __init__(self, directory: Path, stem: str, n_meta: int, with_mask: bool = False,
                 buffer_tokens: Optional[int] = None):
        self.paths = {k: Path(directory) / f"{stem}.{k}" for k in (("ids", "mask", "meta") if with_mask
                                                                   else ("ids", "meta"))}
        self.width = 1 + int(n_meta)
        self.buffer_tokens = int(buffer_tokens or BUFFER_TOKENS)
        self.n_samples = 0
        self.n_tokens = 0
        self.written = 0  # bytes handed to the files (by flush)
        self._files = {}
        self._buf: dict[str, list] = {k: [] for k in self.paths}
        self._buffered = 0
        try:
            for k, p in self.paths.items():
                self._files[k] = open(p, "w+b")
        except BaseException:
            self.remove()
            raise

    def __enter__(self) -> "SampleSpool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:  # a full disk: what was free and written before the files go (packfile.disk_full)
            note_full_disk(exc, next(iter(self.paths.values())).parent, self.written)
        self.remove()

    def add(self, ids: Sequence[int], meta: Sequence[int], mask: Optional[np.ndarray] = None) -> None:
        """Append one sample: ``ids`` (token ids), ``meta`` (``n_meta`` integers), ``mask`` (same length as
        ``ids``; with ``with_mask``)."""
        a = np.asarray(ids, dtype=np.uint32)
        self._buf["ids"].append(a)
        if "mask" in self._buf:
            self._buf["mask"].append(np.asarray(mask, dtype=np.uint8))
        self._buf["meta"].append([self.n_tokens, *meta])
        self.n_samples += 1
        self.n_tokens += len(a)
        self._buffered += len(a) + 1
        if self._buffered >= self.buffer_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples out."""
        if not self._buf["meta"]:
            return
        for k, parts in self._buf.items():
            if k == "meta":
                arr = np.asarray(parts, dtype=np.int64).reshape(-1, self.width)
            else:
                arr = np.concatenate(parts)
            self._files[k].write(arr.tobytes())
            self.written += arr.nbytes
            parts.clear()
        self._buffered = 0

    def close(self) -> None:
        """Flush and make the files readable (:meth:`meta`, :meth:`ids`, :meth:`mask`)."""
        self.flush()
        for f in self._files.values():
            f.flush()

    def _read(self, key: str, dtype, first: int, count: int) -> np.ndarray:
        dt = np.dtype(dtype)
        raw = os.pread(self._files[key].fileno(), int(count) * dt.itemsize, int(first) * dt.itemsize)
        if len(raw) != int(count) * dt.itemsize:
            raise OSError(f"{self.paths[key]}: short read ({len(raw)} bytes)")
        return np.frombuffer(raw, dtype=dt)

    def meta(self, a: int, b: int) -> np.ndarray:
        """Records of samples ``a .. b - 1``: int64 ``[b - a, 1 + n_meta]`` (column 0: first token offset)."""
        return self._read("meta", np.int64, a * self.width, (b - a) * self.width).reshape(b - a, self.width)

    def ids(self, first: int, stop: int) -> np.ndarray:
        """Token ids ``first .. stop - 1`` of the ids file (uint32)."""
        return self._read("ids", np.uint32, first, stop - first)

    def mask(self, first: int, stop: int) -> np.ndarray:
        """Mask values ``first .. stop - 1`` (uint8; one per token)."""
        return self._read("mask", np.uint8, first, stop - first)

    def remove(self) -> None:
        """Close and delete the files."""
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        for p in self.paths.values():
            p.unlink(missing_ok=True)


class BuildProgress:
    """While a build renders: every ``every_s`` seconds touch the build ``lock`` (so another node waiting on
    it does not take it over as stale) and log ``data: rendering <what>: ...`` through ``log``."""

    def __init__(self, log: Callable[[str], None], what: str, lock: Optional[Path], every_s: float):
        self.log, self.what, self.lock, self.every = log, what, lock, float(every_s)
        self.t0 = self.last = time.monotonic()

    def step(self, rows: int, kept: int, tokens: int) -> None:
        """Report ``rows`` read, ``kept`` samples and their ``tokens`` so far (when the interval has passed)."""
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        self.touch()
        self.log(f"data: rendering {self.what}: {rows:,} rows read, {kept:,} kept, {tokens:,} tokens, "
                 f"{now - self.t0:.0f} s")

    def touch(self) -> None:
        """Touch the build lock (also while laying rows out, without a log line)."""
        if self.lock is not None:
            with contextlib.suppress(OSError):
                os.utime(self.lock)


def segment_indices(src_starts: np.ndarray, lens: np.ndarray, dst_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` int64 element indices that copy segment ``k`` (``lens[k]`` elements from ``src_starts[k]``)
    to ``dst_starts[k]``, all segments one after another: ``out.reshape(-1)[dst] = flat[src]``."""
    lens = np.asarray(lens, dtype=np.int64)
    within = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return (np.repeat(np.asarray(src_starts, dtype=np.int64), lens) + within,
            np.repeat(np.asarray(dst_starts, dtype=np.int64), lens) + within)


def split_max(values: int, padded: bool, pad_id: int, rows: int) -> int:
    """The largest id of a split's ``[rows, row]`` array: ``values`` (the largest sample id, -1 when none),
    ``pad_id`` too when a row is padded; -1 for an empty split (as :func:`~npu_train.data.packfile.save_packed`
    records ``max_id``)."""
    if rows == 0:
        return -1
    return max(int(values), int(pad_id)) if padded else int(values)


def when_built(losses: dict, kinds: Sequence[str], kept_note: Callable[[dict], tuple[str, str]]) -> str:
    """The cached line's ``"; when built: ..."`` part: what the build of a cached file dropped or cut, from the
    ``losses`` it recorded (:func:`~npu_train.data.packfile.read_losses`). "" when none of the counts ``kinds``
    (besides ``bad``) is set, or the file records nothing (written before they were recorded); else the build's
    summary from ``kept_note(losses)`` (``(head, tail)``, as the first build logged it) and the first bad row."""
    if not any(losses.get(k) for k in ("bad", *kinds)):
        return ""
    head, tail = kept_note(losses)
    first = f"; first bad row: {losses['first_bad']}" if losses.get("bad") and losses.get("first_bad") else ""
    return f"; when built: {head}{tail}{first}"


def train_val_ranges(kept: Sequence[int], splits: Sequence[str], val_fraction: float, spec: str,
                     unit: tuple[str, str], fix: str, summary: str,
                     log: Callable[[str], None]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The train and validation ranges ``[a, b)`` over the spooled samples in read order: with two ``splits``
    (``data.split``, ``data.val_split``), the first split's ``kept[0]`` samples, then the second's; with one,
    the last :func:`n_val_rows` of them are validation. Raises :class:`DataError`
    (``summary`` logged first) when a split has no usable sample, or, with one split, fewer than 2 are usable;
    ``unit`` names a sample (singular, plural: "chat sample", "chat samples") and ``fix`` the remedy."""
    total = sum(kept)
    if len(splits) == 2:
        for got, name in zip(kept, splits):
            if got < 1:
                log(summary)
                raise DataError(f"no usable {unit[0]} in split {name!r} of {spec} (train and validation need one "
                                f"each); {fix}, or add rows to that split")
        return (0, kept[0]), (kept[0], total)
    if total < 2:
        log(summary)
        raise DataError(f"only {total} usable {unit[1]} in {spec} (need 2: train and validation); {fix}, or add rows")
    n_val = n_val_rows(total, val_fraction)
    return (0, total - n_val), (total - n_val, total)
