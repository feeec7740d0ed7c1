"""The planner is a pure model: every module of ``npu_train.planner`` imports, plans and renders a table
with torch and numpy unimportable (``sys.modules[name] = None`` makes ``import name`` raise)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

CODE = """
import importlib, pkgutil, sys
sys.modules["torch"] = None
sys.modules["numpy"] = None
import npu_train.planner as planner
names = sorted(m.name for m in pkgutil.iter_modules(planner.__path__))
for name in names:
    importlib.import_module(f"npu_train.planner.{name}")
from npu_train.hardware import GIB, make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import DEFAULT_RATES, PlanRequest, RunShape, format_plan, make_plan
plan = make_plan(PlanRequest(get_preset("llama-3.2-1b"), RunShape(seq_len=256, micro_batches=4, schedule="zb-h1"),
                             make_cards("cpu", 2, 64 * GIB), DEFAULT_RATES["cpu"], threads=1, host_cores=2))
assert "predicted:" in format_plan(plan)
print(" ".join(names))
"""


def test_every_planner_module_imports_and_plans_without_torch_or_numpy():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert {"memory", "search", "cost", "rates"} <= set(out.stdout.split()), out.stdout


DRY_RUN = """
import runpy, sys
sys.modules["torch"] = None
sys.argv = [{launch!r}, "plan=true", "model.path=llama-3.2-1b", "backend=furiosa:0,furiosa:1", "hydra.run.dir={run}"]
runpy.run_path({launch!r}, run_name="__main__")
"""


def test_a_dry_run_of_a_preset_needs_no_torch(tmp_path):
    """``plan=true`` with a preset runs the launcher without torch: its import was 1.4 s of the 2.5 s of CPU
    before the plan's first line (a fresh-clone review on a loaded 2-core host: 21 s to the first line)."""
    launch = str(SRC.parent / "launch" / "run.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               NPT_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", DRY_RUN.format(launch=launch, run=tmp_path / "run")], env=env,
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "predicted: step" in out.stdout and "furiosa:1" in out.stdout, out.stdout[-2000:]
