"""The packed data file (job IPC dir under $TMPDIR, or the cache under $NPT_CACHE) on a short disk:
a one-line DataError naming the directory, the sizes and the setting that moves it; no temp file left."""
from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple

import pytest
import torch

from npu_train.data import packfile as ds
from npu_train.data.text import DataError

Usage = namedtuple("Usage", "total used free")


def _data():
    rows = torch.arange(4 * 33, dtype=torch.int64).reshape(4, 33)
    return ds.PackedData(train=rows, val=rows[:1].clone(), seq_len=32, n_tokens=132, fingerprint="ab" * 32)


def test_fits_writes_the_file(tmp_path):
    p = ds.save_packed(_data(), tmp_path / "data.safetensors", where="set TMPDIR")
    assert torch.equal(ds.load_packed(p).train.long(), _data().train)


def test_short_disk_is_refused_before_writing(tmp_path, monkeypatch):
    need = 5 * 33 * 2 + ds.PACKED_MARGIN_BYTES  # ids < 65536 are stored as uint16
    monkeypatch.setattr(shutil, "disk_usage", lambda d: Usage(10**9, 10**9, need - 1))
    with pytest.raises(DataError, match=r"needs 1\.0 MB in .* but only 1\.0 MB are free: .* or set TMPDIR"):
        ds.save_packed(_data(), tmp_path / "data.safetensors", where="set TMPDIR")
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(shutil, "disk_usage", lambda d: Usage(10**9, 10**9, need))
    ds.save_packed(_data(), tmp_path / "data.safetensors")  # exactly enough: written
    assert os.listdir(tmp_path) == ["data.safetensors"]


def test_disk_filling_up_during_the_write(tmp_path, monkeypatch):
    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"x" * 100)  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds, "save_file", full)
    with pytest.raises(DataError, match="free disk space there or point"):
        ds.save_packed(_data(), tmp_path / "data.safetensors", where="point $NPT_CACHE at a larger disk")
    assert os.listdir(tmp_path) == []


def test_safetensors_error_for_a_full_disk_is_the_same_data_error(tmp_path, monkeypatch):
    """safetensors reports a full disk as SafetensorError ("I/O error: No space left on device"),
    not OSError: the same DataError; any other error passes through; no temp file stays either way."""
    class SafetensorError(Exception):
        pass

    def full(tensors, filename, metadata=None):
        open(filename, "wb").write(b"x" * 10)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ds, "save_file", full)
    with pytest.raises(DataError, match="free disk space there or set TMPDIR"):
        ds.save_packed(_data(), tmp_path / "data.safetensors", where="set TMPDIR")
    assert os.listdir(tmp_path) == []

    def other(tensors, filename, metadata=None):
        open(filename, "wb").write(b"x" * 10)
        raise SafetensorError("Error while serializing: something else")

    monkeypatch.setattr(ds, "save_file", other)
    with pytest.raises(SafetensorError, match="something else"):
        ds.save_packed(_data(), tmp_path / "data.safetensors")
    assert os.listdir(tmp_path) == []


def test_tokenizer_cache_write_failure_is_ignored(tmp_path, monkeypatch):
    """The tokenizer built from a GGUF file is cached under $NPT_CACHE; a failed write (tokenizers
    raises a plain Exception for a full disk) costs only the cache: the tokenizer is returned and no
    partial file stays."""
    from npu_train.model import resolve_model_path
    from npu_train.model import tokenizer as tk

    class Tok:
        pre_tokenizer = None

        def save(self, path):
            open(path, "w").write("{")
            raise Exception("No space left on device (os error 28)")

    monkeypatch.setenv("NPT_CACHE", str(tmp_path))
    monkeypatch.setattr(tk, "_transformers_backend", lambda d, gguf_file, what: Tok())
    tok = tk._gguf_tokenizer(resolve_model_path("embedded"))
    assert isinstance(tok, Tok)
    left = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
    assert not any("tokenizers" in p for p in left), left


class _Disk:
    """A fake ``shutil.disk_usage`` for a cache directory whose disk fills up: 5 GB free until ``full`` is set,
    then 1 kB while the build's temporaries (``.packed-*`` files) are there; once they are removed the space
    they held is free again (5 GB), as on a real disk."""

    def __init__(self, directory):
        self.directory, self.full = directory, False

    def __call__(self, d):
        held = any(p.name.startswith(".") for p in self.directory.iterdir()) if self.directory.is_dir() else False
        return Usage(10**10, 0, 1000 if self.full and held else 5 * 10**9)


def _enospc(disk, write):
    """``write`` wrapped: it writes its bytes (the partial file grows), then the disk is full (ENOSPC)."""
    def full(*a, **k):
        write(*a, **k)
        disk.full = True
        raise OSError(errno.ENOSPC, "No space left on device")
    return full


def test_full_disk_message_gives_the_free_space_when_the_write_failed(tmp_path, monkeypatch):
    """The text build, whose token stream fills the disk: the message gives the free space when the write
    failed (0.0 MB), not the space free again after the partial file was removed (5000 MB), and what it had
    written; save_packed likewise, with the bytes it needs."""
    from npu_train.data import botchan_text
    from npu_train.data.prepare import TextSpec, build_packed_data
    from npu_train.data.sources import resolve_source
    from tokenizers import Tokenizer, models, pre_tokenizers

    cache = tmp_path / "c"
    cache.mkdir()
    disk = _Disk(cache)
    monkeypatch.setattr(shutil, "disk_usage", disk)
    monkeypatch.setattr(ds.TokenStreamFile, "write", _enospc(disk, ds.TokenStreamFile.write))
    src = tmp_path / "t.txt"
    src.write_text(botchan_text()[:20_000])
    tok = Tokenizer(models.WordLevel({"[unk]": 0}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(DataError, match=r"^the disk ran out of space in .*/c \(0\.0 MB free when the write failed; "
                                        r"0\.\d MB written by then, removed since\) while writing the packed training "
                                        r"data: free disk space there or point \$NPT_CACHE at a larger disk$"):
        build_packed_data(TextSpec(resolve_source(str(src), "text")), tok, 8, 0.1, eos_id=0, cache_dir=cache)
    assert os.listdir(cache) == []

    disk.full = False
    monkeypatch.setattr(ds, "save_file", _enospc(disk, lambda t, filename, metadata=None: open(filename, "wb").write(
        b"x" * 100)))
    with pytest.raises(DataError, match=r"\(0\.0 MB free when the write failed; 0\.0 MB written by then, removed "
                                        r"since; the packed data needs 1\.0 MB\) while writing"):
        ds.save_packed(_data(), cache / "data.safetensors")
    assert os.listdir(cache) == []
