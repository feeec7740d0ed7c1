"""Resume onto other settings or other data is refused before anything starts (issue 12), unless
``train.resume_mismatch=allow``; the unit side (write-order ``latest``, staging owners, leftovers,
run-dir rotation) is ``tests/unit/test_resume_safety.py``."""
from __future__ import annotations

import os

import pytest

from conftest import run_pipeline
from npu_train.errors import error_lines

pytestmark = pytest.mark.timeout(300)


def test_resume_refuses_changed_lr_or_data_unless_allowed(tiny_model, tmp_path, capsys):
    from npu_train.data.text import botchan_text

    ck = str(tmp_path / "ckpt")
    common = ("backend=[cpu]", "train.steps=3", f"checkpoint.dir={ck}")
    run_pipeline(tiny_model, str(tmp_path / "first"), *common, "train.stop_after=1")
    capsys.readouterr()

    run_pipeline(tiny_model, str(tmp_path / "lr"), *common, "train.resume=latest", "train.lr=2e-3", expect_rc=2)
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "train.lr: checkpoint 0.001, now 0.002" in err[0], err
    assert "train.resume_mismatch=allow" in err[0]

    # the same text with one word changed: same number of sequences, another fingerprint
    text = botchan_text()
    i = text.index(" the ", 5000)
    src = tmp_path / "other.txt"
    src.write_text(text[:i] + " thy " + text[i + 5:])
    run_pipeline(tiny_model, str(tmp_path / "data"), *common, "train.resume=latest", f"data.source={src}",
                 expect_rc=2)
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and "data fingerprint does not match" in err[0], err
    assert not os.path.exists(tmp_path / "data" / "metrics.jsonl")  # refused before anything ran

    losses, reader = run_pipeline(tiny_model, str(tmp_path / "allowed"), *common, "train.resume=latest",
                                  "train.lr=2e-3", "train.resume_mismatch=allow")
    assert len(losses) == 2 and reader.step == 3
    assert "resuming with a changed setting (train.resume_mismatch=allow): train.lr" in capsys.readouterr().out


def test_resume_refuses_other_adapters_damaged_shards_and_other_data_order(tiny_model, tmp_path, capsys):
    """A LoRA checkpoint resumed with fewer lora.targets would silently drop trained adapters: refused
    (exit 2, one line, nothing ran); a truncated shard is named, with the checkpoint before it, before
    any card process starts; a data.seq_len change (another data order) is refused without pointing at
    train.resume_mismatch=allow, which cannot continue it."""
    ck = str(tmp_path / "ckpt")
    common = ("backend=[cpu]", "train.steps=4", f"checkpoint.dir={ck}", "train.mode=lora", "train.save_every=1")
    run_pipeline(tiny_model, str(tmp_path / "first"), *common, "train.stop_after=2")
    capsys.readouterr()

    def refused(name, *overrides):
        run_pipeline(tiny_model, str(tmp_path / name), *common, "train.resume=latest", *overrides, expect_rc=2)
        err = error_lines(capsys.readouterr().err)
        assert len(err) == 1, err
        assert not os.path.exists(tmp_path / name / "metrics.jsonl")  # refused before anything ran
        return err[0]

    msg = refused("narrow", "lora.targets=[q_proj,v_proj]")
    assert "lora.targets: checkpoint [q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj], now [q_proj,v_proj]" in msg
    assert "resume with train.mode=lora lora.rank=8" in msg
    assert "train.mode=lora run's state but this run is train.mode=full" in refused("full", "train.mode=full")

    msg = refused("seq", "data.seq_len=16", "train.resume_mismatch=allow")
    assert "data.seq_len" in msg and "resume_mismatch" not in msg, msg

    shard = os.path.join(ck, "step_000002", "stage_000.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    msg = refused("damaged")
    assert f"shard {shard} is damaged" in msg and f"train.resume={os.path.join(ck, 'step_000001')}" in msg, msg


def test_resume_from_truncated_manifest_is_one_line(tiny_model, tmp_path, capsys):
    """A damaged checkpoint (manifest.json cut short, as by an interrupted copy) named by train.resume is one
    ``error:`` line naming the file, exit status 2, before anything starts (was the bare JSON error)."""
    ck = str(tmp_path / "ckpt")
    _, reader = run_pipeline(tiny_model, str(tmp_path / "first"), "backend=[cpu]", "train.steps=1",
                             f"checkpoint.dir={ck}")
    mp = os.path.join(reader.path, "manifest.json")
    with open(mp, "r+b") as f:
        f.truncate(1000)
    capsys.readouterr()
    run_pipeline(tiny_model, str(tmp_path / "again"), "backend=[cpu]", "train.steps=3",
                 f"checkpoint.dir={tmp_path / 'ckpt2'}", f"train.resume={reader.path}", expect_rc=2)
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and f"{mp}: not a readable checkpoint manifest" in err[0], err
    assert f"there is no other checkpoint in {ck}" in err[0], err
    assert not os.path.exists(tmp_path / "again" / "metrics.jsonl")  # refused before anything ran
