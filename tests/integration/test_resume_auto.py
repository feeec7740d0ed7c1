"""``train.resume=auto`` (what a restarted Kubernetes pod passes): a fresh start when the checkpoint
directory holds no complete checkpoint, else an exact continuation from the newest one. A fresh run
(no ``train.resume``) in that directory is refused (``tests/integration/test_bad_input.py``) unless
``checkpoint.existing=set_aside``, which moves the earlier run's checkpoints to ``previous-1/``."""
from __future__ import annotations

import os
import shlex

import pytest

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
    # moved, not deleted; with the run's tracker ids (the new run writes its own beside)
    assert sorted(os.listdir(old)) == ["latest", "step_000001", "step_000003", "trackers.json"]
    assert sorted(d for d in os.listdir(tmp_path / "ckpt") if d.startswith("step_")) == ["step_000003"]


def test_resume_into_the_same_run_dir_continues_its_records(tiny_model, tmp_path):
    """A launch stopped after 2 of 4 steps, then resumed with the same hydra.run.dir (what the recorded
    resume command does): metrics.jsonl holds steps 1-4 in order, the first launch's files are kept in
    previous-1/."""
    import json

    from conftest import launch_to_end

    first = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.stop_after=2", name="same")
    # the stopped launch says it is not complete and how to continue (console and status.json)
    assert "stopped: 2 steps of this launch (train.stop_after=2), at step 2 of train.steps=4" in first.flat_stdout
    with open(os.path.join(first.run_dir, "status.json")) as f:
        st = json.load(f)
    assert st["status"] == "ok" and st["stopped_at"] == 2 and st["steps"] == 4
    assert "train.resume=latest" in st["resume"] and "checkpoint.dir=" in st["resume"]
    # the whole command to paste (the suite's own NPT_CACHE too: "env NPT_CACHE=... python launch/run.py ..."),
    # not "rerun the same command with ...": its `\`-continued lines are status.json's resume command
    out = first.stdout.splitlines()
    cmd = out[out.index("  resume with:") + 1:]
    cmd = cmd[:next(i for i, ln in enumerate(cmd) if not ln.endswith(" \\")) + 1]
    assert shlex.split("\n".join(cmd).replace("\\\n", "")) == shlex.split(st["resume"]), (cmd, st["resume"])
    assert "the same command" not in first.stdout
    again = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=latest", name="same")
    # previous-1 is the whole first launch: its plan, job and status records too (they used to be overwritten)
    prev = os.path.join(again.run_dir, "previous-1")
    assert {"plan.json", "plan.txt", "job.json", "status.json", "summary.json"} <= set(os.listdir(prev))
    with open(os.path.join(prev, "status.json")) as f:
        assert json.load(f)["stopped_at"] == 2
    assert {"run.log", ".hydra", "checkpoints"} <= set(os.listdir(again.run_dir))  # these stay
    assert again.run_dir == first.run_dir and "continue with the steps up to 2 of " in again.flat_stdout
    assert "done: 2 steps" in again.stdout
    # run.log: the first launch's lines, then the resumed launch's (held back until it was accepted, issue 40)
    with open(os.path.join(again.run_dir, "run.log")) as f:
        log = " ".join(f.read().split())  # (lines folded at words, as in flat_stdout)
    assert 0 <= log.find("stopped: 2 steps of this launch") < log.find("continue with the steps up to 2 of ") \
        < log.find("done: 2 steps"), log[-2000:]
    with open(os.path.join(again.run_dir, "status.json")) as f:
        assert "stopped_at" not in json.load(f)  # complete
    with open(os.path.join(again.run_dir, "metrics.jsonl")) as f:
        assert [json.loads(l)["step"] for l in f] == [1, 2, 3, 4]
    assert os.path.exists(os.path.join(again.run_dir, "previous-1", "metrics.jsonl"))
    # a replaced pod / Slurm requeue of the finished run (train.resume=auto): success, nothing run or moved
    before = sorted(os.listdir(again.run_dir))
    with open(os.path.join(again.run_dir, "metrics.jsonl")) as f:
        metrics = f.read()
    with open(os.path.join(again.run_dir, "status.json")) as f:
        finished = f.read()
    done = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=auto", name="same")
    ck = os.path.join(done.run_dir, "checkpoints", "step_000004")
    assert done.run_dir == again.run_dir and not done.error_lines(), done.tail()
    assert (f"already complete: checkpoint {ck} is at step 4 of train.steps=4 (train.resume=auto)"
            in done.flat_stdout), done.tail()
    assert "raise train.steps and set train.resume_mismatch=allow" in done.flat_stdout
    assert "card process(es)" not in done.stdout and not os.path.exists(os.path.join(done.run_dir, "previous-2"))
    assert sorted(os.listdir(done.run_dir)) == before  # nothing moved aside or added
    with open(os.path.join(done.run_dir, "metrics.jsonl")) as f:
        assert f.read() == metrics
    with open(os.path.join(done.run_dir, "status.json")) as f:  # the finishing launch's record is kept
        assert f.read() == finished
    # into a directory without one (a restarted Kubernetes pod gets a new run dir), its own status says so
    fresh = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=auto",
                          f"checkpoint.dir={os.path.join(done.run_dir, 'checkpoints')}", name="fresh")
    assert "already complete" in fresh.stdout and not fresh.error_lines(), fresh.tail()
    with open(os.path.join(fresh.run_dir, "status.json")) as f:
        st = json.load(f)
    assert st["exit_code"] == 0 and st["status"] == "ok" and st["already_complete"] is True, st
    assert st["step"] == 4 and st["steps"] == 4 and st["checkpoint"] == ck and "stopped_at" not in st, st
    # an explicit train.resume=latest asks to train on from it: refused, naming how to train further
    refused = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=latest", name="same", expect_rc=2)
    (err,) = refused.error_lines()
    assert f"checkpoint {ck} is at step 4 but train.steps=4: the run is complete" in err, err
    assert "raise train.steps and set train.resume_mismatch=allow" in err and "card process(es)" not in refused.stdout


