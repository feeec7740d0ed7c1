"""Fixed-length packing of a tokenized text source into train / validation rows (:class:`PackedData`), stored
once on disk and memory-mapped.

Documents are streamed from the source (:mod:`npu_train.data.sources`), tokenized in batches with the
tokenizers library's ``encode_batch`` (parallel over the host's cores), joined with ``eos_id`` (or a blank
line) and written straight to the cache file as ``uint16`` (vocabulary <= 65536) or ``uint32`` ids; rows of
``seq_len + 1`` tokens (tail dropped), ``input_ids = row[:-1]``, ``labels = row[1:]``. The last
``val_fraction`` of rows is validation (or a ``DatasetDict``'s ``data.val_split``).

The file is a safetensors file (an 8-byte header length, a JSON header, the raw arrays): the named arrays of
:data:`ARRAY_FIELDS` present in the data plus ``__metadata__`` (format, seq_len, n_tokens, fingerprint,
max_id; ``losses``: what the build dropped, repeated on a cache hit, :func:`losses_meta`).
:func:`load_packed` maps every array read-only-in-effect (``np.memmap`` copy-on-write, never written), so
no card process holds the corpus in its own memory; :func:`micro_batch_tensors` turns just the selected
rows into int64. Cached under ``cache_dir`` keyed by :func:`data_fingerprint` (the source's
cheap key: file sizes, mtimes and a sample hash; the tokenizer; the packing knobs).
With ``doc_mask=True`` the file's metadata names the EOS id and each selected row's position ids restart
after every EOS (:func:`doc_positions`, computed when the rows are read), so attention stays within each
document (:mod:`npu_train.model.masks`); packed SFT rows store their positions (``*_positions``)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from safetensors.numpy import save_file

from npu_train.model.llama import IGNORE_INDEX

from .sources import BadRows, Source, resolve_source, source_key, split_pieces, text_pieces
from .text import DataError, botchan_text

__all__ = [
    "ARRAY_FIELDS",
    "PackedData",
    "build_packed_data",
    "data_fingerprint",
    "packed_cache_path",
    "save_packed",
    "PackedFileWriter",
    "build_cached",
    "build_lock",
    "disk_full",
    "note_full_disk",
    "lock_path",
    "packed_meta",
    "losses_meta",
    "read_losses",
    "space_hint",
    "load_packed",
    "tokenize_documents",
    "micro_batch_tensors",
    "micro_batch_positions",
    "doc_positions",
    "n_val_rows",
    "token_dtype",
    "tokenizer_hash",
]

_FORMAT = "npu-train-packed-v2"
_CHUNK_CHARS = 32_768
#: characters of text per encode_batch call (the tokenizers library spreads one call over the cores)
BATCH_CHARS = 1 << 20
#: seconds between progress lines while tokenizing
PROGRESS_S = 10.0
#: bytes reserved for the safetensors JSON header of a streamed file (padded with spaces)
_HEADER_RESERVE = 8192
#: a build lock not touched for this long is taken over (its builder died), seconds
LOCK_STALE_S = 120.0
#: the PackedData fields stored as arrays (2-D, ``[N, seq_len + 1]``), in file order; None fields are absent.
#: A new optional per-token array (e.g. per-sample positions) is a PackedData field named here: save_packed
#: stores it in the smallest dtype that holds it and load_packed maps it like the others.
ARRAY_FIELDS = ("train", "val", "train_labels", "val_labels", "train_positions", "val_positions")
_ST_DTYPES = {np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32",
              np.dtype(np.int16): "I16", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
              np.dtype(np.bool_): "BOOL"}
_NP_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


@dataclass
class PackedData:
    """Packed token rows. ``train``/``val``: ``[N, seq_len + 1]`` integer token ids (int64 when built in
    memory; uint16 / uint32 when mapped from a file).

    ``n_tokens``: stream length before the tail was dropped (chat: unpadded tokens); ``fingerprint``: hex
    sha256 cache key; ``train_labels``/``val_labels``: same shape, chat data only (None for text): either
    int64 labels (``IGNORE_INDEX`` where not trained) or a uint8 / bool mask (1 = the token is a target;
    labels = ids where 1, else ``IGNORE_INDEX``). ``path``: the file the arrays are memory-mapped from
    (None when they live in this process's memory). ``train_positions``/``val_positions``:
    same shape, each token's position in its sample, restarting at 0 at every sample start (packed SFT rows);
    ``doc_eos``: packed text with ``data.doc_mask`` (positions restart after this EOS id; computed per read).
    Neither: one sample per row, positions ``0..seq_len``. ``pairs``: preference data
    (``data.format=preference``, :mod:`npu_train.data.preference`): rows ``2i`` / ``2i + 1`` of each split
    are the chosen / rejected completion of pair ``i`` (same prompt), one sample per row; stored in the
    file's metadata (files without it: False)."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    n_tokens: int
    fingerprint: str
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None
    path: str | None = None
    train_positions: torch.Tensor | None = None
    val_positions: torch.Tensor | None = None
    doc_eos: int | None = None
    pairs: bool = False

    @property
    def n_train(self) -> int:
        return int(self.train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.val.shape[0])


# ----------------------------------------------------------------------------- tokenize


def _split_chunks(doc: str, size: int = _CHUNK_CHARS) -> list[str]:
    """Cut ``doc`` into ~``size``-char pieces at line starts that begin with a non-space."""
    pieces, rest = split_pieces(doc, size)
    return pieces + [rest] if rest or not pieces else pieces


def _encode_doc(tokenizer, doc: str) -> list[int]:
    """Token ids of one document, chunked when that is exact (see :func:`chunk_safe`)."""
    chunks = _split_chunks(doc)
    if len(chunks) == 1:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    first_two = tokenizer.encode(chunks[0] + chunks[1], add_special_tokens=False).ids
    encs = tokenizer.encode_batch(chunks, add_special_tokens=False)
    if first_two != encs[0].ids + encs[1].ids:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    return [i for e in encs for i in e.ids]


def chunk_safe(tokenizer) -> bool:
    """Whether tokenizing a document in pieces cut at line starts equals tokenizing it whole (true for
    byte-level BPE: a pre-token never crosses a "\\n" followed by a non-space; false e.g. for a tokenizer that
    prepends a marker to its input). Probed on the first two pieces of the shipped Botchan text."""
    pieces, _ = split_pieces(botchan_text()[: 3 * _CHUNK_CHARS], _CHUNK_CHARS)
    whole = tokenizer.encode(pieces[0] + pieces[1], add_special_tokens=False).ids
    parts = tokenizer.encode_batch(pieces[:2], add_special_tokens=False)
    return whole == parts[0].ids + parts[1].ids


def token_batches(tokenizer, pieces: Iterable[tuple[int, str]], eos_id: int | None,
                  batch_chars: int = BATCH_CHARS) -> Iterator[tuple[np.ndarray, int]]:
    """``(ids, chars)``: uint32 token ids of consecutive pieces (``eos_id``, or the tokens of a blank line when
    None, between documents) and the characters they came from, about ``batch_chars`` characters per batch.
    Three threads: a reader prepares the next text batches, an encoder thread calls ``encode_batch_fast``
    (Rayon: all cores) on one batch after another, and this thread turns the previous batch's encodings into
    one array (``np.fromiter`` over the ids lists) meanwhile, so that Python work (which holds the GIL) does
    not leave the cores idle between two encode calls."""
    enc = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch

    def encoded() -> Iterator[tuple[list, list, int]]:
        for batch, docs, chars in _prefetched(_text_batches(pieces, batch_chars)):
            yield enc(batch, add_special_tokens=False), docs, chars

    sep = [int(eos_id)] if eos_id is not None else None
    prev = None
    for encs, docs, chars in _prefetched(encoded(), depth=1, name="npt-data-encode"):
        if sep is None:
            sep = tokenizer.encode("\n\n", add_special_tokens=False).ids
        parts = []
        for d, e in zip(docs, encs):
            if prev is not None and d != prev:
                parts.append(sep)
            prev = d
            parts.append(e.ids)
        n = sum(map(len, parts))
        yield np.fromiter(itertools.chain.from_iterable(parts), dtype=np.uint32, count=n), chars


def _text_batches(pieces: Iterable[tuple[int, str]], batch_chars: int) -> Iterator[tuple[list, list, int]]:
    batch, docs, chars = [], [], 0
    for d, piece in pieces:
        batch.append(piece)
        docs.append(d)
        chars += len(piece)
        if chars >= batch_chars:
            yield batch, docs, chars
            batch, docs, chars = [], [], 0
    if batch:
        yield batch, docs, chars


def _prefetched(it: Iterator, depth: int = 2, name: str = "npt-data-read") -> Iterator:
    """``it``'s items, produced by a background thread (``name``) up to ``depth`` ahead: reading and parsing
    the source (pyarrow and file reads release the GIL) overlaps the tokenizer's ``encode_batch`` (which
    releases it too). An exception in the producer is raised here; the producer stops (and closes ``it``)
    when the consumer is closed."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((end, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((end, e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    th = threading.Thread(target=produce, name=name, daemon=True)
    th.start()
    try:
        while True:
            item, err = q.get()
            if item is end:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        while th.is_alive():
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            th.join(0.05)


def tokenize_documents(tokenizer, docs: list[str], eos_id: int | None) -> list[int]:
    """One token stream for ``docs`` (no special tokens; ``eos_id`` between documents, a blank line when None)."""
    whole = not chunk_safe(tokenizer)
    pieces = ((k, p) for k, d in enumerate(docs) for p in ([d] if whole else _split_chunks(d)))
    return [int(i) for ids, _ in token_batches(tokenizer, pieces, eos_id) for i in ids]


# ----------------------------------------------------------------------------- caching


def tokenizer_hash(tokenizer) -> str:
    """sha256 hex of the tokenizer's full JSON serialization (a cache-key part)."""
    try:
        blob = tokenizer.to_str()
    except Exception as e:  # pragma: no cover - every tokenizers.Tokenizer has to_str
        raise DataError(f"cannot fingerprint tokenizer {type(tokenizer).__name__}: {e}") from e
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def data_fingerprint(src_key: str, tokenizer, seq_len: int, val_fraction: Optional[float], eos_id: int | None,
                     text_field: str = "text", doc_mask: bool = False) -> str:
    """sha256 hex key over the source's cheap key (:func:`~npu_train.data.sources.source_key`), the text
    column, the tokenizer serialization and the packing knobs (``doc_mask`` only when on); ``val_fraction``
    None: validation is a split (``data.val_split``), so the fraction is not used and not in the key."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\nsource {src_key}\nfield {text_field}\n".encode())
    h.update(f"tokenizer {tokenizer_hash(tokenizer)}\n".encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\neos_id {eos_id}\n".encode())
    if doc_mask:  # only when on: the keys of existing caches stay
        h.update(b"doc_mask 1\n")
    return h.hexdigest()


def packed_cache_path(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    return Path(cache_dir) / f"packed-{fingerprint[:32]}.safetensors"


def token_dtype(limit: int | None) -> np.dtype:
    """The smallest unsigned dtype for ids ``< limit`` (uint16 up to 65536 entries, else uint32)."""
    return np.dtype(np.uint16) if limit is not None and limit <= 1 << 16 else np.dtype(np.uint32)


def _compact(name: str, t: torch.Tensor, ids: torch.Tensor | None) -> np.ndarray:
    """``t`` as a compact numpy array: ids as uint16/uint32; labels that are ``ids`` or IGNORE_INDEX as a
    uint8 mask (other labels int32); any other array in the smallest signed/unsigned dtype that holds it."""
    a = t.detach().cpu()
    if a.dtype in (torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.int16, torch.int32):
        return a.numpy()
    if ids is not None and name.endswith("_labels"):
        mask = a != IGNORE_INDEX
        if torch.equal(torch.where(mask, ids.to(torch.int64), IGNORE_INDEX), a.to(torch.int64)):
            return mask.to(torch.uint8).numpy()
        return a.to(torch.int32).numpy()
    lo = int(a.min()) if a.numel() else 0
    hi = int(a.max()) if a.numel() else 0
    if lo >= 0:
        return a.numpy().astype(token_dtype(hi + 1))
    return a.to(torch.int32).numpy()


#: free space kept beyond the packed tensors' bytes when writing them (header, filesystem slack), bytes
PACKED_MARGIN_BYTES = 1 << 20


def _short(need: int, path: Path, free: int, where: str) -> DataError:
    return DataError(f"the packed training data needs {need / 1e6:.1f} MB in {path.parent} but only "
                     f"{free / 1e6:.1f} MB are free: free disk space there" + (f" or {where}" if where else ""))


def packed_meta(seq_len: int, n_tokens: int, fingerprint: str, max_id: int, pairs: bool = False,
                losses: Optional[dict] = None) -> dict:
    """The ``__metadata__`` of a packed-data file written by :func:`save_packed` / :class:`PackedFileWriter`
    (``max_id``: the largest id in the ``train`` / ``val`` arrays, padding included; -1 when both are empty;
    ``losses``: what the build dropped, see :func:`losses_meta`)."""
    meta = {"format": _FORMAT, "seq_len": str(int(seq_len)), "n_tokens": str(int(n_tokens)),
            "fingerprint": fingerprint, "max_id": str(int(max_id))}
    if pairs:
        meta["pairs"] = "1"
    meta.update(losses_meta(losses))
    return meta


#: characters of the first bad row's description kept in a packed file's ``losses`` metadata
FIRST_BAD_CHARS = 400


def losses_meta(losses: Optional[dict]) -> dict:
    """The metadata entry (``{"losses": JSON}``, or ``{}`` for None) recording what a build dropped or cut:
    counts by kind (``int``; e.g. ``bad`` rows skipped, samples ``long``er than a row) and ``first_bad``, the
    first bad row's place and reason (cut to :data:`FIRST_BAD_CHARS`). Repeated on a cache hit
    (:func:`read_losses`); not part of the cache key, so files written before it stay valid."""
    if not losses:
        return {}
    out = dict(losses)
    if "first_bad" in out:
        out["first_bad"] = str(out["first_bad"])[:FIRST_BAD_CHARS]
    return {"losses": json.dumps(out, sort_keys=True)}


def read_losses(path: Optional[str | os.PathLike]) -> dict:
    """The ``losses`` a packed file's build recorded (:func:`losses_meta`), ``{}`` when it has none (written
    before they were recorded, built in memory) or they cannot be read."""
    if path is None:
        return {}
    try:
        got = json.loads(_read_header(Path(path))[0].get("__metadata__", {}).get("losses") or "{}")
    except (OSError, ValueError, DataError, AttributeError):
        return {}
    return got if isinstance(got, dict) else {}


def disk_full(path: Path, where: str = "", need: int = 0, free: Optional[int] = None, written: int = 0) -> DataError:
    """The error for a full disk while writing packed data next to ``path``; names the fix (free space there,
    or ``where``). ``free``: the free bytes when the write failed (measured now when None: call it before the
    partial files are removed, or the space they held reads as free); ``written``: bytes of partial files the
    build had written by then (removed since); ``need``: the bytes the packed file needs, when known."""
    import shutil

    if free is None:
        free = shutil.disk_usage(Path(path).parent).free
    said = [f"{free / 1e6:.1f} MB free when the write failed"]
    if written:
        said.append(f"{written / 1e6:.1f} MB written by then, removed since")
    if need:
        said.append(f"the packed data needs {need / 1e6:.1f} MB")
    return DataError(f"the disk ran out of space in {Path(path).parent} ({'; '.join(said)}) while writing the "
                     "packed training data: free disk space there" + (f" or {where}" if where else ""))


def note_full_disk(e: BaseException, directory: Path, written: int = 0) -> None:
    """When ``e`` reports a full disk (:func:`~npu_train.errors.out_of_space`), record on it the free space of
    ``directory`` now (the first record stays) and add ``written`` bytes of partial files, for :func:`disk_full`
    once they are removed (``npt_free_bytes`` / ``npt_written_bytes``). Call it before removing them."""
    import shutil

    from npu_train.errors import out_of_space

    if not out_of_space(e):
        return
    with contextlib.suppress(Exception):  # an exception type without attributes: the message measures later
        if getattr(e, "npt_free_bytes", None) is None:
            e.npt_free_bytes = shutil.disk_usage(directory).free
        e.npt_written_bytes = getattr(e, "npt_written_bytes", 0) + int(written)


def _size(path: Path) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class PackedFileWriter:
    """A packed-data file (the format :func:`load_packed` maps) written in blocks of rows: the arrays' dtypes
    and row counts (``arrays``: name of :data:`ARRAY_FIELDS` -> ``(dtype, rows)``, each ``[rows, row]``) are
    known up front, so the header goes first and every block is written straight to its place
    (``os.pwrite``; nothing is mapped, so the writer holds one block). Arrays are laid out largest item size
    first, so each stays aligned. Refuses (:class:`DataError` naming the fix) when the free space is below
    the arrays' bytes + :data:`PACKED_MARGIN_BYTES` (as :func:`save_packed`) or runs out while writing."""

    def __init__(self, path: Path, row: int, arrays: dict, meta: dict, where: str = ""):
        import shutil

        self.path, self.row, self.where = Path(path), int(row), where
        order = sorted(arrays, key=lambda n: (-np.dtype(arrays[n][0]).itemsize, ARRAY_FIELDS.index(n)))
        header: dict = {"__metadata__": meta}
        self.places: dict[str, tuple[int, np.dtype]] = {}
        end = 0
        for name in order:
            dt, rows = np.dtype(arrays[name][0]), int(arrays[name][1])
            size = rows * self.row * dt.itemsize
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": [rows, self.row], "data_offsets": [end, end + size]}
            self.places[name] = (end, dt)
            end += size
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        self.need = end + PACKED_MARGIN_BYTES
        free = shutil.disk_usage(self.path.parent).free
        if free < self.need:
            raise _short(self.need, self.path, free, where)
        self.base = 8 + len(blob)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._pwrite(struct.pack("<Q", len(blob)) + blob, 0)
            os.ftruncate(self.fd, self.base + end)
        except BaseException:
            self.close()
            raise

    def _pwrite(self, buf, pos: int) -> None:
        from npu_train.errors import out_of_space

        view = memoryview(buf).cast("B")
        try:
            while len(view):
                n = os.pwrite(self.fd, view, pos)
                view, pos = view[n:], pos + n
        except OSError as e:
            if out_of_space(e):
                raise disk_full(self.path, self.where, self.need) from e
            raise

    def write(self, name: str, first_row: int, block: np.ndarray) -> None:
        """Rows ``first_row ..`` of array ``name``: ``block`` ``[k, row]``, converted to the array's dtype."""
        off, dt = self.places[name]
        a = np.ascontiguousarray(block, dtype=dt)
        assert a.ndim == 2 and a.shape[1] == self.row, a.shape
        self._pwrite(a, self.base + off + int(first_row) * self.row * dt.itemsize)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _max_id(data: PackedData) -> int:
    return max((int(t.max()) if t.numel() else -1) for t in (data.train.to(torch.int64), data.val.to(torch.int64)))


