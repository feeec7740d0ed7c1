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


# ---------------------------------------------------------------- launch checks (issue 28)
def _cfg(*dotlist):
    from omegaconf import OmegaConf

    from npu_train.config import Config

    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(dotlist)))


def _model():
    from npu_train.model.config import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, tie_word_embeddings=True)


def _fake_free_everywhere(monkeypatch, free: int) -> None:
    from npu_train.runtime import saving

    _fake_free(monkeypatch, free)
    monkeypatch.setattr(saving.shutil, "disk_usage", lambda p: Usage(10**12, 0, free))


@pytest.mark.parametrize("keep,existing,saves,want", [
    (2, 0, 1, 1), (2, 0, 2, 2), (2, 0, 5, 3), (1, 0, 3, 2), (0, 0, 4, 4), (0, 3, 4, 4),
    (2, 2, 3, 1),  # a resume: the 2 kept are on disk already; each save adds one, then the oldest goes
    (2, 5, 1, 1),  # more than keep from an earlier keep=0 launch: the first save still needs room
    (3, 1, 0, 0)])
def test_checkpoints_needed_at_once(keep, existing, saves, want):
    """During a save the keep newest stay beside the one being written (written out by hand per case)."""
    assert store.checkpoints_needed_at_once(keep, existing, saves) == want


@pytest.mark.parametrize("over,start,want", [
    ({"train.steps": 10}, 0, 1), ({"train.steps": 10, "train.save_every": 5}, 0, 2),
    ({"train.steps": 10, "train.save_every": 3}, 0, 4), ({"train.steps": 10, "train.save_every": 3}, 6, 2),
    ({"train.steps": 10, "train.save_every": 3, "train.stop_after": 2}, 0, 1),
    ({"train.steps": 10, "train.save_every": 2, "train.stop_after": 4}, 0, 2)])
def test_saves_of_launch(over, start, want):
    from npu_train.runtime.saving import saves_of_launch

    assert saves_of_launch(_cfg(*[f"{k}={v}" for k, v in over.items()]).train, start) == want


def test_launch_refused_when_one_checkpoint_does_not_fit(tmp_path, monkeypatch, capsys):
    """Refused before the root is created (no work to lose yet), unless checkpoint.low_space=warn or
    checkpoint.save=false."""
    from npu_train.runtime import saving

    size = 12 * (_model().total_params() + 96 * 32)  # two stages: the tied embedding is stored twice
    root = tmp_path / "ckpt"
    _fake_free_everywhere(monkeypatch, size - 1)
    with pytest.raises(saving.CheckpointDirError) as ei:
        saving.prepare_checkpoint_root(str(root), _cfg(), _model(), 2, [], owner=True)
    msg = str(ei.value)
    assert f"free in {root}: the first save will fail" in msg and "checkpoint.low_space=warn" in msg, msg
    assert "checkpoint.save=false" in msg and "larger disk" in msg
    assert not root.exists()
    saving.prepare_checkpoint_root(str(root), _cfg("checkpoint.low_space=warn"), _model(), 2, [], owner=True)
    assert "warning: " in capsys.readouterr().out and root.is_dir()
    _fake_free_everywhere(monkeypatch, size)
    saving.prepare_checkpoint_root(str(root), _cfg(), _model(), 2, [], owner=True)  # exactly enough


def test_launch_refused_when_kept_checkpoints_do_not_fit(tmp_path, monkeypatch):
    """checkpoint.keep=2 with saves every step: three checkpoints at once during the third save."""
    from npu_train.runtime import saving

    size = 12 * (_model().total_params() + 96 * 32)
    cfg = _cfg("train.steps=6", "train.save_every=1", "checkpoint.keep=2")
    _fake_free_everywhere(monkeypatch, 3 * size - 1)
    with pytest.raises(saving.CheckpointDirError) as ei:
        saving.prepare_checkpoint_root(str(tmp_path / "a"), cfg, _model(), 2, [], owner=True)
    msg = str(ei.value)
    assert "up to 3 checkpoints" in msg and "checkpoint.keep=2" in msg and "lower checkpoint.keep" in msg, msg
    _fake_free_everywhere(monkeypatch, 3 * size)
    saving.prepare_checkpoint_root(str(tmp_path / "a"), cfg, _model(), 2, [], owner=True)
    _fake_free_everywhere(monkeypatch, 2 * size)  # keep=1: two at once
    saving.prepare_checkpoint_root(str(tmp_path / "b"), _cfg("train.steps=6", "train.save_every=1",
                                                              "checkpoint.keep=1"), _model(), 2, [], owner=True)


def test_lora_checkpoint_size_counts_the_adapters():
    assert store.checkpoint_bytes(_model(), 2, "lora", lora_params_per_layer=1000) == 12 * 1000 * 2


def test_unwritable_checkpoint_dir_is_refused_with_the_os_error(tmp_path):
    """A path through a file (and, as root, a read-only mount: tests/integration/test_checkpoint_dir.py)."""
    from npu_train.runtime.saving import CheckpointDirError, check_checkpoint_dir_writable

    check_checkpoint_dir_writable(str(tmp_path / "new" / "ckpt"))  # a new root: its parent is probed
    assert os.listdir(tmp_path) == []  # created nothing, probe removed
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointDirError, match=r"checkpoint.dir=.*/f/ckpt cannot be written \(.*/f: \[Errno 20\] "
                                                 r"Not a directory\): point checkpoint.dir at a directory"):
        check_checkpoint_dir_writable(str(tmp_path / "f" / "ckpt"))
