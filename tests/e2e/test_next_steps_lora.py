"""The LoRA command the default job prints as a next step (``runtime/hints.py``) trains as printed: the
embedded model, LoRA, the shipped chat rows; here one step of it in its own run directory."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(600)]


def test_the_printed_lora_command_trains(tmp_path, monkeypatch):
    from npu_train.config import Config
    from npu_train.runtime.hints import next_steps

    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", env["PATH"])
    lines = next_steps(OmegaConf.structured(Config), "outputs/x/checkpoints")
    (lora,) = [ln for ln in lines if "train.mode=lora" in ln]
    cmd = f"{lora} train.steps=1 hydra.run.dir={tmp_path / 'run'}"
    r = subprocess.run(cmd, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=550)
    assert r.returncode == 0, (cmd, r.stdout[-3000:], r.stderr[-3000:])
    assert "done: 1 step" in r.stdout and os.path.isdir(tmp_path / "run" / "checkpoints")