def save_packed(data: PackedData, path: str | os.PathLike, where: str = "") -> Path:
    """Write ``data`` (in memory) to ``path`` atomically (temp file + rename), arrays compacted (ids uint16 /
    uint32, labels as a uint8 mask).

    Raises :class:`DataError` (nothing left behind) when the free space is below the arrays' bytes +
    :data:`PACKED_MARGIN_BYTES` or runs out; the message names ``where`` (the setting that moves it)."""
    import shutil

    from npu_train.errors import out_of_space

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    arrays = {}
    for name in ARRAY_FIELDS:
        t = getattr(data, name)
        if t is not None:
            ids = getattr(data, name.split("_")[0]) if name != name.split("_")[0] else None
            arrays[name] = np.ascontiguousarray(_compact(name, t, ids))
    need = sum(a.nbytes for a in arrays.values()) + PACKED_MARGIN_BYTES
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise _short(need, path, free, where)
    meta = packed_meta(data.seq_len, data.n_tokens, data.fingerprint, _max_id(data), data.pairs)
    if data.doc_eos is not None:
        meta["doc_eos"] = str(int(data.doc_eos))
    try:
        save_file(arrays, str(tmp), metadata=meta)
    except Exception as e:  # OSError, or safetensors' SafetensorError wrapping the I/O error
        free = shutil.disk_usage(path.parent).free if out_of_space(e) else 0  # before the partial file goes
        written = _size(tmp)
        tmp.unlink(missing_ok=True)
        if out_of_space(e):
            raise disk_full(path, where, need, free, written) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DataError(f"{path}: truncated packed-data file; delete it so it is rebuilt")
        n = struct.unpack("<Q", head)[0]
        if n > 100 << 20:
            raise DataError(f"{path}: not a packed-data file (header of {n} bytes); delete it so it is rebuilt")
        try:
            return json.loads(f.read(n)), 8 + n
        except ValueError:
            raise DataError(f"{path}: not a packed-data file (unreadable header); delete it so it is rebuilt") from None


