"""Hydra multirun sweeps (``launch/run.py -m``): concurrent jobs, a failing job, the summary.

Fast checks: the concurrency rule (cores, RAM, shared cards) on synthetic job needs, the sweep
expansion of card lists, and the summary of a hand-made sweep directory. Heavy checks run the
real launcher as a subprocess on the tiny test model (launch_util's settings):

- two concurrent one-card jobs, one with a missing ``data.source``: the other finishes, the
  summary names one ok and one failed job, the launcher exits 1, no shm segment is left;
- ``backend=cpu,cpu`` next to a swept key: two jobs with two cards each, own ids and run dirs.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from launch_util import BASE, LAUNCH, REPO
from npu_train.errors import one_refusal
from npu_train.metrics import sweep
from npu_train.metrics.sweep import JobNeeds, SweepError, check_concurrency

GIB = 2 ** 30


# ============================================================================ fast
def test_concurrency_auto_fits_cores_ram_and_cards():
    one = JobNeeds(card_procs=1, host_bytes=2 * GIB)
    two = JobNeeds(card_procs=2, host_bytes=2 * GIB)
    assert check_concurrency([one] * 4, -1, cores=2, ram_bytes=100 * GIB) == 2  # 2 cores / 1 card
    assert check_concurrency([two] * 4, -1, cores=8, ram_bytes=100 * GIB) == 4  # 8 // 2 = 4 = jobs
    assert check_concurrency([two] * 4, -1, cores=8, ram_bytes=5 * GIB) == 2  # 5 GiB // 2 GiB
    assert check_concurrency([one, None], -1, cores=16, ram_bytes=100 * GIB) == 2  # invalid job: fails alone
    acc = [JobNeeds(2, ["furiosa:0", "furiosa:1"]), JobNeeds(2, ["furiosa:0", "furiosa:1"])]
    assert check_concurrency(acc, -1, cores=64, ram_bytes=100 * GIB) == 1  # same cards: one at a time
    own = [JobNeeds(1, ["furiosa:0"]), JobNeeds(1, ["furiosa:1"])]
    assert check_concurrency(own, -1, cores=64, ram_bytes=100 * GIB) == 2
    assert check_concurrency(own, 1, cores=1, ram_bytes=0) == 1


def test_concurrency_explicit_n_jobs_rejected_with_the_fix():
    acc = [JobNeeds(1, ["furiosa:0"]), JobNeeds(1, ["furiosa:0"])]
    with pytest.raises(SweepError, match=r"both use card furiosa:0.*hydra.launcher.n_jobs=1"):
        check_concurrency(acc, 2, cores=64, ram_bytes=100 * GIB)
    with pytest.raises(SweepError, match=r"2 jobs x 2 card process\(es\) need 4 cores, the host has 2; "
                                         r"use hydra.launcher.n_jobs=1"):
        check_concurrency([JobNeeds(2)] * 2, 2, cores=2, ram_bytes=100 * GIB)
    with pytest.raises(SweepError, match=r"3 jobs x 4.00 GiB host RAM exceed the 9.00 GiB available; "
                                         r"use hydra.launcher.n_jobs=2"):
        check_concurrency([JobNeeds(1, host_bytes=4 * GIB)] * 3, 3, cores=64, ram_bytes=9 * GIB)
    assert check_concurrency([JobNeeds(1)] * 3, 2, cores=2, ram_bytes=GIB) == 2


def test_job_threads_split_the_cores_between_concurrent_jobs():
    assert sweep.job_threads(["cpu"], 2, cores=2) == 1  # 2 one-card jobs on 2 cores
    assert sweep.job_threads(["cpu", "cpu"], 2, cores=16) == 4
    assert sweep.job_threads("cpu", 3, cores=16) == 5
    assert sweep.job_threads(["cpu", "furiosa:0"], 2, cores=16) == 8  # cpu cards only
    assert sweep.job_threads(["cpu", "cpu"], 4, cores=2) == 1  # never 0
    assert sweep.job_threads(["cpu"], 1, cores=16) is None  # alone: the job's own rule


def _compose_sweep(*overrides):
    """The master config of ``launch/run.py -m <overrides>`` and Hydra's config loader."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from npu_train.config import register

    register()
    ctx = initialize_config_dir(config_dir=os.path.join(REPO, "conf"), version_base=None)
    ctx.__enter__()
    loader = GlobalHydra.instance().config_loader()
    return ctx, loader, loader.load_configuration("config", list(overrides), run_mode=RunMode.MULTIRUN)


