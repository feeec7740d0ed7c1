"""A malformed ``backend=`` is refused before the launcher's heavy imports: a fresh-clone review on a loaded
2-core host waited 19 s for the one line, most of it torch's import and the job's modules. Checked by what the
launcher imported when it stopped (no torch, no model or tokenizer module, not even the job module), not by
timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from npu_train.errors import one_refusal

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
LAUNCH = os.path.join(REPO, "launch", "run.py")

#: the modules a refusal before any work must not have imported
HEAVY = ("torch", "transformers", "tokenizers", "npu_train.model.tokenizer", "npu_train.model.weights",
         "npu_train.data.prepare", "npu_train.runtime.job")

CODE = """
import atexit, json, runpy, sys
out, argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(json.dumps([m for m in {heavy!r} if m in sys.modules])))
sys.argv = [{launch!r}, *argv]
runpy.run_path({launch!r}, run_name="__main__")
"""


@pytest.mark.parametrize("backend, says", [
    ("tpu:0", "unknown device kind 'tpu'"),
    ("cpu:1", "cpu takes no index"),
    ("gpu", "write cuda:N"),
    ("furiosa:0,furiosa:0", "already named by entry"),
])
def test_a_malformed_backend_is_refused_before_the_heavy_imports(tmp_path, backend, says):
    seen = tmp_path / "imported.json"
    r = subprocess.run([sys.executable, "-c", CODE.format(heavy=HEAVY, launch=LAUNCH), str(seen),
                        f"backend={backend}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                       env=dict(os.environ, NPT_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 2, r.stderr[-2000:]
    assert one_refusal(r.stderr) and says in one_refusal(r.stderr), r.stderr
    assert json.loads(seen.read_text()) == [], "imported before the refusal"
