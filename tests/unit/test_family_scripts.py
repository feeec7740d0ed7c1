"""The tiny-model scripts a user runs from the docs: ``experiments/scripts/model_families.py`` takes
``--help`` (and never makes a folder called ``--help``), writes its three families with one line each and no
progress bars; the docs' example folder is ignored by git."""
from __future__ import annotations

import os
import subprocess
import sys

from scripts import REPO

SCRIPT = os.path.join(REPO, "experiments", "scripts", "model_families.py")


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "src"))
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)


def test_help_prints_usage_and_writes_nothing(tmp_path):
    r = _run(["--help"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "output folder" in r.stdout
    assert os.listdir(tmp_path) == []  # no "--help" (or "tiny-families") folder


def test_writes_three_families_without_progress_bars(tmp_path):
    r = _run([str(tmp_path / "fam")], tmp_path)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["qwen2", "qwen3", "mistral"]
    assert "Writing" not in r.stdout + r.stderr and "%|" not in r.stdout + r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / "fam")) == ["mistral", "mistral.gguf", "qwen2", "qwen2.gguf",
                                                   "qwen3", "qwen3.gguf"]


def test_docs_example_outputs_are_ignored():
    with open(os.path.join(REPO, ".gitignore")) as f:
        ignored = {ln.strip() for ln in f}
    assert {"tiny-families/", "mlruns/"} <= ignored