def _map(path: Path, base: int, info: dict) -> torch.Tensor:
    dtype = _NP_DTYPES.get(info.get("dtype"))
    if dtype is None:
        raise DataError(f"{path}: array dtype {info.get('dtype')!r} is not supported; delete the file so it is rebuilt")
    shape = tuple(int(x) for x in info["shape"])
    a, b = (int(x) for x in info["data_offsets"])
    if b - a != int(np.prod(shape)) * dtype.itemsize:
        raise DataError(f"{path}: array sizes disagree with the header; delete the file so it is rebuilt")
    if b == a:
        return torch.from_numpy(np.zeros(shape, dtype=dtype))
    # copy-on-write mapping: pages come from the page cache (shared between processes), never written
    return torch.from_numpy(np.memmap(path, dtype=dtype, mode="c", offset=base + a, shape=shape))


def load_packed(path: str | os.PathLike) -> PackedData:
    """Memory-map a file written by ``save_packed`` / :func:`build_packed_data` (nothing is read into this
    process's own memory; :func:`micro_batch_tensors` reads the selected rows)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed data file {path} does not exist; build it with build_packed_data")
    header, base = _read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != _FORMAT:
        raise DataError(
            f"{path}: not a packed-data file of format {_FORMAT!r} (got {meta.get('format')!r}); "
            "delete it so it is rebuilt"
        )
    if os.path.getsize(path) < base + max((int(v["data_offsets"][1]) for k, v in header.items()
                                           if k != "__metadata__"), default=0):
        raise DataError(f"{path}: truncated packed-data file; delete it so it is rebuilt")
    seq_len = int(meta["seq_len"])
    arrays = {name: _map(path, base, header[name]) for name in ARRAY_FIELDS if name in header}
    for name, t in arrays.items():
        if t.dim() != 2 or t.shape[1] != seq_len + 1:
            raise DataError(f"{path}: array {name!r} has shape {tuple(t.shape)}, expected [N, {seq_len + 1}]; "
                            "delete the file so it is rebuilt")
    if "train" not in arrays or "val" not in arrays:
        raise DataError(f"{path}: no 'train' / 'val' arrays; delete the file so it is rebuilt")
    doc_eos = int(meta["doc_eos"]) if meta.get("doc_eos") not in (None, "") else None
    return PackedData(seq_len=seq_len, n_tokens=int(meta["n_tokens"]), fingerprint=meta["fingerprint"],
                      path=str(path), doc_eos=doc_eos, pairs=meta.get("pairs") == "1", **arrays)


# ----------------------------------------------------------------------------- packing


def _check_vocab(max_id: int, vocab_size: int | None) -> None:
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(
            f"tokenizer produced id {max_id} but the model's vocabulary has {vocab_size} entries: "
            "the tokenizer does not match the model (use the tokenizer that ships with the model)"
        )


def n_val_rows(n_seq: int, val_fraction: float) -> int:
    """Validation rows of ``n_seq``: ``round(n_seq * val_fraction)``, at least 1 when > 0, at most ``n_seq - 1``."""
    if val_fraction <= 0:
        return 0
    return min(max(1, int(round(n_seq * val_fraction))), n_seq - 1)


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
                     f"({min(100.0, 100 * self.chars / self.total):.0f}%), {self.tokens / 1e6:.2f}M tokens, "
                     f"{rate:.2f} MB/s, {now - self.t0:.0f} s")

    def done(self) -> None:
        dt = time.monotonic() - self.t0
        self.log(f"data: tokenized {self.spec}: {self.chars / 1e6:.1f} MB into {self.tokens / 1e6:.2f}M tokens "
                 f"in {dt:.1f} s ({self.chars / 1e6 / max(dt, 1e-9):.2f} MB/s)")


class _StreamFile:
    """A safetensors file written as a token stream: 8-byte header length, a reserved (space-padded) JSON
    header, then the ids as they come; :meth:`finish` writes the header over the reserved bytes."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, dtype
        self.f = open(path, "wb")
        self.f.write(b"\0" * (8 + _HEADER_RESERVE))
        self.n = 0  # tokens written

    def write(self, ids: np.ndarray) -> None:
        self.f.write(ids.astype(self.dtype, copy=False).tobytes())
        self.n += len(ids)

    def cut(self, n: int) -> None:
        """Keep only the first ``n`` tokens (drop a tail that does not fill a row)."""
        self.f.flush()
        self.f.truncate(8 + _HEADER_RESERVE + n * self.dtype.itemsize)
        self.f.seek(0, os.SEEK_END)
        self.n = n

    def finish(self, arrays: dict[str, tuple[int, int, int]], meta: dict) -> None:
        """``arrays``: name -> (first token, rows, row length); the arrays must tile the stream in order."""
        st, isz = _ST_DTYPES[self.dtype], self.dtype.itemsize
        header = {"__metadata__": meta}
        for name, (first, rows, row) in arrays.items():
            header[name] = {"dtype": st, "shape": [rows, row], "data_offsets": [first * isz, (first + rows * row) * isz]}
        blob = json.dumps(header).encode()
        if len(blob) > _HEADER_RESERVE:  # pragma: no cover - a handful of arrays and short metadata
            raise DataError(f"{self.path}: packed-data header too long ({len(blob)} bytes)")
        self.f.flush()
        self.f.seek(0)
        self.f.write(struct.pack("<Q", _HEADER_RESERVE) + blob + b" " * (_HEADER_RESERVE - len(blob)))
        self.f.close()