@pytest.mark.parametrize("given", [[], ["hydra.launcher.n_jobs=-1"], ["hydra.launcher.n_jobs=5"]])
def test_every_job_sees_the_concurrency_the_sweep_worked_out(monkeypatch, capsys, given):
    """n_jobs=-1 (auto) or more than there are jobs: the callback's figure reaches every job's
    config (Hydra composes each job anew from the overrides), so the job divides the cores by it."""
    monkeypatch.setattr(sweep, "needs_hook", lambda cfg: JobNeeds(card_procs=1))
    monkeypatch.setattr(sweep, "host_cores", lambda: 2)
    monkeypatch.setattr(sweep, "host_available_ram", lambda: 64 * GIB)
    ctx, loader, cfg = _compose_sweep("backend=[cpu]", "train.lr=1e-4,3e-4", *given)
    try:
        sweep.SweepCallback().on_multirun_start(cfg)
        # the seconds of planning every job are announced first (5-6 s without a line before the sweep's first)
        assert capsys.readouterr().out.splitlines() == [
            "sweep: 2 job(s): planning each to see how many can run at a time ...", "sweep: 2 job(s), 2 at a time"]
        for job in sweep.sweep_job_overrides(list(cfg.hydra.overrides.task)):
            assert loader.load_sweep_config(cfg, job).hydra.launcher.n_jobs == 2
        assert [o for o in cfg.hydra.overrides.hydra if "n_jobs" in o] == ["hydra.launcher.n_jobs=2"]
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.parametrize("given,jobs", [(["hydra.launcher.n_jobs=1"], 2), ([], 1)])
def test_a_sweep_one_job_at_a_time_says_so_too(capsys, given, jobs):
    """``sweep: N job(s), K at a time`` was missing when the sweep ran one job at a time (n_jobs=1, or one job)."""
    ctx, _, cfg = _compose_sweep("backend=[cpu]", "train.lr=1e-4,3e-4" if jobs == 2 else "train.lr=1e-4", *given)
    try:
        sweep.SweepCallback().on_multirun_start(cfg)
        assert f"sweep: {jobs} job(s), 1 at a time" in capsys.readouterr().out
    finally:
        ctx.__exit__(None, None, None)


def _load_run():
    from scripts import load_script

    return load_script(LAUNCH, "npt_run_script")


def test_card_lists_in_a_sweep_expand_as_documented():
    run = _load_run()
    argv = run.rewrite_backend_args(["backend=cpu,cpu", "train.lr=1e-3,2e-3"])
    assert sweep.sweep_job_overrides(argv) == [["backend=[cpu,cpu]", "train.lr=0.001"],
                                               ["backend=[cpu,cpu]", "train.lr=0.002"]]
    argv = run.rewrite_backend_args(["backend=choice([cpu],[cpu,cpu])"])
    assert sweep.sweep_job_overrides(argv) == [["backend=[cpu]"], ["backend=[cpu,cpu]"]]


