"""``train.resume=auto`` (what a restarted Kubernetes pod passes): a fresh start when the checkpoint
directory holds no complete checkpoint, else an exact continuation from the newest one."""
from __future__ import annotations

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
