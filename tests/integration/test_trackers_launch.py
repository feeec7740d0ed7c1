"""A real launch with ``metrics.logger=[tensorboard,wandb,mlflow]`` (W&B offline, MLflow to a sqlite store),
stopped after one step and resumed as a second launch: one W&B run and one MLflow run hold steps 1-3 with the
same losses as ``metrics.jsonl``; the MLflow run has the resolved config as params and the plan."""
from __future__ import annotations

import json
import os

import pytest

from conftest import launch_to_end

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def test_launch_logs_to_wandb_and_mlflow_and_resume_continues(tiny_model, tmp_path):
    from mlflow.tracking import MlflowClient
    from wandb_log import read_wandb_history

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ("train.steps=3", f"checkpoint.dir={tmp_path / 'ckpt'}", "metrics.logger=[tensorboard,wandb,mlflow]",
              f"metrics.mlflow_uri={uri}", "metrics.project=npt-it")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = launch_to_end(tmp_path, tiny_model, *common, "train.stop_after=1", name="a", env=env, timeout=240)
    second = launch_to_end(tmp_path, tiny_model, *common, "train.resume=latest", name="b", env=env, timeout=240)
    assert "warning:" not in first.stderr + second.stderr, second.stderr[-2000:]
    ids = json.load(open(tmp_path / "ckpt" / "trackers.json"))
    metrics = [json.loads(l) for l in open(os.path.join(second.run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1, 2, 3]  # step 1 carried from the launch that saved the checkpoint
    assert metrics[0]["loss"] == json.loads(open(os.path.join(first.run_dir, "metrics.jsonl")).readline())["loss"]
    losses = {m["step"]: m["loss"] for m in metrics}

    client = MlflowClient(tracking_uri=uri)
    hist = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "train/loss")}
    assert hist == pytest.approx(losses, rel=1e-12)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["train.steps"] == "3" and run.data.params["metrics.project"] == "npt-it"
    assert "eval/loss" in run.data.metrics and run.info.status == "FINISHED"
    # the summary reaches the trackers (they were once closed before it was written)
    summary = json.load(open(os.path.join(second.run_dir, "summary.json")))
    assert run.data.metrics["summary.last_val_loss"] == pytest.approx(summary["last_val_loss"], rel=1e-12)
    assert run.data.metrics["summary.mean_step_s"] == pytest.approx(summary["mean_step_s"], rel=1e-12)
    assert f"mlflow: run {ids['mlflow']}; look at it with: mlflow ui --backend-store-uri {uri}" in second.flat_stdout
    assert "INFO" not in first.stdout + first.stderr
    assert len(client.search_runs([run.info.experiment_id])) == 1  # the resume continued, no second run

    rows = read_wandb_history(first.run_dir) + read_wandb_history(second.run_dir)
    assert {r["_step"]: r["train/loss"] for r in rows if "train/loss" in r} == pytest.approx(losses, rel=1e-12)
