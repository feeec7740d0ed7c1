"""A delayed-update run (train.offload_update=delayed) does not resume exactly, so nothing may tell a
user or a Kubernetes restart to resume it as is: the interrupt's resume command switches it to the
synchronous update, and train.resume=auto (restarts) is refused up front."""
from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config, validate
from npu_train.errors import ConfigError
from scripts import LAUNCH_RUN, load_script


def _launcher():
    return load_script(LAUNCH_RUN, "_npt_launcher_for_test")


def test_resume_command_of_a_delayed_run_uses_the_sync_update():
    cmd = _launcher().resume_command(["train.offload_update=delayed", "train.steps=50", "train.resume=auto",
                                      "checkpoint.dir=/old"], "/ck")
    assert "train.offload_update=sync" in cmd and "delayed" not in cmd
    assert "train.steps=50" in cmd and "train.resume=latest" in cmd and "checkpoint.dir=/ck" in cmd
    assert "/old" not in cmd and "train.resume=auto" not in cmd
    plain = _launcher().resume_command(["train.steps=50"], "/ck")
    assert "offload_update" not in plain


def test_delayed_update_with_resume_auto_is_refused():
    cfg = OmegaConf.structured(Config)
    cfg.train.offload_update = "delayed"
    validate(cfg)  # a fresh delayed run is fine
    cfg.train.resume = "auto"
    with pytest.raises(ConfigError, match="train.offload_update=sync with train.resume=auto"):
        validate(cfg)
    cfg.train.offload_update = "sync"
    validate(cfg)


def test_resume_command_starts_with_the_runs_npt_variables(monkeypatch, tmp_path):
    """A run started with NPT_CACHE (or another NPT_ variable that changes the run) resumes with it:
    the resume command (status.json) and the interrupt message start with the assignments, values
    shell-quoted; test hooks (NPT_FAULT) are not repeated; a relative cache becomes absolute."""
    import shlex

    from npu_train.runtime.job import interrupt_note

    for k in ("NPT_CACHE", "NPU_TRAIN_CACHE", "NPT_FURIOSA_FUSION", "NPU_TRAIN_FURIOSA_FUSION"):
        monkeypatch.delenv(k, raising=False)
    cache = str(tmp_path / "my cache")
    monkeypatch.setenv("NPT_CACHE", cache)
    monkeypatch.setenv("NPT_FURIOSA_FUSION", "4")
    monkeypatch.setenv("NPT_FAULT", "1:forward:raise")
    cmd = _launcher().resume_command(["train.steps=50"], "/ck")
    words = shlex.split(cmd)
    assert words[:3] == ["env", f"NPT_CACHE={cache}", "NPT_FURIOSA_FUSION=4"], cmd
    assert cmd.startswith(f"env NPT_CACHE={shlex.quote(cache)} NPT_FURIOSA_FUSION=4 "), cmd
    assert words[4].endswith("run.py") and "train.resume=latest" in words and "NPT_FAULT" not in cmd
    note = interrupt_note("/ck/step-4", "/ck", "sync")
    assert f"resume with: env NPT_CACHE={shlex.quote(cache)} NPT_FURIOSA_FUSION=4 <the same command> " \
           "train.resume=latest checkpoint.dir=/ck" in note and "NPT_FAULT" not in note
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NPT_CACHE", "rel")
    assert shlex.split(_launcher().resume_command([], "/ck"))[:2] == ["env", f"NPT_CACHE={tmp_path / 'rel'}"]
    for k in ("NPT_CACHE", "NPT_FURIOSA_FUSION"):
        monkeypatch.delenv(k)
    assert _launcher().resume_command([], "/ck").startswith(shlex.quote(sys.executable))
    assert "resume by rerunning the same command with train.resume=latest" in interrupt_note("/ck/s", "/ck", "sync")


@pytest.mark.parametrize("flag,fix", [("true", "use train.resume=latest .*train.resume=auto"),
                                      ("false", "to start fresh drop train.resume .*train.resume=auto")])
def test_boolean_resume_is_refused_naming_the_values(flag, fix):
    """Hydra turns train.resume=true into a boolean (kept as 'True' by the string field): one line naming the
    accepted values, not 'True does not exist'."""
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([f"train.resume={flag}"]))
    with pytest.raises(ConfigError, match=f"train.resume takes latest, auto or a path \\(got {flag}\\): {fix}"):
        validate(cfg)
    cfg.train.resume = "latest"
    validate(cfg)
