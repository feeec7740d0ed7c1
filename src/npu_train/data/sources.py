"""Stage 1 of :mod:`npu_train.data.prepare`, part 1: where training rows come from (``data.source``), read through
Hugging Face ``datasets`` without network.

A source is one of: a built-in name (``botchan``, ``botchan-chat``, ``botchan-prefs``); a file or a glob of files
(``.parquet``, ``.arrow``, ``.jsonl``/``.json``, ``.csv``, ``.txt``); a directory of such files (read in
sorted path order); or a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(``data.split`` picks the training split of a ``DatasetDict``, ``data.val_split`` an optional validation
split). Tabular files are streamed with ``datasets.load_dataset(<builder>, data_files=[file],
streaming=True)`` (no arrow copy of the corpus in the HF cache); ``save_to_disk`` directories are opened
with ``datasets.load_from_disk`` (memory-mapped arrow). ``.txt`` files are one document each, read in
blocks with a strict UTF-8 check (``datasets``' text builder would either split lines into rows or hold
the file as one row in memory).

``HF_DATASETS_OFFLINE=1`` is set in this process before ``datasets`` is imported (unless the variable is
already set), so a source is never looked up on the Hub. Row numbers in messages are 1-based data rows of
the named file (a JSONL line number when the file has no blank lines).

The cheap fingerprint of a source (:func:`source_key`) covers each file's path relative to the source,
size, whole-second mtime and a sample hash (sha256 of the first, last and 6 evenly spaced 64 KiB blocks),
so a launch never re-reads a large corpus to recognise it. Main entry points: :func:`resolve_source`,
:func:`iter_column_batches`, :func:`text_pieces`, :func:`iter_converted`."""
from __future__ import annotations

import codecs
import glob
import hashlib
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Iterator, Optional

from npu_train.config import BAD_ROWS  # noqa: F401  (re-exported: data.bad_rows' values)

from .text import DataError, botchan_text

__all__ = ["BUILDERS", "BUILTIN_TEXT", "BUILTIN_CHAT", "BUILTIN_PREFS", "Source", "ColumnBatch", "resolve_source",
           "source_key", "iter_column_batches", "text_pieces", "split_pieces", "open_datasets",
           "BAD_ROWS", "BadRows", "read_documents", "read_text_source", "iter_converted"]

#: file suffix -> datasets builder ("txt" is read here: one document per file)
BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".txt": "txt"}
BUILTIN_TEXT = ("botchan",)
#: built-in chat sets: name -> asset file (assets/SOURCE.md)
BUILTIN_CHAT = {"botchan-chat": "botchan_chat.jsonl"}
#: built-in preference sets (data.format=preference): name -> asset file (assets/SOURCE.md)
BUILTIN_PREFS = {"botchan-prefs": "botchan_prefs.jsonl"}
#: rows per batch read from a datasets source
BATCH_ROWS = 1000
#: bytes of JSON(L) parsed at a time: datasets' default 10 MB chunk made the reader's peak grow with the
#: file (242 -> 313 MiB from a 10 to a 100 MB file); 1 MiB keeps it flat (221 / 224 MiB)
JSON_CHUNK_BYTES = 1 << 20
#: sample-hash block, bytes, and the number of evenly spaced inner blocks
_BLOCK = 1 << 16
_INNER_BLOCKS = 6
#: characters per piece of a long document (cut at a line start that begins with a non-space)
PIECE_CHARS = 32_768


def open_datasets():
    """The ``datasets`` module, imported with ``HF_DATASETS_OFFLINE=1`` (unless set) and quiet logging."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


@dataclass(frozen=True)
class Source:
    """A resolved ``data.source``: ``kind`` is ``builtin`` | ``files`` | ``saved``; ``files`` the files read
    (``saved``: every file of the directory, for the fingerprint); ``root`` the directory or file named."""

    spec: str
    kind: str
    files: tuple = ()
    root: Optional[Path] = None
    split: str = "train"
    val_split: Optional[str] = None

    @property
    def n_bytes(self) -> int:
        """Total size of the source's files (built-in: the asset), bytes; for progress and disk estimates."""
        if self.kind == "builtin":
            return len(botchan_text()) if self.spec in BUILTIN_TEXT else 1 << 20
        return sum(os.path.getsize(f) for f in self.files)