def test_interrupt_while_a_resume_prepares_names_the_checkpoint(tiny_model, tmp_path):
    """Ctrl-C to a resume launch before it trained (review of 2026-12-03): status.json names the run's last
    complete checkpoint and the resume command (it had both null), as the failed-card path does. If the signal
    lands after the cards started, the launch saves on its own: either way a checkpoint and a command."""
    import json
    import signal

    from conftest import launch_to_end
    from launch_util import Job

    launch_to_end(tmp_path, tiny_model, "train.steps=400", "train.stop_after=2", name="int")
    job = Job(tmp_path, tiny_model, "train.steps=400", "train.resume=latest", name="int")
    try:
        job.wait_for(lambda: os.path.exists(job.out_path) and "predicted:" in open(job.out_path).read(), 90,
                     "the plan")
        os.kill(job.proc.pid, signal.SIGINT)
        rc = job.wait(120)
    finally:
        job.kill_all()
    assert rc == 130, job.tail()
    with open(os.path.join(job.run_dir, "status.json")) as f:
        st = json.load(f)
    assert st["status"] == "interrupted" and st["checkpoint"], st
    assert os.path.basename(st["checkpoint"]).startswith("step_") and "train.resume=latest" in st["resume"], st
    assert os.path.isfile(os.path.join(st["checkpoint"], "manifest.json")), st  # a complete one


def test_a_resume_into_a_new_run_dir_marks_the_launch_it_continued(tiny_model, tmp_path):
    """The recorded resume command run with another hydra.run.dir (the default: a new timestamped directory):
    once it completes, the first launch's ``status.json`` says ``resumed`` and where (``resumed_in``), keeping
    its own fields (``status_before``, ``stopped_at``, ``resume``); the new launch's ``summary.json`` names the
    checkpoint it continued from. Without the mark the first directory said it was unfinished forever."""
    import json
    import shlex

    from conftest import launch_to_end
    from launch_util import Job

    first = launch_to_end(tmp_path, tiny_model, "train.steps=3", "train.stop_after=1", name="a")
    with open(os.path.join(first.run_dir, "status.json")) as f:
        before = json.load(f)
    argv = [a for a in shlex.split(before["resume"]) if not a.startswith("hydra.run.dir=")]
    again = Job(tmp_path, tiny_model, name="b", argv=argv)
    assert again.finish(240) == 0, again.tail()
    ck = os.path.join(first.run_dir, "checkpoints", "step_000001")
    with open(os.path.join(again.run_dir, "summary.json")) as f:
        summ = json.load(f)
    assert summ["resumed_from"] == ck and summ["resumed_at_step"] == 1, summ
    assert summ["earlier_run_dir"] == first.run_dir, summ
    with open(os.path.join(first.run_dir, "status.json")) as f:
        after = json.load(f)
    assert after["status"] == "resumed" and after["status_before"] == "ok", after
    assert after["resumed_in"] == again.run_dir and after["resumed_from"] == ck and after["resumed_at_step"] == 1
    assert {k: v for k, v in after.items() if k in before and k != "status"} == {
        k: v for k, v in before.items() if k != "status"}  # nothing else rewritten
    assert f"note: {os.path.join(first.run_dir, 'status.json')} now says status resumed" in again.flat_stdout
    with open(os.path.join(again.run_dir, "status.json")) as f:
        assert json.load(f)["status"] == "ok"