def _fake_job(d, num, overrides, code, losses=(), error="", summary=None, status=None):
    os.makedirs(os.path.join(d, ".hydra"))
    with open(os.path.join(d, ".hydra", "overrides.yaml"), "w") as f:
        f.write("".join(f"- {o}\n" for o in overrides))
    with open(os.path.join(d, ".hydra", "hydra.yaml"), "w") as f:
        f.write(f"hydra:\n  job:\n    num: {num}\n")
    if code is not None:
        with open(os.path.join(d, "status.json"), "w") as f:
            json.dump(dict({"exit_code": code, "error": error}, **(status or {})), f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for i, l in enumerate(losses):
            f.write(json.dumps({"step": i + 1, "loss": l, "tokens_per_s": 100.0 * (i + 1),
                                "mem_peak_bytes": [GIB, GIB // 2]}) + "\n")
    if summary:
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump(summary, f)


def test_summary_of_a_sweep_dir(tmp_path):
    sd = str(tmp_path)
    _fake_job(os.path.join(sd, "0"), 0, ["model.path=m", "train.lr=0.001"], 0, [5.0, 4.0],
              summary={"last_loss": 4.0, "last_val_loss": 4.5, "mean_tokens_per_s": 200.0,
                       "peak_mem_bytes": [GIB, GIB // 2]})
    _fake_job(os.path.join(sd, "1"), 1, ["model.path=m", "train.lr=0.002"], 1, [5.0],
              error="error: card cpu:1 (stage 1, layers 3-5 +head) failed during step 2: process killed by signal SIGKILL")
    _fake_job(os.path.join(sd, "2"), 2, ["model.path=m", "train.lr=0.003"], None)  # died without a status
    rows = sweep.collect(sd)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed"]
    md = sweep.write_summary(sd, rows)
    assert md.startswith("# Sweep summary: 1 ok, 2 failed")
    with open(os.path.join(sd, "summary.csv")) as f:
        table = list(csv.reader(f))
    assert table[0] == sweep.HEADER
    # jobs counted from 1, as the "sweep job i/n:" lines count them; Hydra's directories from 0, and said so
    assert table[1] == ["1", "train.lr=0.001", "4.0000", "4.5000", "200", "1.00/0.50", "ok", ""]
    assert table[2][:3] == ["2", "train.lr=0.002", "5.0000"] and table[2][6] == "failed"
    assert sweep.job_dirs_note(sd, rows) == f"job k's directory: {sd}/<k-1> (Hydra numbers its job directories from 0)"
    assert table[2][7] == "card cpu:1 (stage 1, layers 3-5 +head) failed during step 2: process killed by signal SIGKILL"
    assert table[3][6] == "failed" and "no status.json" in table[3][7]
    assert os.path.getsize(os.path.join(sd, "loss_curves.png")) > 0
    assert sweep.exit_status(rows) == 1 and sweep.exit_status(rows[:1]) == 0
    rows[1]["exit_code"] = 143
    assert sweep.exit_status(rows) == 143
    _fake_job(os.path.join(sd, "3"), 3, ["model.path=m", "train.lr=0.004"], 143, [5.0],
              error="interrupted by SIGTERM: all card processes stopped")
    rows = sweep.collect(sd)
    assert [r["status"] for r in rows] == ["ok", "failed", "failed", "interrupted"]
    assert sweep.write_summary(sd, rows).startswith("# Sweep summary: 1 ok, 1 interrupted, 2 failed")
    assert sweep.exit_status(rows) == 143


def test_console_summary_fits_100_columns_and_the_file_keeps_every_override(tmp_path):
    """A one-job sweep on a model under a long path: the console's summary has no line over 100 columns and
    still names every override and the error (folded at words); summary.md keeps the full table (a file)."""
    sd = str(tmp_path)
    path = "model.path=/tmp/" + "d" * 40 + "/qwen3"
    _fake_job(os.path.join(sd, "0"), 0, [path, "train.steps=2", "train.lr=0.0001"], 1, [6.945],
              error="error: card cpu:0 (stage 0, layers 0-1 +head) failed during step 2: process killed by signal "
                    "SIGKILL")
    rows = sweep.collect(sd)
    md = sweep.write_summary(sd, rows)
    assert max(len(ln) for ln in md.splitlines()) > 100  # the file's table as it was
    text = sweep.console_summary(md, rows)
    assert max(len(ln) for ln in text.splitlines()) <= 100
    assert text.startswith("# Sweep summary: 0 ok, 1 failed")
    joined = " ".join(ln.strip() for ln in text.splitlines())
    assert f"{path} train.steps=2 train.lr=1e-4" in joined and "process killed by signal SIGKILL" in joined
    assert "| 1 | 6.9450 |" in text and "job 1: model.path=" in text


def test_summary_names_a_job_stop_after_ended(tmp_path):
    """A job that train.stop_after ended before train.steps exits 0 but is not done: status "stopped", the
    error column says where it stands and where its resume command is; the sweep still exits 0."""
    sd = str(tmp_path)
    _fake_job(os.path.join(sd, "0"), 0, ["train.lr=0.001"], 0, [5.0, 4.0])
    _fake_job(os.path.join(sd, "1"), 1, ["train.lr=0.002"], 0, [5.0, 4.5],
              status={"stopped_at": 2, "steps": 20, "resume": "python launch/run.py train.resume=latest ..."})
    rows = sweep.collect(sd)
    assert [r["status"] for r in rows] == ["ok", "stopped"]
    assert rows[1]["error"] == "stopped at step 2 of 20 (train.stop_after); resume: 'resume' in status.json"
    assert sweep.write_summary(sd, rows).startswith("# Sweep summary: 1 ok, 1 stopped (train.stop_after), 0 failed")
    assert sweep.exit_status(rows) == 0


def test_each_job_begins_with_its_number_and_swept_overrides(tmp_path):
    """A sweep's jobs print one after another (or at once): each begins with a line naming it, its number out
    of the sweep's jobs and the overrides that differ between them (the plan=true shared by both left out)."""
    from omegaconf import OmegaConf

    OmegaConf.save({"hydra": {"overrides": {"task": ["plan=true", "train.lr=1e-4,3e-4"]}}}, tmp_path / "multirun.yaml")
    assert sweep.job_header(str(tmp_path), 0, ["plan=true", "train.lr=1e-4"]) == "sweep job 1/2: train.lr=1e-4"
    assert sweep.job_header(str(tmp_path), 1, ["plan=true", "train.lr=3e-4"]) == "sweep job 2/2: train.lr=3e-4"
    # no record of the sweep: the job's own overrides, no count
    assert sweep.job_header(str(tmp_path / "gone"), 1, ["train.lr=3e-4"]) == "sweep job 2: train.lr=3e-4"


def test_concurrent_jobs_tag_every_console_line_within_the_width(tmp_path):
    """Jobs at a time share one console: each job's lines begin ``[job i/n] `` (1-based, as its ``sweep job
    i/n:`` line), on the console only (its run.log is its own), and the job folds its text that much narrower,
    so a tag and a line fit the console; one job at a time, or a one-job sweep, gets no tag."""
    import io

    from omegaconf import OmegaConf

    from npu_train.errors import console_columns, reserve_console_columns

    OmegaConf.save({"hydra": {"overrides": {"task": ["train.lr=1e-4,3e-4"]}}}, tmp_path / "multirun.yaml")
    assert sweep.job_tag(str(tmp_path), 1, 2) == "[job 2/2] "
    assert sweep.job_tag(str(tmp_path), 1, 1) == "" and sweep.job_tag(str(tmp_path / "gone"), 1, 2) == ""
    OmegaConf.save({"hydra": {"overrides": {"task": ["train.lr=1e-4"]}}}, tmp_path / "multirun.yaml")
    assert sweep.job_tag(str(tmp_path), 0, 2) == ""
    run = _load_run()
    console, log = io.StringIO(), io.StringIO()
    reserve_console_columns(len("[job 2/2] "))
    try:
        assert console_columns(console) == 100 - len("[job 2/2] ")
        tee = run._LogTee(console, log, fold=True, tag="[job 2/2] ")
        words = " ".join(f"word{i}" for i in range(40))
        tee.write("step 4/4 | loss 10.4826\ndone: " + words + "\npart")
        tee.write("ial line")
        tee.flush()
    finally:
        reserve_console_columns(0)
    assert console_columns(console) == 100
    lines = console.getvalue().split("\n")
    assert lines[0] == "[job 2/2] step 4/4 | loss 10.4826" and lines[-1] == "[job 2/2] partial line", lines
    assert all(ln.startswith("[job 2/2] ") and len(ln) <= 100 for ln in lines), lines
    assert " ".join(ln[len("[job 2/2] "):].strip() for ln in lines[1:-1]) == "done: " + words
    assert "[job" not in log.getvalue() and log.getvalue().startswith("step 4/4 | loss 10.4826\ndone: ")


# ============================================================================ heavy (real launcher)
def _run_sweep(tmp_path, model, *overrides, timeout=600):
    sweep_dir = os.path.join(str(tmp_path), "sweep")
    cmd = [sys.executable, LAUNCH, "-m", f"model.path={model}", *BASE, "train.steps=3",
           *overrides, f"hydra.sweep.dir={sweep_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "NPT_FAULT"}
    before = {f for f in os.listdir("/dev/shm") if f.startswith("npt_")}
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    after = {f for f in os.listdir("/dev/shm") if f.startswith("npt_")}
    # only this sweep's jobs count (other jobs on the machine may create segments meanwhile)
    ids = set()
    for root, _, files in os.walk(sweep_dir):
        if "job.json" in files:
            with open(os.path.join(root, "job.json")) as f:
                ids.add(json.load(f)["job_id"])
    return p, sweep_dir, {f for f in after - before if any(f.startswith(f"npt_{i}_") for i in ids)}


def _jobs(sweep_dir):
    out = {}
    for n in sorted(os.listdir(sweep_dir)):
        d = os.path.join(sweep_dir, n)
        if n.isdigit():
            with open(os.path.join(d, "status.json")) as f:
                st = json.load(f)
            info = None
            if os.path.exists(os.path.join(d, "job.json")):
                with open(os.path.join(d, "job.json")) as f:
                    info = json.load(f)
            out[int(n)] = (st, info)
    return out


@pytest.mark.heavy
def test_concurrent_sweep_with_a_failing_job(tmp_path, tiny_model):
    if sweep.host_cores() < 2:
        pytest.skip("two concurrent one-card jobs need 2 cores")
    missing = os.path.join(str(tmp_path), "no-such-corpus.txt")
    p, sd, leaked = _run_sweep(tmp_path, tiny_model, "backend=cpu", f"data.source=botchan,{missing}",
                               "hydra.launcher.n_jobs=2")
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-4000:]  # rule: a sweep with a failed job exits 1
    assert "sweep: 2 job(s), 2 at a time" in p.stdout
    jobs = _jobs(sd)
    (ok_st, ok_info), (bad_st, bad_info) = jobs[0], jobs[1]
    assert ok_st["exit_code"] == 0 and bad_st["exit_code"] == 2 and bad_info is None
    assert "no-such-corpus.txt" in bad_st["error"]
    # ran at the same time, in two worker processes: the intervals overlap
    assert ok_st["pid"] != bad_st["pid"]
    assert bad_st["started"] < ok_st["finished"] and ok_st["started"] < bad_st["finished"]
    with open(os.path.join(sd, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["status"]) for r in rows] == [("1", "ok"), ("2", "failed")]
    assert rows[0]["overrides"] == "data.source=botchan" and float(rows[0]["train loss"]) > 0
    assert float(rows[0]["val loss"]) > 0 and float(rows[0]["tokens/s"]) > 0 and rows[0]["peak mem GiB per card"]
    assert "no-such-corpus.txt" in rows[1]["error"] and rows[1]["train loss"] == "n/a"
    with open(os.path.join(sd, "summary.md")) as f:
        assert f.read().startswith("# Sweep summary: 1 ok, 1 failed")
    assert os.path.getsize(os.path.join(sd, "loss_curves.png")) > 0
    # the table is printed too; where a row would pass 100 columns, each job's overrides under it
    assert "| 1 | data.source=" in p.stdout or ("\n| 1 | " in p.stdout and "job 1: data.source=" in p.stdout)
    assert not leaked, leaked
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(ok_info["shm_prefix"])]


@pytest.mark.heavy
def test_two_concurrent_jobs_say_whose_each_line_is(tmp_path, tiny_model):
    """Two jobs at a time printed two ``step 3/3 | loss ...`` and two ``done:`` lines with nothing saying whose:
    every line of a job begins ``[job i/2] ``, each job's step and done lines are there once, within 100
    columns, and its run.log has its lines untagged."""
    if sweep.host_cores() < 2:
        pytest.skip("two concurrent one-card jobs need 2 cores")
    p, sd, leaked = _run_sweep(tmp_path, tiny_model, "backend=cpu", "train.lr=1e-3,2e-3", "hydra.launcher.n_jobs=2")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "sweep: 2 job(s), 2 at a time" in p.stdout
    for i in (1, 2):
        assert len(re.findall(rf"^\[job {i}/2\] sweep job {i}/2: train\.lr=", p.stdout, flags=re.M)) == 1, out[-4000:]
        assert len(re.findall(rf"^\[job {i}/2\] step 3/3 \| loss ", p.stdout, flags=re.M)) == 1, out[-4000:]
        assert len(re.findall(rf"^\[job {i}/2\] done: ", p.stdout, flags=re.M)) == 1, out[-4000:]
    assert not re.search(r"^(step \d|done: )", p.stdout, flags=re.M), out[-4000:]
    # a word wider than a line (a long path) or a ``label: <path>`` line stays whole (report.fold_long_line)
    wide = [ln for ln in p.stdout.splitlines()
            if len(ln) > 100 and not re.match(r"(\[job \d/2\] )?\s*([\w .-]+: )?\S+$", ln)]
    assert not wide, wide
    for n in ("0", "1"):
        with open(os.path.join(sd, n, "run.log")) as f:
            text = f.read()
        assert "[job " not in text and re.search(r"^step 3/3 \| loss ", text, flags=re.M), text[-2000:]
    assert not leaked, leaked


@pytest.mark.heavy
def test_sweep_keeps_card_lists_as_one_job(tmp_path, tiny_model):
    """``backend=cpu,cpu`` with ``-m`` next to a swept key: two jobs of two cards each."""
    p, sd, leaked = _run_sweep(tmp_path, tiny_model, "backend=cpu,cpu", "train.lr=1e-3,2e-3")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    jobs = _jobs(sd)
    assert sorted(jobs) == [0, 1]
    infos = [jobs[i][1] for i in (0, 1)]
    assert [len(i["cards"]) for i in infos] == [2, 2]
    for key in ("job_id", "run_dir", "ipc_dir", "shm_prefix", "ckpt_root"):
        assert infos[0][key] != infos[1][key], key
    with open(os.path.join(sd, "summary.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert [r["overrides"] for r in rows] == ["train.lr=0.001", "train.lr=0.002"]
    assert all(len(r["peak mem GiB per card"].split("/")) == 2 for r in rows)
    assert not leaked, leaked
    # a readable console: no raw joblib line, each job's plan in one line (the table in its plan.txt)
    assert "Joblib.Parallel" not in p.stdout + p.stderr
    unfolded = p.stdout.replace("\n  ", " ")  # lines are folded at 100 columns, continuations indented by 2
    assert len(re.findall(r"^plan: split \[\d+, \d+\], .* GiB per card, step [\d.]+ m?s, fits \(table: .*plan\.txt\)$",
                          unfolded, flags=re.M)) == 2, p.stdout[-4000:]
    header = re.compile(r"compute +recomp +bubble +host-opt")  # the time table's header, whatever its column gap
    assert "weights\nGiB" not in p.stdout and not header.search(p.stdout)
    for i in (0, 1):
        assert header.search(open(os.path.join(sd, str(i), "plan.txt")).read())
    # each plan line once per job (the concurrency check's planning printed each job's schedule line too), and
    # each job says what its cards do before its first step, as a single run does (20-28 s of silence)
    assert len(re.findall(r"^train\.schedule=auto: ", unfolded, flags=re.M)) == 2, p.stdout[-4000:]
    for job in unfolded.split("npu-train: training")[1:]:
        assert re.search(r"^start-up: model load \(card \d, \d+ s\)$", job, flags=re.M), job


@pytest.mark.heavy
def test_auto_concurrency_splits_the_cores_between_jobs(tmp_path, tiny_model):
    """``hydra.launcher.n_jobs=-1`` (auto) with ``runtime.threads`` unset: each job gets
    cores // (jobs at a time x cpu cards) torch threads per card process, from the concurrency the
    sweep worked out (not the whole host per job: 2 jobs x 2 threads on 2 cores ran 4x slower)."""
    if sweep.host_cores() < 2:
        pytest.skip("two concurrent one-card jobs need 2 cores")
    p, sd, leaked = _run_sweep(tmp_path, tiny_model, "backend=cpu", "train.lr=1e-3,2e-3", "runtime.threads=null")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    m = re.search(r"^sweep: 2 job\(s\), (\d+) at a time$", p.stdout, flags=re.M)
    assert m, p.stdout[-4000:]
    want = max(1, sweep.host_cores() // int(m.group(1)))  # one cpu card per job
    for n in (0, 1):  # a sweep job's plan table (with its threads line) is in its plan.txt, not the console
        with open(os.path.join(sd, str(n), "plan.txt")) as f:
            log = f.read()
        got = re.findall(r"^threads: (\d+) torch thread\(s\) per card process", log, flags=re.M)
        assert got == [str(want)], (n, m.group(0), log[-3000:])
    assert not leaked, leaked


def test_sweep_sharing_a_card_is_rejected_before_any_job(tmp_path, tiny_model):
    """n_jobs=2 with both jobs on furiosa:0: one error line naming the fix, exit 2, no job dir.
    (The check plans without touching a device, so it runs on any host.)"""
    sd = os.path.join(str(tmp_path), "sweep")
    p = subprocess.run([sys.executable, LAUNCH, "-m", f"model.path={tiny_model}", "backend=furiosa:0",
                        "train.lr=1e-3,2e-3", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sd}"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [one_refusal(p.stderr)]
    assert errors == ["error: hydra.launcher.n_jobs=2: jobs 1 and 2 of the sweep both use card furiosa:0, and a "
                      "card cannot be shared by two concurrent jobs; use hydra.launcher.n_jobs=1, or give each job "
                      "its own cards (explicit indices, e.g. backend=furiosa:0 / backend=furiosa:1)"], p.stderr
    assert not os.path.exists(sd) or not [n for n in os.listdir(sd) if n.isdigit()]


@pytest.mark.parametrize("swept,modes", [(["train.mode=full,lora", "lora.rank=16"], "full,lora"),
                                          (["train.lr=1e-4,3e-4", "lora.rank=16"], None),
                                          (["train.mode=lora", "train.lr=1e-4,3e-4"], None)])
def test_a_sweep_over_modes_tells_its_jobs(monkeypatch, capsys, tmp_path, swept, modes):
    """Issue 40: ``-m train.mode=full,lora lora.rank=16`` refused its full job (the lora.* check compares with
    the defaults). A job reads the sweep's modes from the sweep's own ``multirun.yaml`` (written by Hydra's
    sweeper before any job; the job's config holds only its own overrides), which name modes only when the jobs
    differ in train.mode; the full job's config then drops lora.* with one note, while a sweep that is not over
    modes (``train.lr=...`` with ``lora.rank=16``, train.mode=full) keeps refusing its jobs. No environment
    variable carries them (``NPT_SWEEP_MODES`` did; a stale value is ignored)."""
    from omegaconf import OmegaConf

    from npu_train.config import lora_for_a_mode_sweep, validate
    from npu_train.errors import ConfigError

    monkeypatch.setenv("NPT_SWEEP_MODES", "full,lora")  # the old channel's stale value: no longer read
    monkeypatch.setattr(sweep, "needs_hook", lambda cfg: validate(cfg) or JobNeeds(card_procs=1))
    monkeypatch.setattr(sweep, "host_cores", lambda: 2)
    monkeypatch.setattr(sweep, "host_available_ram", lambda: 64 * GIB)
    ctx, loader, cfg = _compose_sweep("backend=[cpu]", f"hydra.sweep.dir={tmp_path}", *swept)
    try:
        sweep.SweepCallback().on_multirun_start(cfg)
        OmegaConf.save(cfg, tmp_path / "multirun.yaml")  # as Hydra's BasicSweeper.sweep does before the jobs
        assert sweep.modes_of_this_sweep(str(tmp_path)) == (modes or "")
        for job in sweep.sweep_job_overrides(list(cfg.hydra.overrides.task)):
            full = loader.load_sweep_config(cfg, job)
            sweep_dir = str(full.hydra.sweep.dir)  # the job's sweep dir is the sweep's
            job_cfg = sweep._job_config(full)
            note = lora_for_a_mode_sweep(job_cfg, sweep.modes_of_this_sweep(sweep_dir))
            if job_cfg.train.mode == "full" and modes:
                assert note == ("note: train.mode=full in a sweep over train.mode: ignoring lora.rank=16 for this "
                                "job (its train.mode=lora jobs use them)")
                assert job_cfg.lora.rank == 8
                validate(job_cfg)
            elif job_cfg.train.mode == "full":  # not a sweep over modes: still refused as a single launch is
                assert note is None
                with pytest.raises(ConfigError, match=r"lora\.rank=16 set, but train\.mode=full"):
                    validate(job_cfg)
            else:
                assert note is None and job_cfg.lora.rank == (16 if "lora.rank=16" in swept else 8)
    finally:
        ctx.__exit__(None, None, None)


@pytest.mark.heavy
def test_a_sweep_over_modes_runs_its_full_job(tmp_path, tiny_model):
    """The sweep of the fresh-clone review, tiny: its full job runs (the lora.* ignored, one note), its LoRA job
    uses lora.rank=16."""
    p, sd, leaked = _run_sweep(tmp_path, tiny_model, "backend=cpu", "train.mode=full,lora", "lora.rank=16",
                               "train.steps=1", "hydra.launcher.n_jobs=1")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    jobs = _jobs(sd)
    assert [jobs[i][0]["status"] for i in (0, 1)] == ["ok", "ok"], out[-4000:]
    assert out.count("ignoring lora.rank=16 for this job") == 1, out[-4000:]
    assert "sweep job 1/2: train.mode=full\n" in p.stdout and "sweep job 2/2: train.mode=lora\n" in p.stdout, out[-4000:]
    assert not leaked, leaked


def test_the_job_dirs_note_names_each_directory_of_another_subdir(tmp_path):
    """With ``hydra.sweep.subdir`` other than the job number, the note names each job's directory."""
    sd = str(tmp_path)
    _fake_job(os.path.join(sd, "lr-a"), 0, ["train.lr=0.001"], 0, [5.0])
    _fake_job(os.path.join(sd, "lr-b"), 1, ["train.lr=0.002"], 0, [5.0])
    rows = sweep.collect(sd)
    assert sweep.job_dirs_note(sd, rows) == f"job directories: job 1 in {sd}/lr-a, job 2 in {sd}/lr-b"
    assert sweep.job_dirs_note(sd, []) == ""


def test_a_sweep_that_trained_no_step_draws_no_loss_curves(tmp_path):
    """A plan-only sweep (``-m plan=true ...``) trains nothing: no empty ``loss_curves.png``, and the console's
    summary line does not name one (issue 40); a sweep with a step draws it and names it."""
    sd = str(tmp_path)
    for n in (0, 1):
        _fake_job(os.path.join(sd, str(n)), n, ["plan=true", f"train.lr={n + 1}e-4"], 0, [])
    rows = sweep.collect(sd)
    sweep.write_summary(sd, rows)
    assert os.path.isfile(os.path.join(sd, "summary.md")) and not os.path.exists(os.path.join(sd, "loss_curves.png"))
    assert sweep.summary_files_line(sd, rows) == f"summary: {sd}/summary.md (and summary.csv)"
    _fake_job(os.path.join(sd, "2"), 2, ["train.lr=3e-4"], 0, [5.0])
    rows = sweep.collect(sd)
    sweep.write_summary(sd, rows)
    assert os.path.getsize(os.path.join(sd, "loss_curves.png")) > 0
    assert sweep.summary_files_line(sd, rows).endswith("(and summary.csv, loss_curves.png)")


def test_the_sweep_prints_a_learning_rate_as_written(tmp_path):
    """``-m train.lr=1e-4,3e-5``: Hydra hands the jobs ``train.lr=0.0001`` and ``train.lr=3e-05``; the job lines
    and the summary say ``1e-4`` and ``3e-5`` (issue 40); ``0.001`` stays."""
    from omegaconf import OmegaConf

    OmegaConf.save({"hydra": {"overrides": {"task": ["train.lr=1e-4,3e-5,1e-3"]}}}, tmp_path / "multirun.yaml")
    assert sweep.job_header(str(tmp_path), 0, ["train.lr=0.0001"]) == "sweep job 1/3: train.lr=1e-4"
    assert sweep.job_header(str(tmp_path), 1, ["train.lr=3e-05"]) == "sweep job 2/3: train.lr=3e-5"
    assert sweep.job_header(str(tmp_path), 2, ["train.lr=0.001"]) == "sweep job 3/3: train.lr=0.001"
    sd = str(tmp_path / "sw")
    for n, lr in enumerate(["0.0001", "3e-05"]):
        _fake_job(os.path.join(sd, str(n)), n, ["train.steps=2", f"train.lr={lr}"], 0, [5.0])
    assert [r[1] for r in sweep.table_rows(sweep.collect(sd))] == ["train.lr=1e-4", "train.lr=3e-5"]
