"""A delayed-update run (train.offload_update=delayed) does not resume exactly, so nothing may tell a
user or a Kubernetes restart to resume it as is: the interrupt's resume command switches it to the
synchronous update, and train.resume=auto (restarts) is refused up front."""
from __future__ import annotations

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
