"""``runtime.trace=true`` end to end (tiny model with tied embeddings, two card
processes, ``zb-h2``): ``trace.json`` in the
run dir holds every step's schedule per card in Chrome trace format, its waits and phases add up to
the figures the cards report in ``metrics.jsonl`` (same timers, measured independently of the trace
file's path through the launcher), and the run log ends with the per-card summary."""
from __future__ import annotations

import json
import os

import pytest
from conftest import launch_to_end

from npu_train.pipeline.schedule import build_schedule

pytestmark = pytest.mark.timeout(300)


def test_trace_file_matches_the_schedule_and_the_step_metrics(tiny_model, tmp_path):
    steps, M = 3, 4
    job = launch_to_end(tmp_path, tiny_model, f"train.steps={steps}", "train.schedule=zb-h2",
                        "runtime.trace=true", "checkpoint.save=false")
    with open(os.path.join(job.run_dir, "trace.json")) as f:
        events = json.load(f)
    with open(os.path.join(job.run_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert len(recs) == steps
    for step in range(1, steps + 1):
        rec = recs[step - 1]
        for rank in range(2):
            mine = sorted((e for e in events if e.get("ph") == "X" and e["tid"] == rank
                           and e["args"]["step"] == step), key=lambda e: e["ts"])
            acts = [e["name"] for e in mine if e["cat"] == "compute"]
            want = [f"{a.kind}{a.micro}" for a in build_schedule("zb-h2", 2, M, rank)]
            if rank == 1:  # the tied lm_head gradient leaves right after the last B
                want.insert(want.index(f"B{M - 1}") + 1, "E")
            else:  # right after the first forward: the work moved out of the fill (every step: the
                want.insert(1, "U")  # embedding's gradient buffer; from step 2 the rows-first update's rest)
            assert acts == want, (step, rank, acts)
            wait = sum(e["dur"] for e in mine if e["cat"] == "wait" and e["name"].split()[1][0] in "FB") / 1e6
            assert wait == pytest.approx(rec["bubble_s_cards"][rank], abs=1e-4)
            coll = [e["dur"] / 1e6 for e in mine if e["name"] == "collectives"]
            assert coll == [pytest.approx(rec["collective_s_cards"][rank], abs=1e-4)]
            assert [e["name"] for e in mine if e["cat"] == "phase"] == ["collectives", "tied", "optimizer"]
    log = open(os.path.join(job.run_dir, "run.log")).read()
    assert "trace: where each card's step goes (mean of steps 2-3" in log, log[-2000:]
    assert "trace.json (open in https://ui.perfetto.dev)" in job.flat_stdout
    with open(os.path.join(job.run_dir, "summary.json")) as f:
        assert json.load(f)["trace"].endswith("trace.json")


def test_no_trace_file_by_default(tiny_model, tmp_path):
    job = launch_to_end(tmp_path, tiny_model, "train.steps=1", "checkpoint.save=false")
    assert not os.path.exists(os.path.join(job.run_dir, "trace.json"))
    assert "trace:" not in job.stdout
