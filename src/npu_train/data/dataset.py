"""Fixed-length packing of a tokenized text source into train / validation rows (:class:`PackedData`).

Documents are tokenized, joined with ``eos_id`` (or a blank line) into one stream and cut into rows of
``seq_len + 1`` tokens (tail dropped); ``input_ids = row[:-1]``, ``labels = row[1:]``. The last
``val_fraction`` of rows is validation. Cached as safetensors keyed by text, tokenizer and settings.
With ``doc_mask=True`` each row also gets position ids restarting at the row start and after every
``eos_id`` (:func:`doc_positions`), so attention stays within each document (:mod:`npu_train.model.masks`)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .text import DataError, read_documents

__all__ = [
    "PackedData",
    "build_packed_data",
    "data_fingerprint",
    "packed_cache_path",
    "save_packed",
    "load_packed",
    "tokenize_documents",
    "micro_batch_tensors",
    "micro_batch_positions",
    "doc_positions",
    "n_val_rows",
    "tokenizer_hash",
]

_FORMAT = "npu-train-packed-v1"
_CHUNK_CHARS = 32_768


@dataclass
class PackedData:
    """Packed token rows. ``train``/``val``: ``[N, seq_len + 1]`` int64.

    ``n_tokens``: stream length before the tail was dropped (chat: unpadded tokens); ``fingerprint``: hex
    sha256 cache key; ``train_labels``/``val_labels``: same shape, ``IGNORE_INDEX`` where not trained
    (chat data only; None for text). ``train_positions``/``val_positions``: same shape, each token's position
    in its sample, restarting at 0 at every sample start (packed rows: ``data.pack`` / ``data.doc_mask``;
    None: one sample per row, positions ``0..seq_len``)."""

    train: torch.Tensor
    val: torch.Tensor
    seq_len: int
    n_tokens: int
    fingerprint: str
    train_labels: torch.Tensor | None = None
    val_labels: torch.Tensor | None = None
    train_positions: torch.Tensor | None = None
    val_positions: torch.Tensor | None = None

    @property
    def n_train(self) -> int:
        return int(self.train.shape[0])

    @property
    def n_val(self) -> int:
        return int(self.val.shape[0])


# ----------------------------------------------------------------------------- tokenize


def _split_chunks(doc: str, size: int = _CHUNK_CHARS) -> list[str]:
    """Cut ``doc`` into ~``size``-char pieces at line starts that begin with a non-space."""
    if len(doc) <= size:
        return [doc]
    chunks, start = [], 0
    while len(doc) - start > size:
        cut = start + size
        while True:
            nl = doc.find("\n", cut)
            if nl < 0 or nl + 1 >= len(doc):
                cut = -1
                break
            if not doc[nl + 1].isspace():
                cut = nl + 1
                break
            cut = nl + 1
        if cut < 0:
            break
        chunks.append(doc[start:cut])
        start = cut
    chunks.append(doc[start:])
    return chunks


def _encode_doc(tokenizer, doc: str) -> list[int]:
    chunks = _split_chunks(doc)
    if len(chunks) == 1:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    # Chunking at line starts is exact for byte-level BPE (a pre-token never crosses a
    # "\n" followed by a non-space), but not for every tokenizer (e.g. one that prepends
    # a space marker to its input). Check on the first boundary; otherwise encode whole.
    first_two = tokenizer.encode(chunks[0] + chunks[1], add_special_tokens=False).ids
    encs = tokenizer.encode_batch(chunks, add_special_tokens=False)
    if first_two != encs[0].ids + encs[1].ids:
        return tokenizer.encode(doc, add_special_tokens=False).ids
    return [i for e in encs for i in e.ids]


def tokenize_documents(tokenizer, docs: list[str], eos_id: int | None) -> list[int]:
    """One token stream for ``docs`` (no special tokens; ``eos_id`` between documents)."""
    if eos_id is None and len(docs) > 1:
        docs = ["\n\n".join(docs)]
    stream: list[int] = []
    for k, doc in enumerate(docs):
        if k and eos_id is not None:
            stream.append(int(eos_id))
        stream.extend(_encode_doc(tokenizer, doc))
    return stream


# ----------------------------------------------------------------------------- caching


def tokenizer_hash(tokenizer) -> str:
    """sha256 hex of the tokenizer's full JSON serialization (a cache-key part)."""
    try:
        blob = tokenizer.to_str()
    except Exception as e:  # pragma: no cover - every tokenizers.Tokenizer has to_str
        raise DataError(f"cannot fingerprint tokenizer {type(tokenizer).__name__}: {e}") from e
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def data_fingerprint(
    docs: list[str], tokenizer, seq_len: int, val_fraction: float, eos_id: int | None, doc_mask: bool = False
) -> str:
    """sha256 hex key over the text, the tokenizer serialization and the packing knobs."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\n".encode())
    for d in docs:
        b = d.encode("utf-8")
        h.update(f"doc {len(b)}\n".encode())
        h.update(b)
    h.update(f"\ntokenizer {tokenizer_hash(tokenizer)}\n".encode())
    h.update(f"seq_len {int(seq_len)}\nval_fraction {float(val_fraction)!r}\neos_id {eos_id}\n".encode())
    if doc_mask:  # only when on: the keys of existing caches stay
        h.update(b"doc_mask 1\n")
    return h.hexdigest()


def packed_cache_path(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    return Path(cache_dir) / f"packed-{fingerprint[:32]}.safetensors"


#: free space kept beyond the packed tensors' bytes when writing them (header, filesystem slack), bytes
PACKED_MARGIN_BYTES = 1 << 20


def save_packed(data: PackedData, path: str | os.PathLike, where: str = "") -> Path:
    """Write ``data`` to ``path`` atomically (temp file + rename).

    Raises :class:`DataError` (nothing left behind) when the free space is below the tensors' bytes +
    :data:`PACKED_MARGIN_BYTES` or runs out; the message names ``where`` (the setting that moves it)."""
    import shutil

    from npu_train.errors import out_of_space

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = {"train": data.train.contiguous(), "val": data.val.contiguous()}
    if data.train_labels is not None:
        tensors["train_labels"] = data.train_labels.contiguous()
        tensors["val_labels"] = data.val_labels.contiguous()
    if data.train_positions is not None:
        tensors["train_positions"] = data.train_positions.contiguous()
        tensors["val_positions"] = data.val_positions.contiguous()
    need = sum(t.numel() * t.element_size() for t in tensors.values()) + PACKED_MARGIN_BYTES

    def short(free: int) -> DataError:
        return DataError(f"the packed training data needs {need / 1e6:.1f} MB in {path.parent} but only "
                         f"{free / 1e6:.1f} MB are free: free disk space there"
                         + (f" or {where}" if where else ""))

    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise short(free)
    try:
        save_file(
            tensors,
            str(tmp),
            metadata={
                "format": _FORMAT,
                "seq_len": str(int(data.seq_len)),
                "n_tokens": str(int(data.n_tokens)),
                "fingerprint": data.fingerprint,
            },
        )
    except Exception as e:  # OSError, or safetensors' SafetensorError wrapping the I/O error
        tmp.unlink(missing_ok=True)
        if out_of_space(e):
            raise short(shutil.disk_usage(path.parent).free) from e
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    return path


def load_packed(path: str | os.PathLike) -> PackedData:
    """Read a file written by ``save_packed``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"packed data file {path} does not exist; build it with build_packed_data")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != _FORMAT:
        raise DataError(
            f"{path}: not a packed-data file of format {_FORMAT!r} (got {meta.get('format')!r}); "
            "delete it so it is rebuilt"
        )
    tensors = load_file(str(path))
    seq_len = int(meta["seq_len"])
    train, val = tensors["train"], tensors["val"]
    tl, vl = tensors.get("train_labels"), tensors.get("val_labels")
    tp, vp = tensors.get("train_positions"), tensors.get("val_positions")
    checks = [("train", train), ("val", val)] + ([("train_labels", tl), ("val_labels", vl)] if tl is not None else [])
    checks += [("train_positions", tp), ("val_positions", vp)] if tp is not None else []
    for name, t in checks:
        if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != seq_len + 1:
            raise DataError(
                f"{path}: tensor {name!r} has shape {tuple(t.shape)} / {t.dtype}, expected "
                f"[N, {seq_len + 1}] int64; delete the file so it is rebuilt"
            )
    return PackedData(train=train, val=val, seq_len=seq_len, n_tokens=int(meta["n_tokens"]),
                      fingerprint=meta["fingerprint"], train_labels=tl, val_labels=vl, train_positions=tp,
                      val_positions=vp)