def lock_path(target: Path) -> Path:
    """The file :func:`build_lock` holds while ``target`` is built (touched by the builder's progress)."""
    return target.with_name(target.name + ".lock")


def _holder_gone(holder: str) -> bool:
    """Whether a build lock's ``"<host> pid <n>"`` record names a process of this host that no longer runs (a
    launcher killed with SIGKILL); a holder on another host is never judged from here."""
    parts = holder.split()
    if len(parts) != 3 or parts[1] != "pid" or parts[0] != socket.gethostname() or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by another user
        return False
    return False


@contextlib.contextmanager
def build_lock(target: Path, log: Callable[[str], None], ready: Optional[Callable[[], bool]] = None,
               stale_s: float = LOCK_STALE_S, poll_s: float = 0.5) -> Iterator[bool]:
    """Hold ``<target>.lock`` while building ``target``: yields True to build; False when another process
    (another node on a shared cache, or a concurrent launch) finished ``target`` meanwhile (``ready()``,
    default: the file exists). A lock whose file was not touched for ``stale_s`` seconds (the builder's progress
    touches it), or whose holder is a process of this host that no longer runs, is taken over."""
    lock = lock_path(target)
    ready = ready or target.is_file
    said = False
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if ready():
                yield False
                return
            try:
                age = time.time() - os.stat(lock).st_mtime
                holder = lock.read_text(errors="replace").strip()
            except OSError:
                continue
            gone = _holder_gone(holder)
            if age > stale_s or gone:
                why = "its process is gone" if gone else f"untouched for {age:.0f} s"
                log(f"data: taking over the stale build lock {lock} ({holder}, {why})")
                with contextlib.suppress(OSError):
                    os.unlink(lock)
                continue
            if not said:
                log(f"data: waiting for {holder or 'another process'} to tokenize the data into {target}")
                said = True
            time.sleep(poll_s)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()} pid {os.getpid()}\n")
        break
    try:
        yield not ready()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)