@dataclass
class BadRows:
    """Rows dropped under ``data.bad_rows=skip``: how many, and the first one's place and reason."""

    count: int = 0
    first: str = ""

    def add(self, why: str) -> None:
        self.count += 1
        if not self.first:
            self.first = why

    def report(self) -> str:
        return f"{self.count} bad row(s) skipped (data.bad_rows=skip); first: {self.first}" if self.count else ""


def no_rows(spec: str, where: str, bad: BadRows, shape: str) -> DataError:
    """The error for a source that yielded no usable row: every row bad (``bad``, skipped under
    ``data.bad_rows=skip``), or none at all (empty files, only blank lines); ``where`` follows the source
    (e.g. the split), ``shape`` shows a good row."""
    if bad.count:
        return DataError(f"data.source={spec!r}{where}: no usable rows: all {bad.count} row(s) are bad and were "
                         f"skipped (data.bad_rows=skip); first: {bad.first}; fix the rows")
    return DataError(f"data.source={spec!r}{where}: no rows (the file(s) are empty or hold only blank lines); add "
                     f"rows like {shape}")


@dataclass
class ColumnBatch:
    """Up to :data:`BATCH_ROWS` rows of one file: ``columns`` name -> list of values, ``label`` the file
    (or built-in name), ``first_row`` the 1-based row number of the first row."""

    columns: dict
    label: str
    first_row: int
    n_rows: int = field(default=0)

    def where(self, i: int) -> str:
        return f"{self.label}:{self.first_row + i}"


# ------------------------------------------------------------------------------------------ resolving
def _is_saved_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file())


def _supported(p: Path) -> bool:
    return p.is_file() and p.suffix.lower() in BUILDERS


def builtin_sets() -> str:
    """Every built-in set with the ``data.format`` it is for: ``botchan (data.format=text), botchan-chat
    (data.format=chat), botchan-prefs (data.format=preference)``."""
    forms = [(n, "text") for n in BUILTIN_TEXT] + [(n, "chat") for n in BUILTIN_CHAT] + \
        [(n, "preference") for n in BUILTIN_PREFS]
    return ", ".join(f"{n} (data.format={f})" for n, f in forms)


def _missing(spec: str) -> FileNotFoundError:
    """The refusal of a ``data.source`` that names nothing. The path is quoted once: where it was looked for is
    added only when that is not ``spec`` itself (a relative path: the directory; ``~`` or ``..``: the absolute
    path); a ~150-character absolute path was quoted twice."""
    path, resolved = Path(spec).expanduser(), str(Path(spec).expanduser().resolve())
    if resolved == spec:
        where = ""
    elif not path.is_absolute():
        where = f" (relative to {os.getcwd()})"
    else:
        where = f" ({resolved})"
    return FileNotFoundError(
        f"data.source={spec!r}: no such file or directory{where}; use one of the built-in sets "
        f"{builtin_sets()}, or a path to a .parquet/.arrow/.jsonl/.json/.csv/.txt file, a glob of them, a "
        "directory of them or a directory written by Dataset.save_to_disk")


def _check_splits(path: Path, split: str, val_split: Optional[str]) -> None:
    """Refuse a split the save_to_disk directory does not have, before anything is read."""
    dd = path / "dataset_dict.json"
    if not dd.is_file():
        if split != "train" or val_split:
            raise DataError(f"{path}: a single Dataset (no splits) has no split "
                            f"{split if split != 'train' else val_split!r}; drop data.split / data.val_split")
        return
    try:
        splits = list(json.loads(dd.read_text())["splits"])
    except (ValueError, KeyError, TypeError, OSError):
        return  # load_from_disk names the problem
    for name in (split, val_split):
        if name is not None and name not in splits:
            raise DataError(f"{path}: the DatasetDict has no split {name!r} (splits: {sorted(splits)}); set "
                            "data.split / data.val_split to one of them")


