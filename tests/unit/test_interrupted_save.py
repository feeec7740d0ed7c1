"""kill -9 during the first save, then train.resume=latest (issue 28): the error says the only save was
interrupted (not "set checkpoint.dir to the run's checkpoint directory", which it already was), and the dead
job's staging directory is removed as every later launch does."""
from __future__ import annotations

import json
import os

import pytest

from npu_train.checkpoint.store import CheckpointError, find_checkpoint, remove_stale_staging


def _dead_staging(root, step: int, job: str) -> str:
    d = os.path.join(str(root), f".tmp-step_{step:06d}-{job}")
    os.makedirs(d)
    with open(os.path.join(d, "owner.json"), "w") as f:  # a pid that never ran long enough to match
        json.dump({"pid": 2 ** 22 + 7, "start": 1.0, "host": os.uname().nodename, "job_id": job}, f)
    with open(os.path.join(d, "stage_000.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    return d


def test_resume_latest_names_the_interrupted_only_save(tmp_path):
    d = _dead_staging(tmp_path, 2, "abc123")
    with pytest.raises(CheckpointError) as ei:  # still there (e.g. not the owner node)
        find_checkpoint("latest", str(tmp_path))
    msg = str(ei.value)
    assert "the only save (step 2) was interrupted" in msg and ".tmp-step_000002-abc123" in msg, msg
    assert "start the run again without train.resume" in msg and "set checkpoint.dir" not in msg
    removed = remove_stale_staging(str(tmp_path))
    assert removed == [d] and os.listdir(tmp_path) == []
    with pytest.raises(CheckpointError) as ei:
        find_checkpoint("latest", str(tmp_path), interrupted=removed)
    assert "the only save (step 2) was interrupted" in str(ei.value) and "removed now" in str(ei.value)
    with pytest.raises(CheckpointError, match="set checkpoint.dir to the run's checkpoint directory"):
        find_checkpoint("latest", str(tmp_path))  # nothing was ever saved there: the old advice


def test_two_interrupted_saves_are_both_named(tmp_path):
    _dead_staging(tmp_path, 2, "a1")
    _dead_staging(tmp_path, 4, "a1")
    with pytest.raises(CheckpointError, match=r"every save \(steps 2, 4\) was interrupted"):
        find_checkpoint("latest", str(tmp_path))