def _stream_split(out: _StreamFile, pieces, tokenizer, eos_id, vocab_size, progress: _Progress) -> int:
    """Tokenize ``pieces`` into ``out``; returns the largest id written (-1 when none)."""
    mx = -1
    limit = np.iinfo(out.dtype).max
    for ids, chars in token_batches(tokenizer, pieces, eos_id):
        if len(ids):
            m = int(ids.max())
            if m > limit:
                raise DataError(f"tokenizer produced id {m}, larger than the {out.dtype} token file holds: the "
                                "tokenizer does not match the model")
            _check_vocab(m, vocab_size)
            mx = max(mx, m)
        out.write(ids)
        progress.step(chars, len(ids))
    return mx


@dataclass(frozen=True)
class TextSpec:
    """What :func:`build_packed_data` packs: the source, its column, how bad rows are handled, the split names."""

    source: Source
    text_field: str = "text"
    bad_rows: str = "refuse"


def _too_short(n_tokens: int, row: int, seq_len: int, what: str = "dataset") -> DataError:
    return DataError(f"{what} too short: {n_tokens} tokens, need at least {2 * row if what == 'dataset' else row} "
                     f"({'2 sequences' if what == 'dataset' else '1 sequence'} of seq_len+1) for seq_len={seq_len}; "
                     "lower data.seq_len or add text")


