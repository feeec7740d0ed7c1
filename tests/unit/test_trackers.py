"""Experiment trackers (``metrics.logger``) with the real client libraries, written offline and read back:
W&B in offline mode (the run's ``.wandb`` log parsed with W&B's own protobuf records), MLflow into a sqlite
store (read with ``MlflowClient``). A resumed launch continues the same tracker runs; a missing package or
an unreachable server is one warning and the metrics still reach ``metrics.jsonl``."""
from __future__ import annotations

import glob
import io
import json
import os
import sys

import pytest

from npu_train.metrics.report import Reporter
from npu_train.metrics.trackers import TrackerSetup, open_trackers, wandb_mode
from wandb_log import read_wandb_history

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")


def _card(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens": 100, "time_s": 0.5,
            "compute_s": 0.4, "optimizer_s": 0.05, "transfer_s": 0.0, "send_s": 0.0, "mem_peak": 2 ** 30}


def _setup(tmp_path, name: str, ckpt, resuming: bool) -> TrackerSetup:
    run_dir = tmp_path / name
    run_dir.mkdir()
    return TrackerSetup(run_dir=str(run_dir), config={"train": {"lr": 1e-3}, "backend": ["cpu", "cpu"]},
                        plan={"stages": [1, 2]}, project="npt-test", run_name=name, group="sweep-1",
                        ckpt_root=str(ckpt), resuming=resuming, mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db")


def _launch(tmp_path, name, ckpt, steps, resuming, losses):
    setup = _setup(tmp_path, name, ckpt, resuming)
    warnings = []
    trackers = open_trackers(["tensorboard", "wandb", "mlflow"], setup, warn=warnings.append)
    rep = Reporter(setup.run_dir, 4, stream=io.StringIO(), trackers=trackers)
    for s in steps:
        rep.step([_card(s, losses[s]), _card(s, losses[s])])
    rep.eval(steps[-1], 2.5, 1000)
    rep.finish()
    return setup, warnings


def test_wandb_and_mlflow_runs_continue_across_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    losses = {1: 4.0, 2: 3.5, 3: 3.25, 4: 3.0}
    a, warn_a = _launch(tmp_path, "a", ckpt, [1, 2], False, losses)
    b, warn_b = _launch(tmp_path, "b", ckpt, [3, 4], True, losses)
    assert warn_a == [] and warn_b == []
    assert a.ids.wandb == b.ids.wandb and a.ids.mlflow == b.ids.mlflow  # the resume continued both runs
    assert json.load(open(ckpt / "trackers.json")) == {"wandb": a.ids.wandb, "mlflow": a.ids.mlflow}

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    hist = sorted((m.step, m.value) for m in client.get_metric_history(a.ids.mlflow, "train/loss"))
    assert hist == [(1, 4.0), (2, 3.5), (3, 3.25), (4, 3.0)]
    run = client.get_run(a.ids.mlflow)
    assert run.data.params["train.lr"] == "0.001" and run.data.tags["sweep"] == "sweep-1"
    assert run.data.metrics["eval/loss"] == 2.5 and run.data.metrics["summary.last_loss"] == 3.0
    assert run.info.status == "FINISHED"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == "npt-test"

    # W&B: both launches' offline logs hold the one run id and the steps in order
    rows = read_wandb_history(a.run_dir) + read_wandb_history(b.run_dir)
    steps = [(r["_step"], r["train/loss"]) for r in rows if "train/loss" in r]
    assert steps == [(1, 4.0), (2, 3.5), (3, 3.25), (4, 3.0)]
    assert any(r.get("eval/loss") == 2.5 for r in rows)
    assert glob.glob(os.path.join(b.run_dir, "wandb", f"offline-run-*-{a.ids.wandb}"))
    assert os.listdir(os.path.join(a.run_dir, "tb"))  # TensorBoard still written beside them


def test_a_fresh_run_gets_new_tracker_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    losses = {1: 4.0, 2: 3.5}
    a, _ = _launch(tmp_path, "a", ckpt, [1], False, losses)
    b, _ = _launch(tmp_path, "b", ckpt, [2], False, losses)
    assert a.ids.mlflow != b.ids.mlflow and a.ids.wandb != b.ids.wandb


def test_missing_package_is_one_warning_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    setup = _setup(tmp_path, "a", tmp_path, False)
    warnings = []
    trackers = open_trackers(["wandb"], setup, warn=warnings.append)
    assert trackers == []
    assert len(warnings) == 1 and "pip install 'npu-train[wandb]'" in warnings[0]
    rep = Reporter(setup.run_dir, 2, stream=io.StringIO(), trackers=trackers)
    rep.step([_card(1, 4.0)])
    rep.finish()
    assert len(open(os.path.join(setup.run_dir, "metrics.jsonl")).readlines()) == 1


def test_unreachable_mlflow_server_is_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    setup = _setup(tmp_path, "a", tmp_path, False)
    setup.mlflow_uri = "http://127.0.0.1:9"  # discard port: connection refused
    warnings = []
    assert open_trackers(["mlflow"], setup, warn=warnings.append) == []
    assert len(warnings) == 1 and warnings[0].startswith("warning: mlflow could not start")


def test_a_tracker_failing_mid_run_is_dropped_with_one_warning(tmp_path):
    from npu_train.metrics.trackers import Guarded, Tracker

    class Flaky(Tracker):
        name = "flaky"
        calls = 0

        def log(self, scalars, step):
            Flaky.calls += 1
            raise ConnectionError("server went away")

    out = io.StringIO()
    rep = Reporter(str(tmp_path), 3, stream=out, trackers=[Guarded(Flaky(), warn=lambda t: print(t, file=out))])
    for s in (1, 2, 3):
        rep.step([_card(s, 4.0)])
    rep.finish()
    assert Flaky.calls == 1
    assert out.getvalue().count("warning: flaky logging failed (ConnectionError: server went away)") == 1
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 3


def test_wandb_mode_offline_without_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "x"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == "disabled"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_mode({}) == "online"


def test_unknown_logger_is_refused():
    from omegaconf import OmegaConf

    from npu_train.config import Config, ConfigError, validate

    cfg = OmegaConf.structured(Config)
    cfg.metrics.logger = ["tensorboard", "wandbb"]
    with pytest.raises(ConfigError, match=r"unknown \['wandbb'\].*metrics.logger=\[tensorboard,wandb\]"):
        validate(cfg)


def test_one_logger_name_alone_is_a_list_of_one():
    """``metrics.logger=wandb`` (no brackets) is taken as ``[wandb]``: Hydra merges the override into the
    structured config (a ``list`` field refused the string with a ValidationError naming no fix), validation
    accepts it, and an unknown single name is still refused."""
    from omegaconf import OmegaConf

    from npu_train.config import Config, ConfigError, validate

    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(["metrics.logger=wandb"]))
    assert cfg.metrics.logger == "wandb"
    validate(cfg)
    bad = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(["metrics.logger=wandbb"]))
    with pytest.raises(ConfigError, match=r"unknown \['wandbb'\]"):
        validate(bad)


