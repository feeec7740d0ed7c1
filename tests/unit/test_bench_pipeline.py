"""``experiments/bench/pipeline.py`` records the (schedule, P, M) cells torch's pipeline schedules refuse
as ``refused`` without starting a process, keeps ``ScheduleGPipe`` as the baseline where ``Schedule1F1B``
is refused, and ``grid_table.py`` still builds its table from the result; the refusal rules
(``_torch_pipeline.torch_refusal``) are those of the installed torch's schedule constructors."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest

from scripts import REPO, load_script

BENCH = os.path.join(REPO, "experiments", "bench")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts its directory and src/ first
    return load_script(os.path.join(BENCH, "pipeline.py"), "_npt_bench_pipeline")


def _fake_stages(kind: str, P: int, bench) -> list:
    """Rank 0's stages as ``pipeline.py`` lays them out (``stage_ranks``), with the attributes the
    schedule constructors read (the refusal conditions do not depend on the rank)."""
    import torch.nn as nn

    ranks = bench.stage_ranks(kind, P)
    S = len(ranks)
    return [SimpleNamespace(num_stages=S, group_size=P, group_rank=0, stage_index=s, is_first=s == 0,
                            is_last=s == S - 1, submod=nn.Linear(1, 1))
            for s in range(S) if ranks[s] == 0]


def test_refusal_rules_match_torch(bench):
    """Every schedule of the bench, P = 1..4, M = 1..12: torch_refusal names a reason exactly when the
    installed torch's constructor raises ValueError."""
    pp = pytest.importorskip("torch.distributed.pipelining")
    from _torch_pipeline import LOOPED, SINGLE, VSHAPE, torch_refusal

    wrong = []
    for kind in (*SINGLE, *LOOPED, *VSHAPE):
        cls = getattr(pp, "Schedule" + kind)
        for P in range(1, 5):
            for M in range(1, 13):
                st = _fake_stages(kind, P, bench)
                try:
                    cls(st[0] if kind in SINGLE else st, n_microbatches=M, loss_fn=lambda o, t: o, scale_grads=False)
                    raised = None
                except ValueError as e:
                    raised = str(e)
                why = torch_refusal(kind, P, M)
                if (raised is None) != (why is None):
                    wrong.append(f"{kind} P={P} M={M}: torch {raised or 'accepts'}, rule {why or 'accepts'}")
    assert not wrong, "\n".join(wrong)
    assert torch_refusal("1F1B", 3, 2) == "torch Schedule1F1B needs M >= P (M=2 < P=3 stages; torch raises ValueError)"


def _stub_runs(bench, monkeypatch, tmp_path, fake_torch, fake_project):
    """Replace the bench's process-starting parts by the fakes; returns the --json path to use."""
    monkeypatch.setattr(bench, "run_torch", fake_torch)
    monkeypatch.setattr(bench, "run_project", fake_project)
    monkeypatch.setattr(bench, "prepare_data", lambda args, work: ("data.safetensors", 6))
    monkeypatch.setattr(bench, "machine_info", lambda device: {
        "cpu": "test", "logical_cpus": 2, "usable_cores": [0, 1], "torch": "x", "python": "3", "loadavg_1m": 0.0})
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    return tmp_path / "grid.json"


def test_refused_cells_start_nothing_and_gpipe_is_the_baseline(bench, monkeypatch, tmp_path, capsys):
    started = []

    def fake_torch(kind, P, M, layers, args, data_file, work, cores, keep=False):
        started.append((kind, P, M))
        return {"tokens_per_s": 10.0, "step_s": [1.0, 1.0], "loss": [4.0, 3.9], "loss1": 4.0}

    def fake_project(schedule, P, M, args, work, cores, extra=()):
        return {"tokens_per_s": 12.0, "idle_share": 0.5, "bubble_share": 0.3, "collective_share": 0.1,
                "loss": [4.0, 3.9], "loss1": 4.0, "split": [[0, 3], [3, 5], [5, 6]]}

    out = _stub_runs(bench, monkeypatch, tmp_path, fake_torch, fake_project)
    assert bench.main(["--P", "3", "--M", "2", "8", "--rounds", "2", "--model", "x", "--project-schedules", "1f1b",
                       "--torch-schedules", "1F1B", "DualPipeV", "--json", str(out)]) == 0
    text = capsys.readouterr().out

    assert not [s for s in started if s[2] == 2 and s[0] != "GPipe"], started  # nothing refused was started
    assert started.count(("GPipe", 3, 2)) == 4 and ("1F1B", 3, 8) in started and ("DualPipeV", 3, 8) in started
    res = json.loads(out.read_text())
    refused = [r for r in res["results"] if "refused" in r]
    assert {(r["system"], r["M"]) for r in refused} == {(f"torch {k} {sp}", 2) for k in ("1F1B", "DualPipeV")
                                                        for sp in ("even", "project")}
    assert len(refused) == 8 and not any("error" in r or "tokens_per_s" in r for r in refused)
    assert "P=3 M=2 round 1: torch 1F1B even" in text
    assert "refused: torch Schedule1F1B needs M >= P (M=2 < P=3 stages; torch raises ValueError)" in text
    assert "refused: torch ScheduleDualPipeV needs M >= 2P stages (M=2 < 6; torch raises ValueError)" in text
    summary = text[text.index("\nsummary:"):].splitlines()  # the table names the refusal, not "failed"
    assert [l.split()[:4] for l in summary if "torch 1F1B even" in l and "refused:" in l] == \
        [["torch", "1F1B", "even", "refused:"]]
    base = {(e["M"], e["system"]): e["baseline"] for e in res["summary"]}
    assert base[(2, "npu-train 1f1b")] == "torch GPipe even" and base[(8, "npu-train 1f1b")] == "torch 1F1B even"
    one = next(e for e in res["summary"] if e["M"] == 2 and e["system"] == "torch 1F1B even")
    assert one["refused"] and not one["errors"] and one["tps"]["n"] == 0

    load_script(os.path.join(BENCH, "grid_table.py"), "_npt_grid_table").main([str(out)])
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 3 |")]
    assert len(rows) == 2 and "(GPipe even)" in rows[0] and "(1F1B even)" in rows[1], rows


