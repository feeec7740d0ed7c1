"""A checkpoint that does not fit on its disk fails with the sizes and the fix, leaves no partial shard,
and never touches the last complete checkpoint; the coordinator warns when the next one will not fit."""
from __future__ import annotations

import errno
import os
from collections import namedtuple

import pytest
import torch

from npu_train.checkpoint import store
from npu_train.checkpoint.store import (CheckpointSpaceError, finalize, find_checkpoint, save_shard,
                                        shard_bytes, tmp_dir)

Usage = namedtuple("Usage", "total used free")


def _fake_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: Usage(10**12, 0, free))


def _publish(root, step):
    st = tmp_dir(str(root), step, "job1")
    save_shard(st, 0, {"master.w": torch.full((4,), float(step))}, {"rank": 0})
    return finalize(str(root), st, step, {"model": {}})


def test_shard_bytes_counts_dtypes():
    assert shard_bytes({"a": torch.zeros(10), "b": torch.zeros(3, dtype=torch.bfloat16),
                        "r": torch.zeros(5, dtype=torch.uint8)}) == 40 + 6 + 5


def test_save_refused_before_writing_when_disk_is_too_small(tmp_path, monkeypatch):
    good = _publish(tmp_path, 1)
    st = tmp_dir(str(tmp_path), 2, "job1")
    t = {"master.w": torch.zeros(1 << 20)}  # 4 MiB of tensor data
    _fake_free(monkeypatch, store.SHARD_MARGIN_BYTES + (4 << 20) - 1)
    with pytest.raises(CheckpointSpaceError) as ei:
        save_shard(st, 3, t, {"rank": 3})
    msg = str(ei.value)
    assert "stage 3" in msg and f"in {tmp_path} but" in msg and ".tmp-" not in msg and "checkpoint.dir" in msg and "MB" in msg
    assert not os.path.exists(os.path.join(st, "stage_003.safetensors"))
    assert find_checkpoint("latest", str(tmp_path)) == good
    _fake_free(monkeypatch, store.SHARD_MARGIN_BYTES + (4 << 20))  # exactly enough: written
    save_shard(st, 3, t, {"rank": 3})
    assert os.path.exists(os.path.join(st, "stage_003.safetensors"))


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"),
                                 RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")])
def test_out_of_space_during_write_is_reported_and_partial_file_removed(tmp_path, monkeypatch, exc):
    good = _publish(tmp_path, 1)
    st = tmp_dir(str(tmp_path), 2, "job1")

    def failing_save(path, entries, metadata=None, visit=None):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise exc

    monkeypatch.setattr(store, "write_stream", failing_save)
    with pytest.raises(CheckpointSpaceError, match="stage 0"):
        save_shard(st, 0, {"master.w": torch.zeros(4)}, {"rank": 0})
    assert not os.path.exists(os.path.join(st, "stage_000.safetensors"))
    assert find_checkpoint("latest", str(tmp_path)) == good


def test_other_write_errors_pass_through(tmp_path, monkeypatch):
    st = tmp_dir(str(tmp_path), 2, "job1")

    def failing_save(path, entries, metadata=None, visit=None):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(store, "write_stream", failing_save)
    with pytest.raises(PermissionError):
        save_shard(st, 0, {"master.w": torch.zeros(4)}, {"rank": 0})


def test_space_warning_when_the_next_checkpoint_will_not_fit(tmp_path, monkeypatch):
    final = _publish(tmp_path, 1)
    size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
    _fake_free(monkeypatch, size)
    assert store.space_warning(str(tmp_path), final) is None
    _fake_free(monkeypatch, size - 1)
    w = store.space_warning(str(tmp_path), final)
    assert w and "next save will fail" in w and str(tmp_path) in w


def test_launch_warning_from_the_model_size(tmp_path, monkeypatch):
    """12 B per parameter (fp32 master + two moments), the tied lm_head stored again by the last stage."""
    from npu_train.model.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, tie_word_embeddings=True)
    size = 12 * (cfg.total_params() + 96 * 32)
    _fake_free(monkeypatch, size)
    assert store.launch_space_warning(str(tmp_path), cfg, 2, "full") is None
    _fake_free(monkeypatch, size - 1)
    w = store.launch_space_warning(str(tmp_path), cfg, 2, "full")
    assert w and "first save will fail" in w and str(tmp_path) in w
    assert store.launch_space_warning(str(tmp_path), cfg, 1, "full") is None  # one stage: stored once
    assert store.launch_space_warning(str(tmp_path), cfg, 2, "lora") is None
