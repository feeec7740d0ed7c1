"""``python -m npu_train.checkpoint.export``: a wrong checkpoint argument is one ``error:`` line that
names the export tool's own argument and the fix (not the trainer's ``train.resume``), exit 2,
and nothing is written."""
from __future__ import annotations

import os

import pytest

from npu_train.checkpoint.export import main


@pytest.mark.parametrize("make", ["missing", "empty_dir"])
def test_bad_checkpoint_argument_names_the_export_argument(tmp_path, capsys, make):
    ckpt = tmp_path / "ckpt"
    if make == "empty_dir":
        ckpt.mkdir()
    out = tmp_path / "hf"
    assert main([str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    assert "train.resume" not in err, err
    assert "python -m npu_train.checkpoint.export" in err and "<checkpoint>" in err, err
    assert "step_XXXXXX" in err and "checkpoint.dir" in err, err  # the fix: which directory to give
    assert str(ckpt) in err
    assert not os.path.exists(out)  # nothing written
