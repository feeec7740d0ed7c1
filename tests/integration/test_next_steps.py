"""After the default job: the next-step lines (``runtime/hints.py``, issue 40). Each printed command works as it
is: run here by a shell from the repository root, with ``python`` this interpreter (an activated environment),
on a tiny run's checkpoint (generate) and for the 8B preset (the dry-run plan); the LoRA command trains
in the heavy ``tests/e2e/test_next_steps_lora.py``."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import make_tiny_model, run_pipeline
from npu_train.config import Config
from npu_train.runtime.hints import next_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(240)


def _env() -> dict:
    """An activated environment: ``python`` on PATH is this interpreter."""
    return dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _lines(monkeypatch, root: str, width: int = 100, **cfg_over) -> list[str]:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PATH", _env()["PATH"])
    cfg = OmegaConf.structured(Config)
    for k, v in cfg_over.items():
        OmegaConf.update(cfg, k, v)
    return next_steps(cfg, root, width=width)


def test_the_default_job_ends_with_four_lines_of_at_most_100_columns(monkeypatch):
    lines = _lines(monkeypatch, os.path.join(ROOT, "outputs/2026-12-06/12-13-25.123456/checkpoints"))
    assert len(lines) == 4 and lines[0].startswith("next: ") and "docs/data.md" in lines[0], lines
    assert all(len(l) <= 100 for l in lines), [len(l) for l in lines]
    assert lines[1] == "python -m npu_train.generate outputs/2026-12-06/12-13-25.123456/checkpoints --prompt Hi"
    assert lines[2] == "python launch/run.py train.mode=lora data.format=chat data.source=botchan-chat"
    assert lines[3].startswith("python launch/run.py plan=true model.path=llama-3.1-8b backend=furiosa:")
    # another job, or no checkpoint: nothing; a checkpoint path too long for one line: the generate command
    # continued on the next lines (` \`), the path alone on its own (tests/unit/test_pasteable_commands.py)
    assert _lines(monkeypatch, "ck", **{"model.path": "/models/x"}) == []
    assert _lines(monkeypatch, "ck", **{"train.mode": "lora"}) == []
    assert _lines(monkeypatch, None) == []
    long = _lines(monkeypatch, "/" + "d" * 90 + "/checkpoints")
    assert long[1:4] == ["python -m npu_train.generate \\", "  /" + "d" * 90 + "/checkpoints \\", "  --prompt Hi"]


def test_the_printed_generate_and_plan_commands_work_as_printed(monkeypatch, tmp_path):
    import json

    model = make_tiny_model(str(tmp_path / "tiny"))  # with a chat template, as the embedded model has
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant: {% endif %}",
                   "eos_token": "<|endoftext|>"}, f)
    run = tmp_path / "run"
    run_pipeline(model, str(run), "backend=[cpu]", "train.steps=1")
    lines = _lines(monkeypatch, str(run / "checkpoints"))  # a tmp path: its command continued with ` \`
    k = next(i for i, ln in enumerate(lines) if "-m npu_train.generate" in ln)
    gen = "\n".join(lines[k:next(i for i in range(k, len(lines)) if not lines[i].endswith(" \\")) + 1])
    plan = next(ln for ln in lines if "plan=true" in ln)
    for cmd in (gen, plan):
        r = subprocess.run(cmd, shell=True, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])
    assert "predicted:" in r.stdout  # the plan's table