def _write_packed(spec: TextSpec, tmp: Path, tokenizer, seq_len: int, val_fraction: float, eos_id,
                  vocab_size, fingerprint: str, log, progress_s: float, lock: Optional[Path],
                  doc_eos: Optional[int] = None) -> None:
    """Stream the train (and validation split) tokens of ``spec`` into ``tmp`` as a finished packed file
    (``doc_eos``: recorded in its metadata, ``data.doc_mask``)."""
    src, row = spec.source, seq_len + 1
    tok_vocab = getattr(tokenizer, "get_vocab_size", None)
    limit = max(vocab_size or 0, tok_vocab(True) if tok_vocab else 1 << 32)
    whole = lambda: not chunk_safe(tokenizer)  # noqa: E731 - asked only if a document must be cut
    out = _StreamFile(tmp, token_dtype(limit))
    progress = _Progress(log, src.spec, src.n_bytes, lock, progress_s)
    bad = BadRows()
    try:
        mx = _stream_split(out, text_pieces(src, spec.text_field, bad, spec.bad_rows, whole, src.split),
                           tokenizer, eos_id, vocab_size, progress)
        n_tokens = out.n
        if src.val_split is None:
            n_seq = n_tokens // row
            if n_tokens == 0:
                raise _no_text(src, spec.text_field, bad)
            if n_seq < 2:
                raise _too_short(n_tokens, row, seq_len)
            n_val = n_val_rows(n_seq, val_fraction)
            n_train = n_seq - n_val
        else:
            n_train = n_tokens // row
            if n_train < 1:
                raise _too_short(n_tokens, row, seq_len, f"the training split {src.split!r}")
            out.cut(n_train * row)
            mv = _stream_split(out, text_pieces(src, spec.text_field, bad, spec.bad_rows, whole, src.val_split),
                               tokenizer, eos_id, vocab_size, progress)
            mx = max(mx, mv)
            n_val = (out.n - n_train * row) // row
            n_tokens += out.n - n_train * row
            if n_val < 1:
                raise _too_short(out.n - n_train * row, row, seq_len, f"the validation split {src.val_split!r}")
        out.cut((n_train + n_val) * row)
        meta = {"format": _FORMAT, "seq_len": str(seq_len), "n_tokens": str(n_tokens), "fingerprint": fingerprint,
                "max_id": str(mx), "source": src.spec}
        if bad.count:
            meta.update(losses_meta({"bad": bad.count, "first_bad": bad.first}))
        if doc_eos is not None:
            meta["doc_eos"] = str(int(doc_eos))
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


