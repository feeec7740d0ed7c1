"""Liveness is decided by heartbeats only (issue 12).

A card that spends a long time in one phase while its heartbeats keep arriving (a 150 s first-step
compilation on RNGD, a 135 s checkpoint write) must not bring the job down: its neighbours wait in
stage-boundary receives and gloo collectives without a timeout of their own. Scaled down here:
``runtime.heartbeat_timeout_s=3`` and a slow phase of 12 s (4 x the heartbeat timeout) on one card,
injected with ``NPT_FAULT=...,action=sleep:12``.

Mutation check (run by hand, seen failing): restoring a fixed timeout of 2 x the heartbeat
timeout in ``runtime/job.py`` (``RuntimeSpec(..., recv_timeout_s=2 * rt.heartbeat_timeout_s,
collective_timeout_s=2 * rt.heartbeat_timeout_s)``) makes both cases exit 1 with a
``TransportTimeout`` / gloo timeout instead of finishing.

The hung (SIGSTOP) and killed cards of ``test_faults.py`` still bring the job down within the
heartbeat timeout; :func:`test_hang_during_startup_names_phase_and_timeout` covers a card that hangs
during start-up.
"""
from __future__ import annotations

import pytest

from conftest import launch_to_end

pytestmark = [pytest.mark.timeout(180), pytest.mark.heavy]  # multi-process fault runs: CI's heavy step

HB = 3.0
SLOW_S = 4 * HB


@pytest.mark.parametrize("fault", [
    f"rank=1,phase=checkpoint,step=2,action=sleep:{SLOW_S:g}",   # slow shard write; rank 0 waits in gloo
    f"rank=0,phase=forward,step=1,action=sleep:{SLOW_S:g}",      # slow first step; rank 1 waits in a receive
], ids=["checkpoint", "first-forward"])
def test_slow_phase_on_live_card_completes(tiny_model, tmp_path, fault):
    job = launch_to_end(tmp_path, tiny_model, "train.steps=3", "train.save_every=2",
                        f"runtime.heartbeat_timeout_s={HB:g}", "runtime.heartbeat_interval_s=0.5",
                        env={"NPT_FAULT": fault}, timeout=150)
    assert "NPT_FAULT: sleep" in job.stderr, job.tail()  # the slow phase really ran
    assert "done: 3 steps" in job.stdout


def test_hang_during_startup_names_phase_and_timeout(tiny_model, tmp_path):
    """A card SIGSTOPped right after its model load: the message names the phase and the timeout."""
    job = launch_to_end(tmp_path, tiny_model, "train.steps=3", f"runtime.heartbeat_timeout_s={HB:g}",
                        env={"NPT_FAULT": "rank=1,phase=load,action=stop"}, expect_rc=1)
    (err,) = job.error_lines()
    assert "card cpu:1 (stage 1" in err and "during model load" in err, err
    assert f"runtime.heartbeat_timeout_s={HB:g}" in err and "stopped responding" in err, err


def test_silent_process_names_startup_timeout():
    """A card process never heard from is failed after runtime.startup_timeout_s, and the message says so
    (unit check of the coordinator's decision, no processes)."""
    from types import SimpleNamespace

    from npu_train.errors import JobFailed
    from npu_train.runtime.coordinator import Coordinator, RankState

    c = Coordinator.__new__(Coordinator)
    c.hb_timeout, c.startup_timeout = 3.0, 30.0
    proc = SimpleNamespace(exitcode=None, pid=4242)
    c.ranks = [RankState(0, "cpu:0", "0-2", proc=proc, started_at=100.0, last_seen=100.0)]
    c._check_failures(poller=None, now=120.0)  # within the start-up allowance: no failure
    with pytest.raises(JobFailed, match=r"card cpu:0 \(stage 0, layers 0-2\) failed during start: .*"
                                        r"runtime.startup_timeout_s=30"):
        c._check_failures(poller=None, now=131.0)
    # once heard from, the heartbeat timeout applies even before the card is ready
    c.ranks[0].heard, c.ranks[0].last_seen, c.ranks[0].phase = True, 131.0, "rendezvous"
    with pytest.raises(JobFailed, match=r"failed during rendezvous: stopped responding.*heartbeat_timeout_s=3"):
        c._check_failures(poller=None, now=134.5)
