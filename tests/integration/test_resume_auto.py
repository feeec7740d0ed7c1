"""``train.resume=auto`` (what a restarted Kubernetes pod passes): a fresh start when the checkpoint
directory holds no complete checkpoint, else an exact continuation from the newest one. A fresh run
(no ``train.resume``) in that directory is refused (``tests/integration/test_bad_input.py``) unless
``checkpoint.existing=set_aside``, which moves the earlier run's checkpoints to ``previous-1/``."""
from __future__ import annotations

import os

from conftest import run_pipeline


def test_resume_auto_fresh_then_continue(tiny_model, tmp_path):
    ck = f"checkpoint.dir={tmp_path / 'ckpt'}"
    full, _ = run_pipeline(tiny_model, str(tmp_path / "full"), "backend=[cpu,cpu]")
    first, r1 = run_pipeline(tiny_model, str(tmp_path / "a"), "backend=[cpu,cpu]", ck, "train.resume=auto",
                             "train.stop_after=1")
    assert r1.step == 1 and first == full[:1]
    rest, r2 = run_pipeline(tiny_model, str(tmp_path / "b"), "backend=[cpu,cpu]", ck, "train.resume=auto")
    assert r2.step == 3
    assert first + rest == full  # bit-identical on CPU fp32, as resume from a named checkpoint
    # a new run in the same directory: refused, then started afresh with the old checkpoints set aside
    run_pipeline(tiny_model, str(tmp_path / "c"), "backend=[cpu,cpu]", ck, expect_rc=2)
    again, r3 = run_pipeline(tiny_model, str(tmp_path / "d"), "backend=[cpu,cpu]", ck, "checkpoint.existing=set_aside")
    assert again == full and r3.manifest["job_id"] != r2.manifest["job_id"]
    old = tmp_path / "ckpt" / "previous-1"
    assert sorted(os.listdir(old)) == ["latest", "step_000001", "step_000003"]  # moved, not deleted
    assert sorted(d for d in os.listdir(tmp_path / "ckpt") if d.startswith("step_")) == ["step_000003"]


def test_resume_into_the_same_run_dir_continues_its_records(tiny_model, tmp_path):
    """A launch stopped after 2 of 4 steps, then resumed with the same hydra.run.dir (what the recorded
    resume command does): metrics.jsonl holds steps 1-4 in order, the first launch's files are kept in
    previous-1/."""
    import json

    from conftest import launch_to_end

    first = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.stop_after=2", name="same")
    # the stopped launch says it is not complete and how to continue (console and status.json)
    assert "stopped: 2 steps of this launch (train.stop_after=2), at step 2 of train.steps=4" in first.stdout
    # (the suite's own NPT_CACHE makes it "resume with: env NPT_CACHE=... <the same command> ...")
    assert "the same command" in first.stdout and " train.resume=latest checkpoint.dir=" in first.stdout
    assert f"(the whole command: 'resume' in {os.path.join(first.run_dir, 'status.json')})" in first.stdout
    with open(os.path.join(first.run_dir, "status.json")) as f:
        st = json.load(f)
    assert st["status"] == "ok" and st["stopped_at"] == 2 and st["steps"] == 4
    assert "train.resume=latest" in st["resume"] and "checkpoint.dir=" in st["resume"]
    again = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=latest", name="same")
    assert again.run_dir == first.run_dir and "continue with that launch's steps up to 2" in again.stdout
    assert "done: 2 steps" in again.stdout
    with open(os.path.join(again.run_dir, "status.json")) as f:
        assert "stopped_at" not in json.load(f)  # complete
    with open(os.path.join(again.run_dir, "metrics.jsonl")) as f:
        assert [json.loads(l)["step"] for l in f] == [1, 2, 3, 4]
    assert os.path.exists(os.path.join(again.run_dir, "previous-1", "metrics.jsonl"))