def _free_check(directory: Path, src: Source, limit_itemsize: int, where: str) -> None:
    """Refuse before tokenizing when the free space cannot hold ~1 token per 3 source bytes."""
    import shutil

    need = src.n_bytes * limit_itemsize // 3 + PACKED_MARGIN_BYTES
    free = shutil.disk_usage(directory).free
    if free < need:
        raise _short(need, directory / "x", free, where)


def build_packed_data(
    text_spec: str | TextSpec,
    tokenizer,
    seq_len: int,
    val_fraction: float = 0.05,
    eos_id: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    log: Callable[[str], None] = lambda m: None,
    progress_s: float = PROGRESS_S,
    doc_mask: bool = False,
) -> PackedData:
    """Tokenize and pack ``text_spec`` (a ``data.source`` string or a :class:`TextSpec`) into a memory-mapped
    :class:`PackedData`, through ``cache_dir`` when given (else a temporary file, unlinked once mapped); with
    ``vocab_size`` every id is checked ``< vocab_size``. ``log`` gets progress lines. ``doc_mask``: positions
    restart after every ``eos_id`` (recorded as ``doc_eos`` in the file; needs ``eos_id``)."""
    seq_len = int(seq_len)
    if seq_len < 2:
        raise DataError(f"data.seq_len={seq_len} is too small; it must be at least 2")
    val_fraction = float(val_fraction)
    if not (0.0 <= val_fraction < 1.0):
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1), e.g. 0.05")
    if eos_id is not None and vocab_size is not None and not (0 <= int(eos_id) < vocab_size):
        raise DataError(
            f"eos_id {eos_id} is outside the model's vocabulary of {vocab_size} entries: "
            "the tokenizer does not match the model"
        )
    if doc_mask and eos_id is None:
        raise DataError("data.doc_mask=true needs an EOS token between documents, but the model config has no "
                        "eos_token_id: set data.doc_mask=false")
    spec = text_spec if isinstance(text_spec, TextSpec) else TextSpec(resolve_source(str(text_spec), "text"))
    vf = None if spec.source.val_split is not None else val_fraction  # a split: the fraction is unused
    fingerprint = data_fingerprint(source_key(spec.source), tokenizer, seq_len, vf, eos_id, spec.text_field,
                                   doc_mask=bool(doc_mask))
    where = space_hint(cache_dir)

    def write(tmp: Path, lock: Optional[Path]) -> None:
        _free_check(tmp.parent, spec.source, 2, where)
        _write_packed(spec, tmp, tokenizer, seq_len, val_fraction, eos_id, vocab_size, fingerprint, log,
                      progress_s, lock, doc_eos=int(eos_id) if doc_mask else None)

    data, hit = build_cached(cache_dir, fingerprint, lambda path: _cached(path, fingerprint, seq_len, vocab_size),
                             write, log, where)
    losses = read_losses(data.path) if hit else {}
    if losses.get("bad"):  # what the first build reported, for a relaunch
        log(f"data: {data.n_train + data.n_val} packed sequences of {spec.source.spec} (cached); when built: "
            + BadRows(int(losses["bad"]), str(losses.get("first_bad", ""))).report())
    return data


