"""A second SIGTERM while the interrupt save runs aborts it, and status.json still says where the run stands."""
from __future__ import annotations

import json
import os
import signal
import time

from launch_util import Job


def test_second_sigterm_during_interrupt_save_writes_status(tiny_model, tmp_path):
    from npu_train.checkpoint.store import complete_checkpoints

    ck = str(tmp_path / "ckpt")
    # card 0's save of step 4 sleeps 20 s: both signals come while it runs
    job = Job(tmp_path, tiny_model, "train.steps=5000", "train.save_every=2", "train.save_on_interrupt=true",
              f"checkpoint.dir={ck}", env={"NPT_FAULT": "rank=0,phase=checkpoint,step=4,action=sleep:20"})
    try:
        job.job_info()
        job.wait_for(lambda: "step    4/" in job.stdout, 90, "step 4")
        os.kill(job.proc.pid, signal.SIGTERM)
        job.wait_for(lambda: "interrupt (SIGTERM)" in job.stderr, 30, "the interrupt notice")
        time.sleep(0.5)  # not the same signal delivered twice (Coordinator.DUPLICATE_SIGNAL_S)
        os.kill(job.proc.pid, signal.SIGTERM)
        rc = job.wait(60)
    finally:
        job.kill_all()
    assert rc == 128 + signal.SIGTERM, job.tail()
    with open(os.path.join(job.run_dir, "status.json")) as f:
        status = json.load(f)
    cks = complete_checkpoints(ck)
    assert [os.path.basename(c) for c in cks] == ["step_000002"]
    assert status["status"] == "interrupted" and status["checkpoint"] == cks[-1], status
    assert "train.resume=latest" in status["resume"], status
