"""A vocabulary-parallel plan (``parallel.vocab=true``) says how its predicted step compares with the same plan
without it, in one line, and labels every card's share of the cut output layer (issue 40: a fresh-clone review's
8-card plan was slower with it and did not say so, and its last card read ``+head`` though the head was split).

Llama-3.1-8B on 8 RNGD cards, zb-h2, is predicted slower with it (docs/data-parallel.md: the blocking exchange
at the assumed gloo rate); the launcher's dry run must say so with the two planned steps."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, make_plan
from npu_train.planner.rates import load_rates

ROOT = Path(__file__).resolve().parents[2]
CARDS = ",".join(f"furiosa:{i}" for i in range(8))


def _plans() -> tuple:
    shape = RunShape(seq_len=128, micro_batch=2, micro_batches=4, schedule="zb-h2", dtype="bf16")
    cards = make_cards("furiosa", 8)
    req = PlanRequest(get_preset("llama-3.1-8b"), shape, cards, [load_rates("furiosa") for _ in cards])
    return tuple(make_plan(replace(req, shape=replace(shape, vocab_parallel=v))) for v in (True, False))


def test_the_cut_head_is_labelled_on_every_card():
    with_v, off = _plans()
    labels = [st.layers_label for st in with_v.stages]
    assert all(lb.endswith(" +head 1/8") for lb in labels), labels
    assert labels[-1].endswith(" +norm +head 1/8") and "+norm" not in " ".join(labels[:-1]), labels
    assert off.stages[-1].layers_label.endswith(" +head") and "1/" not in off.stages[-1].layers_label


def test_a_slower_vocab_plan_says_so_in_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               NPT_CACHE=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "plan=true", "model.path=llama-3.1-8b",
                        f"backend={CARDS}", "train.schedule=zb-h2", "parallel.vocab=true", "runtime.threads=1",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    joined = re.sub(r"\n  ", " ", r.stdout)
    m = re.search(r"parallel\.vocab=true: predicted step ([\d.]+) s, ([\d.]+) s without it \((\d+) % slower with it: "
                  r"parallel\.vocab=false or auto\)", joined)
    assert m, r.stdout
    with_s, off_s = float(m.group(1)), float(m.group(2))
    assert with_s > off_s and int(m.group(3)) == round((with_s / off_s - 1) * 100), m.group(0)
    predicted = re.search(r"predicted: step ([\d.]+) s", joined)
    assert predicted and abs(float(predicted.group(1)) - with_s) <= 0.006, joined  # the same plan, 2 decimals
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("furiosa:")]
    assert rows and all("+head 1/8" in ln for ln in rows) and max(len(ln) for ln in rows) <= 100, rows