def test_mlflow_artifacts_go_beside_the_sqlite_store(tmp_path, monkeypatch):
    """The plan artifact lands in <db dir>/mlruns, not in the current directory (a test once left mlruns/
    in the repository)."""
    monkeypatch.chdir(tmp_path / "..")
    setup = _setup(tmp_path, "a", tmp_path, False)
    (t,) = open_trackers(["mlflow"], setup, warn=pytest.fail)
    t.close()
    assert list((tmp_path / "mlruns").rglob("plan.json"))
    assert not os.path.exists(os.path.join(str(tmp_path / ".."), "mlruns"))


def test_a_launch_hands_its_summary_to_the_trackers(tmp_path):
    """``runtime/job.py`` once closed the trackers when the card processes ended, before ``_finish`` wrote the
    summary: W&B / MLflow never got ``mean_step_s`` or ``last_val_loss``. The supervision leaves them open
    for the summary on success and closes them on a failure."""
    from types import SimpleNamespace

    from npu_train.metrics.trackers import Guarded, Tracker
    from npu_train.runtime import job as J

    class Recorder(Tracker):
        name = "recorder"

        def __init__(self):
            self.summaries, self.closed = [], False

        def log(self, scalars, step):
            pass

        def summary(self, summ):
            assert not self.closed, "summary after close"
            self.summaries.append(summ)

        def close(self):
            self.closed = True

    def started(run):
        rec = Recorder()
        rep = Reporter(str(tmp_path), 2, stream=io.StringIO(), trackers=[Guarded(rec, warn=pytest.fail)])
        data = tmp_path / "data.safetensors"
        data.write_bytes(b"x")
        return rec, rep, J.StartedJob(coord=SimpleNamespace(run=run, run_dir=str(tmp_path)), reporter=rep,
                                      data_file=str(data), job_id="j")

    def ends(rep):
        rep.step([_card(1, 4.0)])
        rep.step([_card(2, 3.0)])
        rep.eval(2, 2.5, 1000)

    resume = SimpleNamespace(saving=True, ckpt_root=str(tmp_path))
    rec, rep, job = started(lambda: ends(rep))
    J._supervise(job, None, resume)
    assert not rec.closed and not os.path.exists(job.data_file)
    rep.finish()
    (summ,) = rec.summaries
    assert summ["mean_step_s"] == 0.5 and summ["last_val_loss"] == 2.5 and rec.closed

    def fails():
        raise RuntimeError("card 1 died")

    rec, rep, job = started(fails)
    with pytest.raises(RuntimeError):
        J._supervise(job, None, resume)
    assert rec.closed and not os.path.exists(job.data_file)


def test_the_output_says_where_the_tracker_runs_went(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    setup = _setup(tmp_path, "a", tmp_path, False)
    out = io.StringIO()
    rep = Reporter(setup.run_dir, 1, stream=out, trackers=open_trackers(["wandb", "mlflow"], setup, warn=pytest.fail))
    rep.step([_card(1, 4.0)])
    rep.finish()
    lines = out.getvalue().splitlines()
    (wb,) = [l for l in lines if l.startswith("wandb:")]
    run_path = glob.glob(os.path.join(setup.run_dir, "wandb", f"offline-run-*-{setup.ids.wandb}"))[0]
    assert wb == f"wandb: offline run; upload it with: wandb sync {run_path}"
    (ml,) = [l for l in lines if l.startswith("mlflow:")]
    assert ml == f"mlflow: run {setup.ids.mlflow}; look at it with: mlflow ui --backend-store-uri {setup.mlflow_uri}"


def test_mlflow_prints_no_info_lines_of_its_own(tmp_path):
    """Creating a new sqlite store made MLflow log two ``INFO mlflow.store.db.utils`` lines into the job's
    output (a fresh process: MLflow configures its logging when first imported)."""
    import subprocess

    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    code = ("import sys; from npu_train.metrics.trackers import TrackerSetup, open_trackers\n"
            f"s = TrackerSetup(run_dir={str(tmp_path)!r}, config={{}}, plan={{}}, "
            f"mlflow_uri='sqlite:///{tmp_path}/new.db')\n"
            "(t,) = open_trackers(['mlflow'], s); t.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_LOGGING_LEVEL"}
    env["PYTHONPATH"] = os.path.abspath(src)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "INFO" not in r.stdout + r.stderr, r.stdout + r.stderr
