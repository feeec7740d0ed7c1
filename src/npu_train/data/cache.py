"""Stage 4 of :mod:`npu_train.data.prepare`: the cache file, its key and its build lock.

A prepared data set is one packed file (:mod:`npu_train.data.packfile`) under ``cache_dir`` named by its
key: :func:`text_fingerprint` / :func:`sft_fingerprint` / :func:`preference_fingerprint` hash the source's
cheap key (:func:`~npu_train.data.sources.source_key`: file sizes, mtimes and a sample hash; the split
names), the tokenizer's serialization, the chat template and the knobs that change the file. The key is the
run's *data fingerprint* that a resume checks. :func:`cache_slot` maps the file when it is there and valid,
else lets the caller's ``with`` block (the rows, render and pack stages) write it into a temporary file and
renames it into place, one builder at a time under ``<file>.lock`` (:func:`build_lock`: another node on a
shared cache waits and maps the file built; a lock untouched for :data:`LOCK_STALE_S` seconds, or held by a
dead process of this host, is taken over). The cache stage imports no earlier stage: the build is the
caller's."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from .packfile import (PACKED_FORMAT, PackedData, check_vocab, disk_full, file_size, load_packed, note_full_disk,
                       read_header)
from .text import DataError

__all__ = ["LOCK_STALE_S", "CacheSlot", "build_cached", "build_lock", "cache_slot", "cached_pairs", "cached_sft",
           "cached_text", "lock_path", "packed_cache_path", "preference_fingerprint", "sft_fingerprint", "space_hint",
           "text_fingerprint", "tokenizer_hash"]

#: a build lock not touched for this long is taken over (its builder died), seconds
LOCK_STALE_S = 120.0


def tokenizer_hash(tokenizer) -> str:
    """sha256 hex of the tokenizer's full JSON serialization (a cache-key part)."""
    try:
        blob = tokenizer.to_str()
    except Exception as e:  # pragma: no cover - every tokenizers.Tokenizer has to_str
        raise DataError(f"cannot fingerprint tokenizer {type(tokenizer).__name__}: {e}") from e
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def text_fingerprint(src_key: str, tokenizer, seq_len: int, val_fraction: Optional[float], eos_id: int | None,
                     text_field: str = "text", doc_mask: bool = False) -> str:
    """sha256 hex key over the source's cheap key (:func:`~npu_train.data.sources.source_key`), the text
    column, the tokenizer serialization and the packing knobs (``doc_mask`` only when on); ``val_fraction``
    None: validation is a split (``data.val_split``), so the fraction is not used and not in the key."""
    h = hashlib.sha256()
    h.update(f"{PACKED_FORMAT}\nsource {src_key}\nfield {text_field}\n".encode())
    h.update(f"tokenizer {tokenizer_hash(tokenizer)}\n".encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\neos_id {eos_id}\n".encode())
    if doc_mask:  # only when on: the keys of existing caches stay
        h.update(b"doc_mask 1\n")
    return h.hexdigest()


_SFT_FORMAT = "npu-train-sft-v1"


def sft_fingerprint(src_key: str, fmt: str, renderer, seq_len: int, val_fraction: Optional[float],
                    truncation: str, pad_id: int, fields: Optional[dict] = None, pack: bool = False) -> str:
    """sha256 hex key over the source's cheap key (:func:`~npu_train.data.sources.source_key`: file sizes,
    mtimes, sample hash, the split names), the column mapping, format, template, tokenizer and the sequence
    knobs; ``val_fraction`` None: validation is a split (``val_fraction`` not used, not in the key)."""
    h = hashlib.sha256()
    h.update(f"{_SFT_FORMAT}\nformat {fmt}\ntruncation {truncation}\nsource {src_key}\n".encode())
    h.update(f"fields {json.dumps(fields or {}, sort_keys=True)}\n".encode())
    if pack:  # only when on: the keys of existing (unpacked) caches stay
        h.update(b"pack greedy-v1\n")
    h.update(f"template {renderer.template!r}\ntokenizer {tokenizer_hash(renderer.tok)}\n".encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\npad {pad_id}\n".encode())
    return h.hexdigest()


#: v2: pairs tokenized as TRL 1.16 does (prompt + completion whole, cut where they diverge)
_PREF_FORMAT = "npu-train-pref-v2"
#: how preference rows are truncated (part of the cache key)
_PREF_TRUNCATION = "keep-prompt-cut-completion"


def preference_fingerprint(src_key: str, renderer, seq_len: int, val_fraction: Optional[float],
                           pad_id: int, fields: Optional[dict] = None) -> str:
    """sha256 hex cache key over the source's cheap key (with the split names), the column mapping, the format
    and truncation rule, the chat template, tokenizer, EOS and the sequence knobs; ``val_fraction`` None:
    validation is a split (``val_fraction`` not used, not in the key)."""
    h = hashlib.sha256()
    h.update(f"{_PREF_FORMAT}\nformat preference\ntruncation {_PREF_TRUNCATION}\nsource {src_key}\n".encode())
    h.update(f"fields {json.dumps(fields or {}, sort_keys=True)}\n".encode())
    h.update(f"template {renderer.template!r}\ntokenizer {tokenizer_hash(renderer.tok)}\neos {renderer.eos_id}\n"
             .encode())
    vf = "split" if val_fraction is None else repr(float(val_fraction))
    h.update(f"seq_len {int(seq_len)}\nval_fraction {vf}\npad {pad_id}\n".encode())
    return h.hexdigest()


def packed_cache_path(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    return Path(cache_dir) / f"packed-{fingerprint[:32]}.safetensors"


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


@dataclass
class CacheSlot:
    """What :func:`cache_slot` gives the builder: ``data`` the cached file's data (``hit``: it was there, or
    another process built it meanwhile) or None: then write the packed file into ``tmp`` (``lock``: the build
    lock to touch while working, None without a cache); after the ``with`` block ``data`` is the file built."""

    data: Optional[PackedData] = None
    hit: bool = False
    tmp: Optional[Path] = None
    lock: Optional[Path] = None


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    directory = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir())
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(directory, cache_dir, e) from e
    return directory


def _failed_write(e: BaseException, tmp: Path, where: str) -> None:
    """Remove the partial file of a failed build; a full disk becomes a :class:`DataError` naming the fix."""
    from npu_train.errors import out_of_space

    note_full_disk(e, tmp.parent, file_size(tmp))  # what was free with the partial file still there
    tmp.unlink(missing_ok=True)
    if isinstance(e, Exception) and out_of_space(e):  # OSError, or a library's error naming ENOSPC
        raise disk_full(tmp, where, free=getattr(e, "npt_free_bytes", None),
                        written=getattr(e, "npt_written_bytes", 0)) from e


@contextlib.contextmanager
def cache_slot(cache_dir: str | os.PathLike | None, fingerprint: str,
               cached: Callable[[Path], Optional[PackedData]], log: Callable[[str], None],
               where: str = "") -> Iterator[CacheSlot]:
    """The packed file for ``fingerprint`` under ``cache_dir``: a :class:`CacheSlot` holding it when
    ``cached(path)`` accepts it, else one whose ``tmp`` the ``with`` block writes (the earlier stages run
    there), renamed into place and mapped when the block ends; one builder at a time (:func:`build_lock`:
    another node sharing the cache waits and maps the file built). Without ``cache_dir`` the file is built in
    the temporary directory, mapped and unlinked (``data.path`` None). The temporary file is removed when the
    block raises; a full disk is a :class:`DataError` naming the fix (``where``: the setting that moves the
    directory)."""
    directory = _cache_dir(cache_dir)
    target = packed_cache_path(directory, fingerprint) if cache_dir is not None else None
    slot = CacheSlot(data=cached(target) if target is not None and target.is_file() else None)
    if slot.data is not None:
        slot.hit = True
        yield slot
        return
    if not os.access(directory, os.W_OK | os.X_OK):  # a read-only mount, another user's directory
        raise _unwritable(directory, cache_dir, None)
    with contextlib.ExitStack() as stack:
        if target is not None:
            ready = lambda: target.is_file() and cached(target) is not None  # noqa: E731
            if not stack.enter_context(build_lock(target, log, ready)):
                slot.data, slot.hit = cached(target) or load_packed(target), True
                yield slot
                return
            _remove_leftovers(directory, fingerprint)
        slot.tmp = directory / f".packed-{fingerprint[:16]}.{os.getpid()}.tmp"
        slot.lock = lock_path(target) if target is not None else None
        try:
            yield slot
        except BaseException as e:
            _failed_write(e, slot.tmp, where)
            raise
        if target is None:
            slot.data = load_packed(slot.tmp)
            slot.tmp.unlink()  # the mapping stays valid
            slot.data.path = None
            return
        os.replace(slot.tmp, target)
    slot.data = load_packed(target)


def build_cached(cache_dir: str | os.PathLike | None, fingerprint: str,
                 cached: Callable[[Path], Optional[PackedData]], write: Callable[[Path, Optional[Path]], None],
                 log: Callable[[str], None], where: str = "") -> tuple[PackedData, bool]:
    """:func:`cache_slot` with the build as a callable: ``(data, from_cache)``, the file built by
    ``write(tmp, lock)`` when it is not cached."""
    with cache_slot(cache_dir, fingerprint, cached, log, where) as slot:
        if slot.data is None:
            write(slot.tmp, slot.lock)
    return slot.data, slot.hit


def cached_text(target: Optional[Path], fingerprint: str, seq_len: int, vocab_size) -> Optional[PackedData]:
    """The cache file ``target`` when it is valid for ``fingerprint`` (vocabulary checked), else None."""
    if target is None or not target.is_file():
        return None
    try:
        data = load_packed(target)
        meta = read_header(target)[0]["__metadata__"]
    except Exception:  # noqa: BLE001 - unreadable / partial cache file: rebuild
        return None
    if data.fingerprint != fingerprint or data.seq_len != seq_len:
        return None
    check_vocab(int(meta.get("max_id", -1)), vocab_size)
    return data


def cached_sft(path: Path, fp: str, pack: bool) -> Optional[PackedData]:
    """The packed file at ``path`` when it holds SFT rows for ``fp`` (positions iff ``pack``), else None."""
    try:
        data = load_packed(path)
    except Exception:  # noqa: BLE001 - unreadable cache: rebuild
        return None
    ok = data.fingerprint == fp and data.train_labels is not None and (data.train_positions is not None) == pack
    return data if ok else None


def cached_pairs(path: Path, fp: str) -> Optional[PackedData]:
    """The packed file at ``path`` when it holds preference pairs for ``fp``, else None."""
    try:
        data = load_packed(path)
    except Exception:  # noqa: BLE001 - unreadable cache: rebuild
        return None
    ok = data.fingerprint == fp and data.pairs and data.train_labels is not None
    return data if ok else None
