"""The packed-data file: its format, the writers and the memory-mapped reader (:class:`PackedData`).

A safetensors file (an 8-byte header length, a JSON header, the raw arrays): the named arrays of
:data:`ARRAY_FIELDS` present in the data plus ``__metadata__`` (format, seq_len, n_tokens, fingerprint,
max_id; ``losses``: what the build dropped, repeated on a cache hit, :func:`losses_meta`; ``doc_eos`` for
text with ``data.doc_mask``; ``pairs`` for preference data). Rows hold ``seq_len + 1`` tokens as ``uint16``
(vocabulary <= 65536) or ``uint32`` ids; labels as a ``uint8`` target mask; positions in the smallest
unsigned dtype. Three writers: :class:`TokenStreamFile` (a token stream written as it comes, the text
build), :class:`PackedFileWriter` (blocks of rows written to their places, the SFT / preference builds) and
:func:`save_packed` (arrays in memory). :func:`load_packed` maps every array read-only-in-effect
(``np.memmap`` copy-on-write, never written), so no card process holds the corpus in its own memory.

Shared by the stages of :mod:`npu_train.data.prepare` (it imports none of them): the pack stage writes
this file, the cache stage keeps it, the batches stage reads it."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.numpy import save_file

from npu_train.model.llama import IGNORE_INDEX

from .text import DataError

__all__ = ["ARRAY_FIELDS", "PACKED_FORMAT", "PACKED_MARGIN_BYTES", "PackedData", "PackedFileWriter",
           "TokenStreamFile", "check_vocab", "disk_full", "file_size", "load_packed", "losses_meta",
           "note_full_disk", "packed_meta", "read_header", "read_losses", "save_packed", "short_of_space",
           "token_dtype"]

PACKED_FORMAT = "npu-train-packed-v2"


#: bytes reserved for the safetensors JSON header of a streamed file (padded with spaces)
_HEADER_RESERVE = 8192


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
    (``data.format=preference``, :mod:`npu_train.data.pack`): rows ``2i`` / ``2i + 1`` of each split
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


def short_of_space(need: int, path: Path, free: int, where: str) -> DataError:
    return DataError(f"the packed training data needs {need / 1e6:.1f} MB in {path.parent} but only "
                     f"{free / 1e6:.1f} MB are free: free disk space there" + (f" or {where}" if where else ""))


def packed_meta(seq_len: int, n_tokens: int, fingerprint: str, max_id: int, pairs: bool = False,
                losses: Optional[dict] = None) -> dict:
    """The ``__metadata__`` of a packed-data file written by :func:`save_packed` / :class:`PackedFileWriter`
    (``max_id``: the largest id in the ``train`` / ``val`` arrays, padding included; -1 when both are empty;
    ``losses``: what the build dropped, see :func:`losses_meta`)."""
    meta = {"format": PACKED_FORMAT, "seq_len": str(int(seq_len)), "n_tokens": str(int(n_tokens)),
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
        got = json.loads(read_header(Path(path))[0].get("__metadata__", {}).get("losses") or "{}")
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


def file_size(path: Path) -> int:
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
            raise short_of_space(self.need, self.path, free, where)
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
        raise short_of_space(need, path, free, where)
    meta = packed_meta(data.seq_len, data.n_tokens, data.fingerprint, _max_id(data), data.pairs)
    if data.doc_eos is not None:
        meta["doc_eos"] = str(int(data.doc_eos))
    try:
        save_file(arrays, str(tmp), metadata=meta)
    except Exception as e:  # OSError, or safetensors' SafetensorError wrapping the I/O error
        free = shutil.disk_usage(path.parent).free if out_of_space(e) else 0  # before the partial file goes
        written = file_size(tmp)
        tmp.unlink(missing_ok=True)
        if out_of_space(e):
            raise disk_full(path, where, need, free, written) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def read_header(path: Path) -> tuple[dict, int]:
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
    """Memory-map a file written by ``save_packed`` or a build (:mod:`npu_train.data.prepare`); nothing is read
    into this process's own memory (:func:`~npu_train.data.batches.micro_batch_tensors` reads the selected rows)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed data file {path} does not exist; build it with build_packed_data")
    header, base = read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != PACKED_FORMAT:
        raise DataError(
            f"{path}: not a packed-data file of format {PACKED_FORMAT!r} (got {meta.get('format')!r}); "
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


def check_vocab(max_id: int, vocab_size: int | None) -> None:
    if vocab_size is not None and max_id >= vocab_size:
        raise DataError(
            f"tokenizer produced id {max_id} but the model's vocabulary has {vocab_size} entries: "
            "the tokenizer does not match the model (use the tokenizer that ships with the model)"
        )


class TokenStreamFile:
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
