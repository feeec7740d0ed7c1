"""``checkpoint.save=false`` (benchmarks, smoke runs): no checkpoint is written at all, nothing at launch
prepares or checks the checkpoint dir, the user is told once that the run cannot be resumed, and no
message offers a resume command. The end-to-end job: ``tests/integration/test_no_checkpoint.py``."""
from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from npu_train.checkpoint import store
from npu_train.config import Config, validate
from npu_train.errors import ConfigError
from npu_train.model.config import LlamaConfig
from npu_train.runtime import saving
from npu_train.runtime.trainer import StageTrainer

Usage = namedtuple("Usage", "total used free")


def _cfg(*dotlist):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(list(dotlist)))


def test_save_false_with_periodic_saves_or_stop_after_is_refused():
    validate(_cfg("checkpoint.save=false"))
    validate(_cfg("checkpoint.save=false", "train.resume=latest"))  # reads a checkpoint, writes none
    validate(_cfg("checkpoint.save=true", "train.save_every=5"))
    with pytest.raises(ConfigError, match=r"checkpoint\.save=false .*train\.save_every=5"):
        validate(_cfg("checkpoint.save=false", "train.save_every=5"))
    with pytest.raises(ConfigError, match=r"checkpoint\.save=false .*train\.stop_after=2"):
        validate(_cfg("checkpoint.save=false", "train.stop_after=2"))


@pytest.mark.parametrize("save", [True, False])
def test_save_due_never_with_save_false(save):
    """Every reason to save (periodic, last step, interrupt, stop_after) is off with checkpoint.save=false."""
    tr = SimpleNamespace(save_every=2, steps=4, save_on_interrupt=True, save_checkpoints=save)
    me = SimpleNamespace(tr=tr)
    due = [StageTrainer.save_due(me, 2, False, False), StageTrainer.save_due(me, 4, False, False),
           StageTrainer.save_due(me, 3, True, True), StageTrainer.save_due(me, 3, False, True)]
    assert due == [save] * 4
    assert not StageTrainer.save_due(me, 3, False, False)


def _model():
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, tie_word_embeddings=True)


def test_launch_with_save_false_touches_no_checkpoint_dir(tmp_path, monkeypatch, capsys):
    """No directory, no free-space warning (even on a full disk), one note that nothing is saved."""
    monkeypatch.setattr(store.shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 0))
    root = tmp_path / "ckpt"
    saving.prepare_checkpoint_root(str(root), _cfg("checkpoint.save=false"), _model(), 2, [], owner=True)
    out = capsys.readouterr().out
    assert not root.exists()
    assert out.splitlines() == [saving.NO_SAVE_NOTE] and "cannot be resumed" in out
    # saving: refused (tests/unit/test_checkpoint_space.py); checkpoint.low_space=warn: a warning
    saving.prepare_checkpoint_root(str(root), _cfg("checkpoint.low_space=warn"), _model(), 2, [], owner=True)
    out = capsys.readouterr().out
    assert root.is_dir() and "first save will fail" in out and "checkpoint.save" not in out


def test_end_of_run_messages_offer_no_resume_without_checkpoints():
    note = saving.interrupt_note(None, "/ck", "sync", save=False)
    assert "checkpoint.save=false" in note and "cannot be resumed" in note and "train.resume" not in note
    assert "train.resume=latest checkpoint.dir=/ck" in saving.interrupt_note("/ck/step_000002", "/ck", "sync")
    assert saving.done_checkpoint(None, save=False) == "no checkpoint (checkpoint.save=false)"
    assert saving.done_checkpoint("/ck/step_000002") == "checkpoint: /ck/step_000002"
