"""The ``done:`` line says how long the launch took and how fast it trained (issue 40: both were only in
``summary.json``): its wall time as h:mm:ss and the mean trained tokens/s, within the console's width."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from npu_train.runtime.job import fold_words
from npu_train.runtime.saving import end_of_run_line, fmt_wall

TRAIN = SimpleNamespace(steps=200, stop_after=None, offload_update="sync")
CK = "/home/user/npu-train/outputs/2026-12-07/05-00-00.123456/checkpoints"


def _summ(**kw) -> dict:
    return dict({"steps_run": 200, "first_loss": 4.0859, "last_loss": 3.2410, "skipped_steps": 0,
                 "mean_tokens_per_s": 1234.4, "wall_s": 3725.6}, **kw)


@pytest.mark.parametrize("secs,text", [(0, "0:00:00"), (75.3, "0:01:15"), (3725.6, "1:02:06"),
                                       (90061, "25:01:01")])
def test_fmt_wall(secs, text):
    assert fmt_wall(secs) == text


@pytest.mark.parametrize("width", [80, 100])
def test_the_done_line_has_the_wall_time_and_tokens_per_second(width):
    text = fold_words(end_of_run_line(_summ(), 200, TRAIN, CK + "/step_000200", CK, True, CK[:-12]), width)
    first = text.splitlines()[0]
    assert first == "done: 200 steps, loss 4.0859 -> 3.2410, 1,234 tok/s, wall 1:02:06", text
    assert all(len(ln) <= width or " " not in ln.strip() or ln.startswith("  checkpoint: ") for ln in
               text.splitlines()), text
    # chat data trains its assistant tokens only: the trained ones, labelled so
    chat = end_of_run_line(_summ(mean_all_tokens_per_s=5000.0), 200, TRAIN, None, CK, False, "/r")
    assert chat.startswith("done: 200 steps, loss 4.0859 -> 3.2410, 1,234 trained tok/s, wall 1:02:06\n"), chat
    # one step: no mean after the first step, the wall time alone
    one = end_of_run_line(_summ(steps_run=1, mean_tokens_per_s=None, wall_s=20.2), 1,
                          SimpleNamespace(steps=1, stop_after=None, offload_update="sync"), None, CK, False, "/r")
    assert one.startswith("done: 1 step, loss 4.0859 -> 3.2410, wall 0:00:20\n"), one


def test_the_done_line_says_a_busy_runs_speed_was_not_fitted():
    """planner.fit.refit_from_run's note for a run on a busy host is its own indented line after metrics:."""
    from npu_train.planner.fit import busy_note

    note = busy_note(6.04, 2, 2)
    text = end_of_run_line(_summ(), 200, TRAIN, None, CK, False, "/r", fit_note=note)
    lines = text.splitlines()
    assert lines[-1] == ("  fitted: not this run's speed, the host was busy with other work (load average 6.0 on 2 "
                         "cores, this job keeps about 2 busy); later plans keep their rates"), text
    assert lines[-2] == "  metrics: /r/metrics.jsonl"
    assert "fitted:" not in end_of_run_line(_summ(), 200, TRAIN, None, CK, False, "/r")