def test_an_interrupted_resume_from_another_run_dir_still_marks_the_first(tiny_model, tmp_path):
    """Issue 40, fresh-clone review: the first launch interrupted at step 1, then ``train.resume=latest
    checkpoint.dir=<first run>/checkpoints`` from a new run dir, itself interrupted after a step: the first
    launch's ``status.json`` said ``interrupted`` at step 1 (only a resume that completed marked it), though
    its checkpoints had moved on under another launch. It now says ``resumed`` and where, as a resume that
    completes does, and the second launch's own status says where it stands."""
    import json
    import signal

    from launch_util import Job

    def interrupted_after_a_step(job: Job, lines: int = 1) -> Job:
        try:
            job.wait_steps(lines, 180)
            os.killpg(job.proc.pid, signal.SIGINT)
            assert job.wait(120) == 130, job.tail()
        finally:
            job.kill_all()
        return job

    first = interrupted_after_a_step(Job(tmp_path, tiny_model, "train.steps=6", name="a"))
    with open(os.path.join(first.run_dir, "status.json")) as f:
        before = json.load(f)
    assert before["status"] == "interrupted" and before["checkpoint"], before
    k = int(os.path.basename(before["checkpoint"]).split("_")[-1])  # its metrics.jsonl starts with the k steps
    again = interrupted_after_a_step(Job(tmp_path, tiny_model, "train.steps=6", "train.resume=latest",  # of a
                                         f"checkpoint.dir={os.path.join(first.run_dir, 'checkpoints')}", name="b"),
                                     k + 1)
    with open(os.path.join(first.run_dir, "status.json")) as f:
        after = json.load(f)
    assert after["status"] == "resumed" and after["status_before"] == "interrupted", after
    assert after["resumed_in"] == again.run_dir and after["resumed_from"] == before["checkpoint"], after
    assert {k: v for k, v in after.items() if k in before and k != "status"} == {
        k: v for k, v in before.items() if k != "status"}  # nothing else rewritten
    with open(os.path.join(again.run_dir, "status.json")) as f:
        mine = json.load(f)
    assert mine["status"] == "interrupted" and mine["resume"], mine
    assert f"note: {os.path.join(first.run_dir, 'status.json')} now says status resumed" in again.flat_stdout


@pytest.mark.timeout(600)
def test_resumed_auto_schedule_keeps_the_recomputed_layers(tiny_model, tmp_path):
    """A launch that recomputes only some layers per card (what ``train.schedule=auto`` plans as the fewest that
    fit, issue 43 (b)/(c)), resumed with ``train.schedule=auto``: the resume keeps the checkpoint's schedule and
    the same count per card, so the same plan (it used to recompute every layer: another plan than the one the
    first launch was measured against)."""
    import json

    ck = f"checkpoint.dir={tmp_path / 'ckpt'}"
    some = ("backend=[cpu,cpu]", "train.schedule=1f1b", "train.recompute=true", "train.recompute_layers=[1,0]")
    _, r1 = run_pipeline(tiny_model, str(tmp_path / "a"), *some, ck, "train.steps=2", "train.stop_after=1")
    assert r1.manifest["recompute_layers"] == [1, 0]
    _, r2 = run_pipeline(tiny_model, str(tmp_path / "b"), "backend=[cpu,cpu]", ck, "train.schedule=auto",
                         "train.steps=2", "train.resume=latest")
    with open(tmp_path / "b" / "plan.json") as f:
        plan = json.load(f)
    assert plan["shape"]["schedule"] == "1f1b" and plan["shape"]["recompute"] is True
    assert [st.get("recompute_layers") for st in plan["stages"]] == [1, 0]
    assert r2.step == 2


def test_resume_into_another_run_dir_carries_the_whole_runs_records(tiny_model, tmp_path):
    """A launch resumed without the first one's hydra.run.dir (the default ``outputs/<date>/<time>`` of a new
    launch) writes its own run dir; its metrics.jsonl / eval.jsonl start with the saving launch's records up to
    the resumed step, so they and loss.png cover the whole run (a fresh-clone review saw a resumed run's records
    start at the resumed step in a new folder, issue 40). The first run dir is only read."""
    import json

    from conftest import launch_to_end

    first = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.stop_after=2", name="a")
    with open(os.path.join(first.run_dir, "metrics.jsonl")) as f:
        before = f.read()
    root = os.path.join(first.run_dir, "checkpoints")
    again = launch_to_end(tmp_path, tiny_model, "train.steps=4", "train.resume=latest", f"checkpoint.dir={root}",
                          name="b")
    assert again.run_dir != first.run_dir
    assert f"continue with the steps up to 2 of {first.run_dir}" in again.flat_stdout, again.tail()
    with open(os.path.join(again.run_dir, "metrics.jsonl")) as f:
        got = [json.loads(l) for l in f]
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert "".join(json.dumps(m) + "\n" for m in got[:2]) == "".join(json.dumps(json.loads(l)) + "\n"
                                                                     for l in before.splitlines())
    with open(os.path.join(first.run_dir, "metrics.jsonl")) as f:
        assert f.read() == before  # not touched
    assert "(avg since resume" not in again.stdout  # the average goes on from the carried steps