def _refuse_other_builtin(spec: str, fmt: str) -> None:
    """A DataError when ``spec`` names a built-in set of another ``data.format`` than ``fmt``."""
    if fmt != "preference" and spec in BUILTIN_PREFS:
        raise DataError(f"data.source={spec} is the shipped preference set: set data.format=preference")
    if fmt == "preference" and (spec in BUILTIN_CHAT or spec in BUILTIN_TEXT):
        raise DataError(f"data.source={spec} has no chosen/rejected pairs: for data.format=preference use "
                        f"data.source={next(iter(BUILTIN_PREFS))} or a file of preference rows")
    if fmt == "text" and spec in BUILTIN_CHAT:
        raise DataError(f"data.source={spec} is the shipped chat set: add data.format=chat")
    if fmt != "text" and spec in BUILTIN_TEXT:
        raise DataError(f"data.source={spec} is the shipped text: use data.format=text, or data.source=botchan-chat")


def _refuse_model(spec: str, path: Path) -> None:
    """DataError for a model given as ``data.source``: a directory holding ``config.json`` and weights
    (``*.safetensors`` / ``*.bin``; its config.json was read as rows of data), or a ``.gguf`` /
    ``.safetensors`` file: names ``model.path``."""
    if path.is_dir():
        weights = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file())
        if not ((path / "config.json").is_file() and weights):
            return
        what = f"a model directory (config.json, {weights[0]}{', ...' if len(weights) > 1 else ''})"
    elif path.suffix.lower() in (".gguf", ".safetensors"):
        what = f"a model file ({path.suffix.lower()})"
    else:
        return
    raise DataError(f"data.source={spec} is {what}, not data: did you mean model.path={spec}? data.source takes a "
                    f"built-in set ({builtin_sets()}), a .parquet/.arrow/.jsonl/.json/.csv/.txt file, a glob or a "
                    "directory of them, or a directory written by Dataset.save_to_disk")


def resolve_source(spec: str, fmt: str = "text", split: str = "train", val_split: Optional[str] = None) -> Source:
    """The :class:`Source` named by ``spec`` for ``data.format=fmt``; FileNotFoundError / DataError."""
    spec = str(spec)
    builtins = (BUILTIN_TEXT if fmt == "text" else tuple(BUILTIN_PREFS) if fmt == "preference"
                else tuple(BUILTIN_CHAT))
    split, val_split = str(split or "train"), (str(val_split) if val_split else None)
    if spec in builtins:
        return Source(spec, "builtin")
    _refuse_other_builtin(spec, fmt)
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?[") and not path.exists():
        files = tuple(Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if _supported(Path(p)))
        if not files:
            raise DataError(f"data.source={spec!r}: the pattern matches no .parquet/.arrow/.jsonl/.json/.csv/.txt "
                            "file; check the pattern (quote it so the shell does not expand it)")
        return Source(spec, "files", files, path.parent, split, val_split)
    if not path.exists():
        raise _missing(spec)
    if _is_saved_dir(path):
        _check_splits(path, split, val_split)
        files = tuple(sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.as_posix()))
        return Source(spec, "saved", files, path, split, val_split)
    _refuse_model(spec, path)
    if path.is_dir():
        files = tuple(sorted((p for p in path.rglob("*") if _supported(p)),
                             key=lambda p: p.relative_to(path).as_posix()))
        if not files:
            raise DataError(f"{path}: directory contains no .parquet, .arrow, .jsonl, .json, .csv or .txt files")
    else:
        if path.suffix.lower() not in BUILDERS:
            raise DataError(f"{path}: unsupported file type {path.suffix!r}; data.source must be a built-in set "
                            f"({builtin_sets()}), a .parquet/.arrow/.jsonl/.json/.csv/.txt file, a glob or a "
                            "directory of them, or a directory written by Dataset.save_to_disk")
        files = (path,)
    if val_split is not None:
        raise DataError(f"data.val_split={val_split} needs a DatasetDict directory written by save_to_disk; "
                        f"{spec} is not one: drop data.val_split (data.val_fraction holds out the tail)")
    return Source(spec, "files", files, path, split, None)


