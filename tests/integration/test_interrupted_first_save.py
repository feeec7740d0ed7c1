"""kill -9 of the whole job during its first (only) save, then train.resume=latest (issue 28): one error line
saying that the only save was interrupted, exit 2, and the dead job's staging directory is removed."""
from __future__ import annotations

import glob
import os

import pytest

from launch_util import Job

pytestmark = pytest.mark.timeout(240)


def test_resume_after_kill_during_the_only_save(tiny_model, tmp_path):
    ck = str(tmp_path / "ckpt")
    # card 0 sleeps after writing its shard of step 2 (the end save): the staging dir exists, no manifest
    a = Job(tmp_path, tiny_model, "train.steps=2", f"checkpoint.dir={ck}", name="a",
            env={"NPT_FAULT": "rank=0,phase=checkpoint,step=2,action=sleep:60"})
    try:
        a.job_info()
        staged = a.wait_for(lambda: glob.glob(os.path.join(ck, ".tmp-step_000002-*", "stage_000.json")), 120,
                            "card 0's shard of step 2")
    finally:
        a.kill_all()  # kill -9 of the launcher and every card process
    staging = os.path.dirname(staged[0])
    assert os.path.isdir(staging)
    b = Job(tmp_path, tiny_model, "train.steps=2", f"checkpoint.dir={ck}", "train.resume=latest", name="b")
    try:
        rc = b.wait(120)
    finally:
        b.kill_all()
    lines = b.error_lines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in b.stderr, b.tail()
    assert "the only save (step 2) was interrupted" in lines[0] and os.path.basename(staging) in lines[0], lines[0]
    assert "without train.resume" in lines[0] and "set checkpoint.dir" not in lines[0], lines[0]
    assert f"removed {staging}: staging directory of a job that is no longer running" in b.flat_stdout, b.tail()
    assert not os.path.exists(staging) and not glob.glob(os.path.join(ck, ".tmp-*")), os.listdir(ck)