def test_host_memory_both_runs_each_system_with_and_without_keeping_freed_memory(bench, monkeypatch, tmp_path, capsys):
    runs = []

    def fake_torch(kind, P, M, layers, args, data_file, work, cores, keep=False):
        runs.append(("torch", kind, keep))
        return {"tokens_per_s": 10.0 + keep, "step_s": [1.0, 1.0], "loss": [4.0, 3.9], "loss1": 4.0}

    def fake_project(schedule, P, M, args, work, cores, extra=()):
        runs.append(("project", schedule, tuple(extra)))
        return {"tokens_per_s": 12.0, "idle_share": 0.5, "bubble_share": 0.3, "collective_share": 0.1,
                "loss": [4.0, 3.9], "loss1": 4.0, "split": [[0, 4], [4, 6]]}

    out = _stub_runs(bench, monkeypatch, tmp_path, fake_torch, fake_project)
    assert bench.main(["--P", "2", "--M", "8", "--rounds", "1", "--model", "x", "--project-schedules", "zb-h2",
                       "--torch-schedules", "1F1B", "--splits", "even", "--host-memory", "both",
                       "--json", str(out)]) == 0
    assert sorted(runs) == sorted([("project", "zb-h2", ()), ("project", "zb-h2", ("runtime.keep_host_memory=false",)),
                                   ("torch", "1F1B", False), ("torch", "1F1B", True)])
    res = json.loads(out.read_text())
    names = {e["system"]: e for e in res["summary"]}
    assert set(names) == {"npu-train zb-h2", "npu-train zb-h2 [keep=false]", "torch 1F1B even", "torch 1F1B even [keep]"}
    # the baseline stays torch as a user runs it; the fastest torch entry may be the [keep] one
    assert names["npu-train zb-h2"]["baseline"] == "torch 1F1B even"
    assert names["npu-train zb-h2"]["vs_baseline"] == 12.0 / 10.0 and names["npu-train zb-h2"]["vs_best_torch"] == 12.0 / 11.0


def test_work_line_bounds_the_ratio_by_the_baselines_own_work(bench, tmp_path, capsys):
    """The work line: the baseline's CPU seconds per step (steps 2..N, summed over cards) spread evenly over P
    cards with no idle is the fastest any system doing that work can step; figures worked out by hand here.
    ``--resummarize`` prints the same from a saved results file."""
    base = {"P": 2, "M": 8, "system": "torch 1F1B even", "round": 0, "tokens_per_s": 2048 / 20.625,
            "loss": [4.0, 3.9], "loss1": 4.0,
            "phases": [[{"cpu_phases_s": c} for c in ([10, 1, 1], [12, 0, 0], [11, 0, 1])],   # rank 0
                       [{"cpu_phases_s": c} for c in ([20, 0, 2], [21, 0, 1], [19, 1, 0])]]}  # rank 1
    # steps 2 and 3: 12 + 22 = 34 and 12 + 20 = 32 card-s -> median 33 -> 16.5 s a step on 2 cards
    proj = {"P": 2, "M": 8, "system": "npu-train auto", "round": 0, "tokens_per_s": 2048 / 17.0,
            "loss": [4.0, 3.9], "loss1": 4.0, "idle_share": 0.03,
            "metrics": [{"cpu_s_cards": c} for c in ([1, 1], [17, 17], [16.5, 16.5])]}  # 34, 33 -> 33.5
    assert bench.step_work_s(base) == [34, 32] and bench.step_work_s(proj) == [34, 33]
    bench.summarize([base, proj], SimpleNamespace(seq_len=256))
    line = [l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("work:")]
    assert line == ["  work: torch 1F1B even 33.0 card-s a step; spread evenly over 2 cards with no idle: 16.5 s a "
                    "step against its 20.6 s, so 1.25x is the most any schedule or split of the same work can reach; "
                    "work of the others relative to it: npu-train auto 1.015"], line

    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"args": {"seq_len": 256}, "results": [base, proj]}))
    assert bench.main(["--resummarize", str(saved)]) == 0
    assert "1.25x is the most any schedule or split" in capsys.readouterr().out
    no_figures = {k: v for k, v in base.items() if k != "phases"}  # an older results file: no work line
    bench.summarize([no_figures, proj], SimpleNamespace(seq_len=256))
    assert "work:" not in capsys.readouterr().out