# ------------------------------------------------------------------------------------------ fingerprint
def _sample_hash(path: Path, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= (_INNER_BLOCKS + 2) * _BLOCK:
            h.update(f.read())
        else:
            offs = [0] + [size * (k + 1) // (_INNER_BLOCKS + 1) for k in range(_INNER_BLOCKS)] + [size - _BLOCK]
            for o in offs:
                f.seek(o)
                h.update(f.read(_BLOCK))
    return h.hexdigest()


def source_files(src: Source) -> dict:
    """``{path relative to the source: "<size> <sample hash>"}`` of the files a source reads (empty for a built-in
    set): recorded in each checkpoint so a resume onto changed data can name the files added, removed or
    changed since (the fingerprint says only that something differs)."""
    if src.kind == "builtin":
        return {}
    base = src.root if src.root is not None and src.root.is_dir() else None
    out = {}
    for f in src.files:
        size = os.path.getsize(f)
        out[f.relative_to(base).as_posix() if base is not None else f.name] = f"{size} {_sample_hash(f, size)[:16]}"
    return out


def files_change(before: dict, now: dict) -> str:
    """What differs between two :func:`source_files` records, e.g. ``"new file(s) extra.txt; changed a.txt"``;
    ``""`` when nothing does. Names up to 5 files per kind."""
    def names(xs: list) -> str:
        return ", ".join(xs[:5]) + (f" and {len(xs) - 5} more" if len(xs) > 5 else "")

    added = sorted(set(now) - set(before))
    removed = sorted(set(before) - set(now))
    changed = sorted(k for k in set(before) & set(now) if before[k] != now[k])
    parts = [f"{what} {names(xs)}" for what, xs in (("new file(s)", added), ("removed file(s)", removed),
                                                      ("changed file(s)", changed)) if xs]
    return "; ".join(parts)


def _builtin_asset(spec: str) -> str:
    """The asset file name of a built-in chat / preference set."""
    return BUILTIN_PREFS[spec] if spec in BUILTIN_PREFS else BUILTIN_CHAT[spec]


def source_key(src: Source) -> str:
    """sha256 hex identifying the source without reading it whole: per file its path relative to the source,
    size, whole-second mtime and :func:`_sample_hash`; a built-in set: its content. Splits included."""
    h = hashlib.sha256(f"source {src.kind}\nsplit {src.split}\nval_split {src.val_split}\n".encode())
    if src.kind == "builtin":
        name = "botchan.txt" if src.spec in BUILTIN_TEXT else _builtin_asset(src.spec)
        h.update(f"builtin {src.spec}\n".encode())
        h.update(resources.files("npu_train.data").joinpath("assets", name).read_bytes())
        return h.hexdigest()
    base = src.root if src.root is not None and src.root.is_dir() else None
    for f in src.files:
        st = os.stat(f)
        rel = f.relative_to(base).as_posix() if base is not None else f.name
        h.update(f"file {rel} {st.st_size} {int(st.st_mtime)} {_sample_hash(f, st.st_size)}\n".encode())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ text pieces
def split_pieces(text: str, size: int = PIECE_CHARS) -> tuple[list[str], str]:
    """Cut complete ~``size``-char pieces off ``text`` at line starts that begin with a non-space:
    ``(pieces, rest)`` with ``"".join(pieces) + rest == text``."""
    out, start = [], 0
    while len(text) - start > size:
        cut = start + size
        while True:
            nl = text.find("\n", cut)
            if nl < 0 or nl + 1 >= len(text):
                return out, text[start:]
            if not text[nl + 1].isspace():
                break
            cut = nl + 1
        out.append(text[start:nl + 1])
        start = nl + 1
    return out, text[start:]


def _utf8_error(path: Path, e: UnicodeDecodeError, block: bytes, offset: int, lines: int) -> DataError:
    line = lines + block.count(b"\n", 0, e.start) + 1
    pos = offset + e.start
    return DataError(
        f"{path}: not valid UTF-8 (byte 0x{block[e.start]:02x} at byte offset {pos}, line {line}, near "
        f"{block[e.start:e.start + 4]!r}); re-encode as UTF-8, e.g. "
        f"iconv -f latin1 -t utf-8 {path} > {path.with_suffix('.utf8' + path.suffix)}")


def _txt_pieces(path: Path, whole: bool, block: int = 1 << 20) -> Iterator[str]:
    """Pieces of the text file ``path`` (strict UTF-8, a leading BOM dropped), or the whole text."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    buf, offset, lines, first = "", 0, 0, True
    with open(path, "rb") as f:
        while True:
            raw = f.read(block)
            try:
                buf += dec.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise _utf8_error(path, e, raw, offset, lines) from None
            offset += len(raw)
            lines += raw.count(b"\n")
            if first and buf:
                buf, first = (buf[1:] if buf.startswith("\ufeff") else buf), False
            if not raw:
                break
            if not whole:
                pieces, buf = split_pieces(buf)
                yield from pieces
    if buf:
        yield buf


def _once(whole):
    """``whole`` as a callable evaluated at most once (a bool is returned as is)."""
    known: list = []

    def ask() -> bool:
        if not known:
            known.append(bool(whole() if callable(whole) else whole))
        return known[0]
    return ask


def text_pieces(src: Source, field_name: str, bad: BadRows, bad_rows: str, whole=False,
                split: Optional[str] = None) -> Iterator[tuple[int, str]]:
    """``(doc, piece)`` for ``data.format=text``: each document's text in pieces, with a running document
    number; whitespace-only documents dropped. ``whole``: one piece per document (a bool, or a callable asked
    once, when the first document longer than a piece comes). JSON/CSV/parquet/arrow rows are documents
    (column ``field_name``); a ``.txt`` file is one document."""
    whole = _once(whole)
    doc = -1
    if src.kind == "builtin":
        yield from ((0, p) for p in ([botchan_text()] if whole() else _join_rest(*split_pieces(botchan_text()))))
        return
    for path in (src.files if src.kind == "files" else (None,)):
        if path is not None and path.suffix.lower() == ".txt":
            held, seen = [], False
            for p in _txt_pieces(path, whole()):
                if not seen and not p.strip():
                    held.append(p)
                    continue
                if not seen:
                    doc, seen = doc + 1, True
                    yield from ((doc, h) for h in held)
                yield doc, p
            continue
        for b in iter_column_batches(src, [field_name], path=path, split=split):
            for i, v in enumerate(b.columns[field_name]):
                if not isinstance(v, str):
                    got = "missing" if v is None else type(v).__name__
                    why = f'{b.where(i)}: the "{field_name}" field must be a string ({got})'
                    if bad_rows != "skip":
                        raise DataError(f"{why}; fix the row, or set data.bad_rows=skip to drop such rows"
                                        + (f" (or data.text_field=<column> if the text is in another column)"
                                           if v is None else ""))
                    bad.add(why)
                    continue
                if not v.strip():
                    continue
                doc += 1
                if len(v) <= PIECE_CHARS or whole():
                    yield doc, v
                else:
                    yield from ((doc, p) for p in _join_rest(*split_pieces(v)))


def _join_rest(pieces: list[str], rest: str) -> list[str]:
    return pieces + ([rest] if rest else [])


# ------------------------------------------------------------------------------------------ tabular rows
def _row_example(want: list[str]) -> str:
    """One JSON row with the columns ``want`` (``prompt`` first; a chat source's ``messages`` as a list of turns),
    the example of the refusals' messages."""
    msgs = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'
    return "{" + ", ".join(f'"{c}": {msgs if c == "messages" else chr(34) + "..." + chr(34)}'
                           for c in sorted(want or ["text"], key=lambda c: c != "prompt")) + "}"


def _json_diagnosis(path: Path, exc: Exception, want: Optional[list] = None) -> DataError:
    """The first line of the JSON(L) file ``path`` that is not UTF-8 / one JSON object (read on failure only);
    ``want``: the columns the format reads, for the example row."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(path, e, raw, 0, lineno - 1) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                return DataError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno}); each "
                                 f"line must be one JSON object, e.g. {_row_example(want)}")
            if not isinstance(obj, dict):
                return DataError(f"{path}:{lineno}: expected a JSON object with a \"text\" field (or the columns "
                                 f"data.*_field name), got {type(obj).__name__}; each line must be one JSON object")
    first = (str(exc).splitlines() or [""])[0]
    return DataError(f"{path}: datasets could not read it ({type(exc).__name__}: {first}); fix the file")


def _file_dataset(path: Path, want: list[str], optional=()):
    """A streamed ``datasets`` view of one file; a parquet file reads only the ``want`` columns it has (its
    schema is checked first, so a missing column that is not ``optional`` is named)."""
    ds = open_datasets()
    builder = BUILDERS[path.suffix.lower()]
    kw = {}
    if builder == "parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(path).names
        _check_columns(names, want, str(path), optional)
        kw["columns"] = [c for c in want if c in names]
    elif builder == "json":
        kw["chunksize"] = JSON_CHUNK_BYTES
    return ds.load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **kw)


def _saved_dataset(src: Source, split: str):
    ds = open_datasets()
    try:
        d = ds.load_from_disk(str(src.root))
    except Exception as e:  # noqa: BLE001 - damaged / foreign directory
        raise DataError(f"{src.root}: not a readable save_to_disk directory ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0]}); write it with Dataset.save_to_disk") from None
    if isinstance(d, ds.DatasetDict):
        if split not in d:
            raise DataError(f"{src.root}: the DatasetDict has no split {split!r} (splits: {sorted(d)}); set "
                            f"data.split / data.val_split to one of them")
        return d[split]
    if split != "train" and split != src.split:
        raise DataError(f"{src.root}: a single Dataset (no splits) has no split {split!r}; drop data.val_split")
    return d


def _check_columns(names, want, label: str, optional=()) -> None:
    names = list(names or [])
    missing = [c for c in want if c not in names and c not in optional]
    if names and missing:
        keys = {"text": "data.text_field", "messages": "data.messages_field", "prompt": "data.prompt_field",
                "completion": "data.completion_field", "chosen": "data.chosen_field",
                "rejected": "data.rejected_field"}
        hint = ", ".join(f"{keys.get(c, 'data.*_field')}=<column>" for c in missing)
        raise DataError(f"{label}: no column {', '.join(repr(c) for c in missing)} (columns: {names[:12]}); "
                        f"set {hint} to the column that holds it")


def iter_converted(src: Source, cols: list[str], split: Optional[str], convert: Callable[["ColumnBatch", int], object],
                   bad_rows: str, log: Callable[[str], None], optional: tuple = (),
                   bad: Optional[BadRows] = None) -> Iterator:
    """``convert(batch, i)`` for every row in file order, one at a time (memory: one batch of
    :data:`BATCH_ROWS` rows): columns ``cols`` of every file (or the save_to_disk ``split``) of ``src``. A row
    whose ``convert`` raises :class:`DataError` stops the read with that error and the ``data.bad_rows=skip``
    hint (``bad_rows="refuse"``), or is counted in ``bad`` and dropped (``"skip"``); after the last row the
    count is reported through ``log`` with the first one."""
    bad = bad if bad is not None else BadRows()
    for path in (src.files if src.kind == "files" else (None,)):
        for b in iter_column_batches(src, cols, path=path, split=split, optional=optional):
            for i in range(b.n_rows):
                try:
                    item = convert(b, i)
                except DataError as e:
                    if bad_rows != "skip":
                        raise DataError(f"{e} (or set data.bad_rows=skip to drop such rows)") from None
                    bad.add(str(e))
                    continue
                yield item
    if bad.count:
        log(f"data: {bad.report()}")


def iter_column_batches(src: Source, want: list[str], path: Optional[Path] = None,
                        split: Optional[str] = None, optional: tuple = ()) -> Iterator[ColumnBatch]:
    """Batches of columns ``want`` from one file (``path``) or a save_to_disk split, in row order;
    a missing column is a DataError naming the ``data.*_field`` key, except the ``optional`` ones: a
    column of those the file does not have is left out of ``ColumnBatch.columns``. Built-in sets: their
    asset file."""
    if src.kind == "builtin":
        ref = resources.files("npu_train.data").joinpath("assets", _builtin_asset(src.spec))
        with resources.as_file(ref) as p:
            yield from iter_column_batches(Source(src.spec, "files", (Path(p),), Path(p)), want, Path(p),
                                           optional=optional)
        return
    if src.kind == "saved":
        d = _saved_dataset(src, split or src.split)
        label = f"{src.root}[{split or src.split}]"
        _check_columns(d.column_names, want, label, optional)
        want = [c for c in want if c in d.column_names]
        row = 1
        for b in d.select_columns(want).iter(batch_size=BATCH_ROWS):
            n = len(b[want[0]])
            yield ColumnBatch(b, label, row, n)
            row += n
        return
    paths = [path] if path is not None else list(src.files)
    for p in paths:
        if p.suffix.lower() == ".txt":
            raise DataError(f"{p}: a .txt file holds plain text; data.format=chat/prompt_completion needs "
                            ".jsonl/.json/.parquet/.arrow rows")
        yield from _file_batches(p, want, optional)


def _mixed_json(d, want: list[str]) -> bool:
    """Whether a wanted column of a streamed JSON file has mixed types: ``datasets`` then gives it its
    ``Json`` feature, which JSON-decodes string values ("1919" would become the int 1919)."""
    feats = getattr(d, "features", None) or {}
    return any(type(feats.get(c)).__name__ == "Json" for c in want)


def _json_lines(p: Path, want: list[str]) -> Iterator[ColumnBatch]:
    """Rows of a JSON Lines file with mixed-type columns, parsed line by line with ``json.loads`` (exact
    values, so the bad rows are found and named); blank lines are not rows; ``want`` are the columns the
    file has (a row without one gets None)."""
    row, cols = 1, {c: [] for c in want}
    with open(p, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            obj = json.loads(raw)
            for c in want:
                cols[c].append(obj.get(c) if isinstance(obj, dict) else None)
            if len(cols[want[0]]) == BATCH_ROWS:
                yield ColumnBatch(cols, str(p), row, BATCH_ROWS)
                row, cols = row + BATCH_ROWS, {c: [] for c in want}
    if cols[want[0]]:
        yield ColumnBatch(cols, str(p), row, len(cols[want[0]]))


def _blank(p: Path, block: int = 1 << 20) -> bool:
    """Whether the file ``p`` holds nothing but whitespace (0 bytes included): it has no rows."""
    with open(p, "rb") as f:
        while True:
            raw = f.read(block)
            if not raw:
                return True
            if raw.strip():
                return False


def _file_batches(p: Path, want: list[str], optional=()) -> Iterator[ColumnBatch]:
    """Batches of one file; an empty file (0 bytes, or only whitespace) has no rows (``datasets`` cannot read
    one: the reader of the whole source then says it has no rows)."""
    row, checked = 1, False
    if p.stat().st_size == 0:
        return
    try:
        d = _file_dataset(p, want, optional)
        if p.suffix.lower() == ".jsonl" and _mixed_json(d, want):
            _check_columns(list(d.features), want, str(p), optional)
            yield from _json_lines(p, [c for c in want if c in d.features])
            return
        for b in d.iter(batch_size=BATCH_ROWS):
            if not checked:
                _check_columns(list(b), want, str(p), optional)
                want = [c for c in want if c in b]
                checked = True
            cols = {c: b[c] for c in want}
            n = len(cols[want[0]])
            yield ColumnBatch(cols, str(p), row, n)
            row += n
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow / datasets parse errors: find the line
        if row == 1 and p.suffix.lower() != ".parquet" and _blank(p):
            return
        if p.suffix.lower() in (".jsonl", ".json"):
            raise _json_diagnosis(p, e, want) from None
        first = (str(e).splitlines() or [""])[0]
        raise DataError(f"{p}: datasets could not read it ({type(e).__name__}: {first}); fix or re-export the "
                        "file") from None


# ------------------------------------------------------------------------------------------ whole documents
def read_documents(spec: str, text_field: str = "text", bad_rows: str = "refuse") -> list[str]:
    """The documents of ``spec`` as strings (one per ``.txt`` file / row), empty ones dropped, in a fixed
    order; for tests and small sources (training streams :func:`text_pieces`). FileNotFoundError / DataError."""
    src = resolve_source(spec, "text")
    docs = [p for _, p in text_pieces(src, text_field, BadRows(), bad_rows, whole=True)]
    if not docs:
        raise DataError(f"{src.root or spec}: no text (file(s) empty or whitespace only); add training text")
    return docs


def read_text_source(spec: str) -> str:
    """All text named by ``spec`` as one string (documents joined by a blank line)."""
    return "\n\n".join(read_documents(spec))