def space_hint(cache_dir) -> str:
    """The setting that moves a packed-data build to a larger disk: ``$NPT_CACHE`` (a cache directory), else
    ``TMPDIR`` (the temporary directory); for :func:`disk_full` / :class:`PackedFileWriter` messages."""
    return ("point $NPT_CACHE at a larger disk" if cache_dir is not None
            else "set TMPDIR to a directory on a larger disk")


def _unwritable(directory: Path, cache_dir, e: Optional[OSError]) -> DataError:
    why = f" ({e.strerror})" if e is not None and e.strerror else ""
    fix = "point $NPT_CACHE at a writable directory" if cache_dir is not None else "set TMPDIR to a writable directory"
    return DataError(f"cannot write the packed training data into {directory}{why}: make it writable or {fix}")


def _remove_leftovers(directory: Path, fingerprint: str) -> None:
    """Remove the temporary files of earlier builds of ``fingerprint`` (``.packed-<key>.<pid>.tmp`` and its
    spool files) that a killed launcher left; called holding the build lock, so none of them is in use."""
    for p in directory.glob(f".packed-{fingerprint[:16]}.*.tmp*"):
        with contextlib.suppress(OSError):
            p.unlink()


def build_cached(cache_dir: str | os.PathLike | None, fingerprint: str,
                 cached: Callable[[Path], Optional[PackedData]], write: Callable[[Path, Optional[Path]], None],
                 log: Callable[[str], None], where: str = "") -> tuple[PackedData, bool]:
    """``(data, from_cache)``: the packed file for ``fingerprint`` under ``cache_dir`` when ``cached(path)``
    accepts it, else built by ``write(tmp, lock)`` into a temporary file there (``lock``: the build lock to
    touch while working, None without a cache) and renamed into place, one builder at a time
    (:func:`build_lock`: another node sharing the cache waits and maps the file built). Without
    ``cache_dir`` the file is built in the temporary directory, mapped and unlinked (``data.path`` None).
    The temporary file is removed when ``write`` raises; a full disk is a :class:`DataError` naming the fix
    (``where``: the setting that moves the directory)."""
    from npu_train.errors import out_of_space

    directory = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir())
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(directory, cache_dir, e) from e
    target = packed_cache_path(directory, fingerprint) if cache_dir is not None else None
    hit = cached(target) if target is not None and target.is_file() else None
    if hit is not None:
        return hit, True
    if not os.access(directory, os.W_OK | os.X_OK):  # a read-only mount, another user's directory
        raise _unwritable(directory, cache_dir, None)
    with contextlib.ExitStack() as stack:
        if target is not None:
            ready = lambda: target.is_file() and cached(target) is not None  # noqa: E731
            if not stack.enter_context(build_lock(target, log, ready)):
                return cached(target) or load_packed(target), True
            _remove_leftovers(directory, fingerprint)
        tmp = directory / f".packed-{fingerprint[:16]}.{os.getpid()}.tmp"
        try:
            write(tmp, lock_path(target) if target is not None else None)
        except BaseException as e:
            note_full_disk(e, directory, _size(tmp))  # what was free with the partial file still there
            tmp.unlink(missing_ok=True)
            if isinstance(e, Exception) and out_of_space(e):  # OSError, or a library's error naming ENOSPC
                raise disk_full(tmp, where, free=getattr(e, "npt_free_bytes", None),
                                written=getattr(e, "npt_written_bytes", 0)) from e
            raise
        if target is None:
            data = load_packed(tmp)
            tmp.unlink()  # the mapping stays valid
            data.path = None
            return data, False
        os.replace(tmp, target)
    return load_packed(target), False


def _cached(target: Optional[Path], fingerprint: str, seq_len: int, vocab_size) -> Optional[PackedData]:
    """The cache file ``target`` when it is valid for ``fingerprint`` (vocabulary checked), else None."""
    if target is None or not target.is_file():
        return None
    try:
        data = load_packed(target)
        meta = _read_header(target)[0]["__metadata__"]
    except Exception:  # noqa: BLE001 - unreadable / partial cache file: rebuild
        return None
    if data.fingerprint != fingerprint or data.seq_len != seq_len:
        return None
    _check_vocab(int(meta.get("max_id", -1)), vocab_size)
    return data


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
