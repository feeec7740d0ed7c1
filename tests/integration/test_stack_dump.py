"""``kill -USR1 <pid>`` (docs/troubleshooting.md): the launcher and every card process print
every thread's Python stack to the launcher's stderr and the job goes on, also when the signal reaches
a card process still starting (importing torch, before its handler exists: it starts with SIGUSR1
blocked, a mask inherited from the launcher, and dumps once its handler is registered, instead of being killed
by it)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from launch_util import Job

pytestmark = pytest.mark.timeout(180)


def test_usr1_during_card_start_up_and_training_dumps_stacks_and_the_job_goes_on(tiny_model, tmp_path):
    job = Job(tmp_path, tiny_model, "train.steps=100", "checkpoint.save=false")
    try:
        info = job.job_info()  # written right after the card processes were started: they are importing
        for pid in job.card_pids(info):
            os.kill(pid, signal.SIGUSR1)
        job.wait_steps(2, 120)  # the cards have registered their dump by now
        for pid in job.card_pids(info) + [job.proc.pid]:  # one at a time: dumps sent at once interleave
            os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
        time.sleep(0.5)
        rc = job.wait(120)
    finally:
        job.kill_all()
    assert rc == 0, job.tail()
    assert len(job.losses()) == 100
    err = job.stderr
    # launcher + 2 card processes, each dumping at least its main thread
    assert err.count("(most recent call first)") >= 3, job.tail(6000)
    assert "in _heartbeat_loop" in err and "coordinator.py" in err, job.tail(6000)
    # each dump is followed by a line naming its process (the stacks show thread ids only)
    assert "are the launcher's (pid %d" % job.proc.pid in err, job.tail(6000)
    for pid in job.card_pids(info):
        assert ("(pid %d, kill -USR1)" % pid) in err and "are card cpu:" in err, job.tail(6000)