# ----------------------------------------------------------------------------- packing


def _check_vocab(data: PackedData, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    mx = max(
        int(data.train.max()) if data.train.numel() else -1,
        int(data.val.max()) if data.val.numel() else -1,
    )
    if mx >= vocab_size:
        raise DataError(
            f"tokenizer produced id {mx} but the model's vocabulary has {vocab_size} entries: "
            "the tokenizer does not match the model (use the tokenizer that ships with the model)"
        )


def n_val_rows(n_seq: int, val_fraction: float) -> int:
    """Validation rows of ``n_seq``: ``round(n_seq * val_fraction)``, at least 1 when > 0, at most ``n_seq - 1``."""
    if val_fraction <= 0:
        return 0
    return min(max(1, int(round(n_seq * val_fraction))), n_seq - 1)


def build_packed_data(
    text_spec: str,
    tokenizer,
    seq_len: int,
    val_fraction: float = 0.05,
    eos_id: int | None = None,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    doc_mask: bool = False,
) -> PackedData:
    """Tokenize and pack ``text_spec`` into rows, through ``cache_dir`` when given; with ``vocab_size``
    every id is checked ``< vocab_size``; ``doc_mask``: positions restarting after every ``eos_id``
    (:func:`doc_positions`; needs ``eos_id``)."""
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
    docs = read_documents(text_spec)
    fingerprint = data_fingerprint(docs, tokenizer, seq_len, val_fraction, eos_id, doc_mask=bool(doc_mask))
    cache_path = packed_cache_path(cache_dir, fingerprint) if cache_dir is not None else None
    if cache_path is not None and cache_path.is_file():
        try:
            data = load_packed(cache_path)
        except Exception:
            data = None  # unreadable / partial cache file: rebuild below
        if (data is not None and data.fingerprint == fingerprint and data.seq_len == seq_len
                and (data.train_positions is not None) == bool(doc_mask)):
            _check_vocab(data, vocab_size)
            return data

    stream = tokenize_documents(tokenizer, docs, eos_id)
    n_tokens = len(stream)
    row = seq_len + 1
    n_seq = n_tokens // row
    if n_seq < 2:
        raise DataError(
            f"dataset too short: {n_tokens} tokens, need at least {2 * row} "
            f"(2 sequences of seq_len+1) for seq_len={seq_len}; lower data.seq_len or add text"
        )
    rows = torch.tensor(stream[: n_seq * row], dtype=torch.int64).view(n_seq, row)
    n_val = n_val_rows(n_seq, val_fraction)
    data = PackedData(
        train=rows[: n_seq - n_val].clone(),
        val=rows[n_seq - n_val :].clone(),
        seq_len=seq_len,
        n_tokens=n_tokens,
        fingerprint=fingerprint,
    )
    if doc_mask:
        pos = doc_positions(rows, int(eos_id))
        data.train_positions, data.val_positions = pos[: n_seq - n_val].clone(), pos[n_seq - n_val :].clone()
    _check_vocab(data, vocab_size)
    if cache_path is not None:
        save_packed(data, cache_path, where="point $NPT_CACHE at a larger disk")
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
    of ``data.train`` (or ``data.val`` with ``split="val"``). ``labels[b, t]`` is the target of
    position ``t`` (the next token); chat data has ``IGNORE_INDEX`` where nothing is trained; packed rows
    (with positions) also where the next token starts another sample (no token predicts across a boundary)."""
    src, lab, pos = _split_of(data, split)
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    rows = src.index_select(0, idx)
    targets = rows if lab is None else lab.index_select(0, idx)
    targets = targets[:, 1:]
    if pos is not None:
        from npu_train.model.headops import IGNORE_INDEX

        targets = targets.masked_fill(pos.index_select(0, idx)[:, 1:] == 0, IGNORE_INDEX)
    return rows[:, :-1].contiguous(), targets.contiguous()


def micro_batch_positions(data: PackedData, indices: torch.Tensor, split: str = "train") -> torch.Tensor | None:
    """Position ids ``[len(indices), seq_len]`` int64 of the inputs of :func:`micro_batch_tensors` (each token's
    place in its sample), or None when the data has one sample per row (positions ``0..seq_len-1``)."""
    _, _, pos = _split_of(data, split)
    if pos is None:
        return None
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
    return pos.index_select(0, idx)[:, :-1].contiguous()
