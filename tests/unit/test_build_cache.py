"""``cache.build_cached`` after a launcher was killed with SIGKILL mid-build, and on a cache it cannot write:
the dead builder's temporary files are removed, its lock is taken over at once (its pid is gone on this host),
and an unwritable cache directory is one DataError naming the fix (found by a fresh-user review)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from npu_train.data import DataError
from npu_train.data import cache as ds
from npu_train.data import packfile as pf

FP = "cd" * 32


def _data() -> pf.PackedData:
    rows = torch.arange(4 * 9, dtype=torch.int64).reshape(4, 9)
    return pf.PackedData(train=rows, val=rows[:1].clone(), seq_len=8, n_tokens=36, fingerprint=FP)


def _cached(path):
    d = pf.load_packed(path)
    return d if d.fingerprint == FP else None


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no process has this pid now (pids are not reused this fast)


def test_a_killed_builders_files_and_lock_are_cleared(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    pid = _dead_pid()
    leftovers = [data_dir / f".packed-{FP[:16]}.{pid}.tmp{suffix}" for suffix in ("", ".ids", ".mask", ".meta")]
    for p in leftovers:
        p.write_bytes(b"x" * 100)
    other = data_dir / ".packed-0123456789abcdef.77.tmp.ids"  # another data set's build: not ours to remove
    other.write_bytes(b"y")
    target = ds.packed_cache_path(data_dir, FP)
    ds.lock_path(target).write_text(f"{socket.gethostname()} pid {pid}\n")  # fresh mtime: not stale by age
    logs: list[str] = []
    data, hit = ds.build_cached(data_dir, FP, _cached, lambda tmp, lock: pf.save_packed(_data(), tmp), logs.append)
    assert not hit and torch.equal(data.train.long(), _data().train)
    assert any("taking over the stale build lock" in m and "its process is gone" in m for m in logs), logs
    assert not any("waiting for" in m for m in logs), logs
    assert sorted(p.name for p in data_dir.iterdir()) == sorted([target.name, other.name])


def test_a_live_holder_on_another_host_is_waited_for(tmp_path):
    assert not ds._holder_gone(f"{socket.gethostname()} pid {os.getpid()}")  # alive
    assert ds._holder_gone(f"{socket.gethostname()} pid {_dead_pid()}")
    assert not ds._holder_gone(f"other-node-{socket.gethostname()} pid {_dead_pid()}")  # not judged from here
    assert not ds._holder_gone("garbage")


@pytest.mark.parametrize("cache", [True, False])
def test_an_unwritable_cache_directory_is_one_error(tmp_path, monkeypatch, cache):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    real = os.access
    # root ignores permission bits, so stand in for a read-only mount (EROFS) through os.access
    monkeypatch.setattr(ds.os, "access", lambda p, m: False if str(p) == str(data_dir) else real(p, m))
    monkeypatch.setattr(ds.tempfile, "gettempdir", lambda: str(data_dir))
    fix = "point \\$NPT_CACHE at a writable directory" if cache else "set TMPDIR to a writable directory"
    with pytest.raises(DataError, match=f"cannot write the packed training data into .*data: make it writable or {fix}"):
        ds.build_cached(data_dir if cache else None, FP, _cached, lambda tmp, lock: pf.save_packed(_data(), tmp),
                        lambda m: None)
    assert list(data_dir.iterdir()) == []
