"""Figures fitted from finished runs (``planner.fit`` + ``planner.rates.apply_fitted``): a run dir built
from formulas (known FLOPs, parameters and seconds) gives back the rates it was built with; the last
runs are combined by median; a broken file is one warning line; placement.profile takes precedence."""
from __future__ import annotations

import json

import pytest

from npu_train.hardware import GIB
from npu_train.planner.fit import KEEP_RUNS, RunFigures, record_run, refit_from_run, run_figures
from npu_train.planner.rates import DEFAULT_RATES, Rates, apply_fitted, load_rates

FLOPS = (6e11, 4e11)           # the plan's FLOPs per step of each stage
PARAMS = (1.0e8, 0.6e8)        # parameters each stage's optimizer updates per step
R_PLAN, R_TRUE = 50e9, 20e9    # FLOP/s the plan used / the cards ran at
A_PLAN, A_TRUE = 2e8, 5e7      # AdamW params/s (one process, before the core share)
SHARE = 0.5                    # 1 host core for 2 cpu cards of 1 thread: each gets half
BASE, TOTAL = 0.35 * GIB, (2.5 * GIB, 1.6 * GIB)  # the baseline the plans below were made with
UNFITTED = 0.15 * GIB  # the cpu default (planner/rates.py: a card process's RSS before its load)
PEAK_OVER = (0.05 * GIB, -0.1 * GIB)  # measured peak - planned total per stage


def plan_doc() -> dict:
    stages = []
    for i in range(2):
        stages.append({"card": f"cpu:{i}", "mem": {"baseline": BASE, "total": TOTAL[i]},
                       "time": {"compute": FLOPS[i] / R_PLAN, "device_optimizer": PARAMS[i] / (A_PLAN * SHARE),
                                "host_optimizer": 0.0, "host_hidden": 0.0}})
    return {"model": "m", "shape": {"dtype": "fp32"}, "dp": 1, "threads": 1, "host_cores": 1,
            "step_time_s": 42.5, "stages": stages}


def records(pred: float = 42.5, first_slow: float = 10.0) -> list[dict]:
    out = [{"step": 0, "step_s_pred": 99.0, "compute_s_cards": [1e-3, 1e-3], "compute_s": 1e-3,
            "optimizer_s": 1e-3, "mem_peak_bytes": [1, 1]}]  # an earlier launch's record (other plan)
    for step, jitter in ((1, first_slow), (2, 1.0), (3, 1.1), (4, 0.9)):
        cards = [FLOPS[i] / R_TRUE * jitter for i in range(2)]
        out.append({"step": step, "step_s_pred": pred, "compute_s_cards": cards, "compute_s": cards[0],
                    "optimizer_s": PARAMS[0] / (A_TRUE * SHARE) * jitter,
                    "mem_peak_bytes": [int(TOTAL[i] + PEAK_OVER[i]) for i in range(2)]})
    return out


def used_rates() -> list[Rates]:
    """What Plan.rates holds: resolved rates, AdamW already times the core share."""
    return [Rates(device_flops=R_PLAN, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10,
                  host_adamw_params_per_s=A_PLAN * SHARE)] * 2


def write_run(d, doc=None, recs=None):
    d.mkdir(parents=True)
    (d / "plan.json").write_text(json.dumps(doc or plan_doc()))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (recs or records())))
    return d


def test_one_run_gives_back_the_rates_it_was_built_with():
    (fig,) = run_figures(plan_doc(), records(), used_rates())
    # steady steps 2-4 (jitter 1.0, 1.1, 0.9): the median is the true rate; step 1 (10x) is skipped
    assert fig.device_flops == pytest.approx(R_TRUE, rel=1e-9)
    assert fig.adamw_params_per_s == pytest.approx(A_TRUE, rel=1e-9)
    # stage 0 went 0.05 GiB over its plan: the baseline that covers it, never lowered by stage 1
    assert fig.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0], abs=1)
    assert (fig.kind, fig.threads, fig.dtype, fig.steps) == ("cpu", 1, "fp32", 3)


def test_a_finished_run_dir_refits_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    refit_from_run(str(write_run(tmp_path / "run")), used_rates())
    r = load_rates("cpu", threads=1)
    flat = r.resolve("fp32", 1)
    assert flat.device_flops == pytest.approx(R_TRUE) and flat.source("device_flops") == "fitted from 1 run"
    assert r.host_adamw_params_per_s == pytest.approx(A_TRUE) and r.device_adamw == pytest.approx(A_TRUE)
    assert r.source("host_adamw_params_per_s") == "fitted from 1 run"
    assert r.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0], abs=1)
    # bf16 was not fitted: its figure stays assumed
    assert load_rates("cpu", threads=1).resolve("bf16", 1).source("device_flops").startswith("assumed")
    # another thread count has no fitted figures
    assert load_rates("cpu", threads=2).source("device_flops") == "assumed"


def test_a_run_returning_freed_memory_keeps_only_its_baseline(tmp_path, monkeypatch):
    """runtime.keep_host_memory=false runs are slower than the default (page faults): their speed must not
    be fitted into the default's plans, their memory baseline is."""
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    refit_from_run(str(write_run(tmp_path / "run")), used_rates(), timing=False)
    r = load_rates("cpu", threads=1)
    assert r.resolve("fp32", 1).source("device_flops").startswith("assumed")
    assert r.source("host_adamw_params_per_s") == "assumed"
    assert r.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0], abs=1)


def test_the_newest_runs_are_combined_by_median(tmp_path):
    rates = [10e9 * (k + 1) for k in range(KEEP_RUNS + 3)]
    for k, v in enumerate(rates):
        record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=v, time=float(k)), root=tmp_path)
    base = DEFAULT_RATES["cpu"].resolve(threads=1)
    out = apply_fitted(base, "cpu", 1, root=tmp_path)
    newest = sorted(rates)[-KEEP_RUNS:]
    want = (newest[KEEP_RUNS // 2 - 1] + newest[KEEP_RUNS // 2]) / 2
    assert out.flops_by_dtype["fp32"] == pytest.approx(want)
    assert out.resolve("fp32", 1).source("device_flops") == f"fitted from {KEEP_RUNS} runs"


def test_a_lower_baseline_is_not_applied(tmp_path):
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, process_baseline_bytes=0.1 * GIB), root=tmp_path)
    out = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path)
    assert out.process_baseline_bytes == DEFAULT_RATES["cpu"].process_baseline_bytes
    assert out.source("process_baseline_bytes") == "assumed"


def test_a_broken_file_is_one_warning_line(tmp_path, capsys):
    bad = tmp_path / "fitted" / "cpu-1t-fp32.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    out = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path / "fitted")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and out.flops_by_dtype == {}
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=7e9), root=tmp_path / "fitted")  # starts again
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1,
                        root=tmp_path / "fitted").flops_by_dtype == {"fp32": 7e9}


def test_fitting_never_fails_the_run(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    (d / "plan.json").write_text("[]")
    refit_from_run(str(d), used_rates())  # no metrics.jsonl, a plan.json of the wrong shape
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: figures not fitted from {d}")


def test_an_explicit_profile_wins_over_fitted_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    refit_from_run(str(write_run(tmp_path / "run")), used_rates())
    prof = tmp_path / "mine.json"
    prof.write_text(json.dumps({"rates": {"device_flops": 33e9, "threads": 1}}))
    r = load_rates("cpu", prof, threads=1).resolve("fp32", 1)
    assert r.device_flops == 33e9 and r.source("device_flops") == "measured"
    # the calibration profile in the cache (calibrate=true) ranks below the fitted figures
    (tmp_path / "cache" / "calibration").mkdir(parents=True)
    (tmp_path / "cache" / "calibration" / "cpu.json").write_text(prof.read_text())
    assert load_rates("cpu", threads=1).resolve("fp32", 1).device_flops == pytest.approx(R_TRUE)


def test_figures_are_kept_and_used_per_model_shape(tmp_path):
    """A tiny test model's run must not move a real model's plan: runs count only for their own
    shape_key (model dims + tokens per micro-batch), and another shape's runs do not push them out."""
    from npu_train.model.config import LlamaConfig
    from npu_train.planner.fit import shape_key

    big = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3)
    tiny = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=176, num_layers=6, num_heads=4,
                       num_kv_heads=2)
    kb, kt = shape_key(big, 256), shape_key(tiny, 64)
    assert kb == "h576-i1536-L30-a9/3-d64-v49152-t256" and kb != shape_key(big, 64)
    record_run(RunFigures("cpu", 1, "fp32", "big", 3, device_flops=40e9, time=1.0, model_shape=kb), root=tmp_path)
    for k in range(KEEP_RUNS + 2):  # many later runs of the tiny model
        record_run(RunFigures("cpu", 1, "fp32", "tiny", 3, device_flops=2e9, time=2.0 + k, model_shape=kt),
                   root=tmp_path)
    base = DEFAULT_RATES["cpu"].resolve(threads=1)
    assert apply_fitted(base, "cpu", 1, root=tmp_path, model_shape=kb).flops_by_dtype["fp32"] == 40e9
    base = DEFAULT_RATES["cpu"].resolve(threads=1)
    assert apply_fitted(base, "cpu", 1, root=tmp_path, model_shape=kt).flops_by_dtype["fp32"] == 2e9
    base = DEFAULT_RATES["cpu"].resolve(threads=1)
    other = apply_fitted(base, "cpu", 1, root=tmp_path, model_shape="h1-i1-L1-a1/1-d1-v1-t1")
    assert "fp32" not in other.flops_by_dtype or other.resolve("fp32", 1).source("device_flops").startswith("assumed")


def _head_run(head_peak: float, head_run_peak: float, b1: float) -> tuple[dict, list[dict]]:
    """The two-card run with the head card (stage 1) planned at 10.57 GiB with baseline ``b1``: its step peak and
    its every-phase peak (the load's included), bytes."""
    doc = plan_doc()
    doc["stages"][1]["mem"].update(total=10.57 * GIB, baseline=b1)
    recs = records()
    for r in recs[1:]:
        r["mem_peak_bytes"] = [int(TOTAL[0] + PEAK_OVER[0]), int(head_peak)]
        r["mem_run_peak_bytes"] = [int(TOTAL[0] + PEAK_OVER[0]), int(head_run_peak)]
    return doc, recs


def test_the_head_card_fits_its_own_baseline_to_its_peak_over_0_95(tmp_path):
    """One fitted baseline for every card raised the head card's plan by another card's shortfall (a 0.63 B
    run: 10.57 GiB planned against an 8.61 GiB peak, 0.81). The last stage fits its own: the baseline under which
    its plan is its measured peak (every phase, the load's included) / 0.95; applied, like every card's, only
    where it is larger than the unfitted baseline; the other cards keep their own figure."""
    B1 = 1.6 * GIB  # the run planned its head with a baseline fitted earlier, raised by card 0's shortfall
    doc, recs = _head_run(8.50 * GIB, 8.61 * GIB, B1)  # the load peaked higher than the steps
    (fig,) = run_figures(doc, recs, used_rates())
    assert fig.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0], abs=1)  # card 0's, as before
    head = B1 + 8.61 * GIB / 0.95 - 10.57 * GIB
    assert head > 0 and fig.head_baseline_bytes == pytest.approx(head, abs=1)
    record_run(fig, root=tmp_path)
    resolved = DEFAULT_RATES["cpu"].resolve(threads=1)
    on_head = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path, head=True)
    other = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path)
    assert other.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0], abs=1)
    # below the unfitted baseline: not applied (the head keeps it, not card 0's raised one)
    assert head < resolved.process_baseline_bytes == on_head.process_baseline_bytes
    assert on_head.source("process_baseline_bytes") == "assumed"
    # a head that peaked at 9.9 GiB: its figure is above the unfitted one, applied; the next plan (same terms,
    # its baseline swapped) has peak / plan = 0.95, never above 1
    doc, recs = _head_run(9.9 * GIB, 9.9 * GIB, B1)
    (fig,) = run_figures(doc, recs, used_rates())
    record_run(fig, root=tmp_path / "b")
    on_head = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path / "b", head=True)
    assert on_head.process_baseline_bytes == pytest.approx(B1 + 9.9 * GIB / 0.95 - 10.57 * GIB, abs=1)
    assert on_head.source("process_baseline_bytes") == "fitted from 1 run (head card)"
    plan_next = 10.57 * GIB - B1 + on_head.process_baseline_bytes
    assert 9.9 * GIB / plan_next == pytest.approx(0.95, rel=1e-6)


def test_an_over_counted_run_never_plans_below_the_unfitted_baseline(tmp_path):
    """The MoE done-when run (experiments/2026-12-06-moe.md): both cards planned with the default 0.35 GiB
    baseline, cpu:0 at 10.32 GiB and the head card cpu:1 at 10.58, peaked at 9.59 and 9.63 GiB (the load at 8.76
    and 8.72): the other terms over-counted by 0.73 and 0.95 GiB. The baselines under which the plans would have
    held the peaks are 0.35 + 9.59 - 10.32 = -0.38 GiB and 0.35 + 9.63 / 0.95 - 10.58 = -0.09 GiB: no process
    holds negative memory, so the figures are 0, and the next plan of either card keeps the unfitted baseline
    (the resumed run had planned cpu:1 with 0, at 10.23 GiB)."""
    doc = plan_doc()
    for i, total in enumerate((10.32, 10.58)):
        doc["stages"][i]["mem"].update(total=total * GIB, baseline=BASE)
    recs = records()
    for r in recs[1:]:
        r["mem_peak_bytes"] = [int(9.59 * GIB), int(9.63 * GIB)]
        r["mem_run_peak_bytes"] = [int(9.59 * GIB), int(9.63 * GIB)]
    (fig,) = run_figures(doc, recs, used_rates())
    assert fig.process_baseline_bytes == 0.0 and fig.head_baseline_bytes == 0.0
    record_run(fig, root=tmp_path)
    for head in (False, True):
        out = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path, head=head)
        assert out.process_baseline_bytes == UNFITTED
        assert out.source("process_baseline_bytes") == "assumed"


def test_load_rates_gives_the_head_card_its_own_fitted_baseline():
    """``load_rates(head=True)`` (the last card of ``runtime/job.py::plan_request``) reads the head's figure from
    ``$NPT_CACHE/fitted``; the other cards the general one; each only above the unfitted baseline."""
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, process_baseline_bytes=0.6 * GIB, head_baseline_bytes=0.5 * GIB))
    assert load_rates("cpu", threads=1, head=True).process_baseline_bytes == 0.5 * GIB
    assert load_rates("cpu", threads=1).process_baseline_bytes == 0.6 * GIB
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, process_baseline_bytes=0.6 * GIB, head_baseline_bytes=0.0))
    assert load_rates("cpu", threads=1, head=True).process_baseline_bytes == 0.5 * GIB  # the maximum over runs


def test_a_loaded_host_fits_the_cards_cpu_seconds_not_its_wall_clock(tmp_path):
    """Cards report the CPU seconds of their compute (``compute_cpu_s_cards``). A host loaded by other
    processes stretches the wall clock LOAD times; the CPU seconds of the same work do not change. The fit
    takes min(wall, cpu / core share): 2 cards of 1 thread on 1 core (share 0.5) take cpu / 0.5 on
    an unloaded host, so the true rates come back, and the optimizer's seconds are scaled like the compute's."""
    LOAD = 3.0
    recs = records()
    for r in recs[1:]:
        jitter = r["compute_s_cards"][0] / (FLOPS[0] / R_TRUE)
        r["compute_cpu_s_cards"] = [FLOPS[i] / R_TRUE * jitter * SHARE for i in range(2)]
        r["compute_s_cards"] = [c * LOAD for c in r["compute_s_cards"]]
        r["compute_s"] = r["compute_s_cards"][0]
        r["optimizer_s"] *= LOAD
    (fig,) = run_figures(plan_doc(), recs, used_rates())
    assert fig.device_flops == pytest.approx(R_TRUE, rel=1e-9)
    assert fig.adamw_params_per_s == pytest.approx(A_TRUE, rel=1e-9)
    assert fig.clock == "cpu"
    # the wall clock alone (older cards) learns the load: LOAD x slower
    for r in recs:
        r.pop("compute_cpu_s_cards", None)
    (wall,) = run_figures(plan_doc(), recs, used_rates())
    assert wall.device_flops == pytest.approx(R_TRUE / LOAD, rel=1e-9) and wall.clock == "wall"


def test_several_threads_fit_the_computing_threads_cpu_seconds_undivided():
    """At 2 torch threads per card (2 cards on 4 cores: share 1) with passive OpenMP waits, a card reports its
    computing thread's CPU seconds: its serial part and its half of each parallel region, the seconds an
    unloaded host's wall clock takes. On a host loaded LOAD x the fit gives the true rate back; dividing them
    by the threads (the process's CPU time, before) fitted twice the rate."""
    LOAD = 3.0
    doc = plan_doc()
    doc.update(threads=2, host_cores=4)
    recs = records()
    for r in recs[1:]:
        r["compute_cpu_s_cards"] = list(r["compute_s_cards"])  # the unloaded wall: the thread's own seconds
        r["compute_s_cards"] = [c * LOAD for c in r["compute_s_cards"]]
        r["compute_s"] = r["compute_s_cards"][0]
    (fig,) = run_figures(doc, recs, used_rates())
    assert fig.device_flops == pytest.approx(R_TRUE, rel=1e-9) and fig.clock == "cpu"
    assert fig.threads == 2


def test_cpu_clock_runs_replace_older_wall_clock_runs_in_the_fit():
    """Runs fitted from the wall clock (older entries, ``clock`` absent) hold their host's load: once a run
    fitted from CPU seconds is in the file, the FLOP/s and AdamW figures come from such runs alone; the
    memory baseline still from every run."""
    from npu_train.planner.fit import fitted_figures

    old = [{"device_flops": 5e9, "adamw_params_per_s": 1e7, "process_baseline_bytes": 3.0, "time": t}
           for t in (1, 2, 3)]
    new = {"device_flops": 8e10, "adamw_params_per_s": 2e8, "process_baseline_bytes": 1.0, "time": 4,
           "clock": "cpu"}
    fit = fitted_figures(old + [new])
    assert (fit.device_flops, fit.flops_runs, fit.adamw_params_per_s) == (8e10, 1, 2e8)
    assert (fit.process_baseline_bytes, fit.baseline_runs) == (3.0, 4)
    assert fitted_figures(old).device_flops == 5e9


def _loaded(recs: list[dict], load: float, cores: int = 2) -> list[dict]:
    """``recs`` with every step's ``host_load`` sample at ``load`` on ``cores`` (Reporter.step's field)."""
    for r in recs:
        r["host_load"] = [load, cores]
    return recs


@pytest.mark.parametrize("load,cores,own,busy", [
    (2.9, 2, 2, False), (3.0, 2, 2, True),    # threads within the cores: busy from 1.5 per core, 3.0
    (2.9, 2, 0, False), (3.0, 2, 0, True),    # own threads unknown: one per core, the slow-steps note's rule
    (4.9, 2, 4, False), (5.0, 2, 4, True),    # 4 threads of its own on 2 cores: 4 + 0.5 x 2 = 5.0
    (0.0, 1, 1, False), (1.5, 1, 1, True)])
def test_a_host_is_busy_from_half_a_core_of_other_work_per_core(load, cores, own, busy):
    """busy when load - max(cores, own threads) >= (1.5 - 1) x cores (hardware.host_busy)."""
    from npu_train.hardware import host_busy

    assert host_busy(load, cores, own) is busy


def test_a_run_records_its_load_and_whether_the_host_was_busy():
    """The median of the steady steps' samples (steps 2-4), the first step's left out; 2 cpu cards of 1 thread
    (own 2) on 2 cores: 3.2 is busy (3.2 - 2 >= 1), 2.8 is not."""
    recs = _loaded(records(), 2.8)
    for r, load in zip(recs[1:], (9.0, 3.4, 3.2, 3.0)):  # step 1 (start-up) at 9.0
        r["host_load"] = [load, 2]
    (fig,) = run_figures(plan_doc(), recs, used_rates())
    assert (fig.load_avg, fig.host_cores, fig.busy) == (3.2, 2, True)
    (quiet,) = run_figures(plan_doc(), _loaded(records(), 2.8), used_rates())
    assert (quiet.load_avg, quiet.busy) == (2.8, False)
    # no samples (an OS without a load average): not known
    (unknown,) = run_figures(plan_doc(), records(), used_rates())
    assert (unknown.load_avg, unknown.host_cores, unknown.busy) == (None, None, None)


def test_a_busy_run_is_recorded_but_its_speed_is_not_fitted(tmp_path, monkeypatch, capsys):
    """A quiet run at the true rates, then one on a host at load 6 on 2 cores whose cards ran 3x slower (the wall
    clock only: no CPU seconds). The plan keeps the quiet run's rates and says the busy one was skipped; the busy
    run's entry is in the file with its load, its memory baseline counts (0.2 GiB higher, the fitted maximum);
    the end-of-run note says why its speed was not used."""
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    assert refit_from_run(str(write_run(tmp_path / "quiet", recs=_loaded(records(), 1.0))), used_rates()) == ""
    slow = _loaded(records(), 6.0)
    for r in slow[1:]:
        r["compute_s_cards"] = [c * 3 for c in r["compute_s_cards"]]
        r["compute_s"], r["optimizer_s"] = r["compute_s_cards"][0], r["optimizer_s"] * 3
        r["mem_peak_bytes"][0] += int(0.2 * GIB)
    note = refit_from_run(str(write_run(tmp_path / "busy", recs=slow)), used_rates())
    assert note == ("fitted: not this run's speed, the host was busy with other work (load average 6.0 on 2 cores, "
                    "this job keeps about 2 busy); later plans keep their rates"), note
    with open(tmp_path / "cache" / "fitted" / "cpu-1t-fp32.json") as f:
        entries = json.load(f)["runs"]
    assert [(e["busy"], e["load_avg"], e["host_cores"]) for e in entries] == [(False, 1.0, 2), (True, 6.0, 2)]
    assert entries[1]["device_flops"] == pytest.approx(R_TRUE / 3)  # recorded as measured
    r = load_rates("cpu", threads=1)
    flat = r.resolve("fp32", 1)
    assert flat.device_flops == pytest.approx(R_TRUE)
    assert flat.source("device_flops") == "fitted from 1 run; 1 busy run skipped"
    assert r.host_adamw_params_per_s == pytest.approx(A_TRUE)
    assert r.source("host_adamw_params_per_s") == "fitted from 1 run; 1 busy run skipped"
    assert r.process_baseline_bytes == pytest.approx(BASE + PEAK_OVER[0] + 0.2 * GIB, abs=1)
    assert capsys.readouterr().err == ""


def test_only_busy_runs_fit_no_speed_and_the_rates_line_says_so(tmp_path):
    """Two busy runs and nothing else: the speed stays the unfitted one and the plan's rates line says that two
    busy runs were skipped; with a quiet run besides, the fitted figure's label counts them."""
    from npu_train.planner.table import rate_sources

    for t in (1.0, 2.0):
        record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=5e9, adamw_params_per_s=1e7, time=t,
                              clock="cpu", load_avg=7.0, host_cores=2, busy=True), root=tmp_path)
    base = DEFAULT_RATES["cpu"].resolve(threads=1)
    out = apply_fitted(base, "cpu", 1, root=tmp_path)
    assert out.flops_by_dtype == {} and out.source("host_adamw_params_per_s") == "assumed"
    plan = _cpu_plan(out)
    (line,) = [ln for ln in rate_sources(plan) if ln.startswith("rates cpu")]
    assert "speed not fitted: 2 busy runs skipped" in line and "busy = run at a load average of 1.5/core" in line
    assert "fitted from" not in line, line
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=8e10, adamw_params_per_s=2e8, time=3.0,
                          clock="cpu", load_avg=1.0, host_cores=2, busy=False), root=tmp_path)
    out = apply_fitted(DEFAULT_RATES["cpu"].resolve(threads=1), "cpu", 1, root=tmp_path)
    (line,) = [ln for ln in rate_sources(_cpu_plan(out)) if ln.startswith("rates cpu")]
    assert "80 GFLOP/s [fitted from 1 run; 2 busy runs skipped]" in line, line
    assert "speed not fitted" not in line and "fitted = from this job's finished runs" in line, line


def _cpu_plan(rates):
    from npu_train.hardware import make_cards
    from npu_train.model.presets import get_preset
    from npu_train.planner import PlanRequest, RunShape, make_plan

    shape = RunShape(seq_len=128, micro_batch=2, micro_batches=4, dtype="fp32")
    return make_plan(PlanRequest(get_preset("smollm2-135m"), shape, make_cards("cpu", 1, 11 * GIB), rates,
                                 threads=1, host_cores=2))


def test_entries_from_before_the_load_samples_count_as_not_busy(tmp_path):
    """An entry without ``busy`` / ``load_avg`` (written before them) is not known to be busy and counts, as it
    did; a file of such entries takes a new busy entry without losing them."""
    from npu_train.planner.fit import fitted_figures

    old = {"kind": "cpu", "threads": 1, "dtype": "fp32", "model": "m", "steps": 3, "device_flops": 3e10,
           "adamw_params_per_s": 1e8, "time": 1.0, "clock": "cpu"}
    path = tmp_path / "cpu-1t-fp32.json"
    path.write_text(json.dumps({"version": 1, "kind": "cpu", "threads": 1, "dtype": "fp32", "runs": [old]}))
    record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=5e9, time=2.0, clock="cpu", load_avg=8.0,
                          host_cores=2, busy=True), root=tmp_path)
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 2 and "busy" not in runs[0]
    fit = fitted_figures(runs)
    assert (fit.device_flops, fit.flops_runs, fit.busy_runs) == (3e10, 1, 1)


def test_busy_runs_never_push_the_quiet_ones_out_of_the_file(tmp_path):
    """KEEP_RUNS + 2 busy runs after KEEP_RUNS quiet ones: the file keeps both groups' newest KEEP_RUNS, so the
    fit still has the quiet runs' median."""
    from npu_train.planner.fit import fitted_figures, fitted_path, read_runs

    for k in range(KEEP_RUNS):
        record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=4e10, time=float(k), clock="cpu",
                              busy=False), root=tmp_path)
    for k in range(KEEP_RUNS + 2):
        record_run(RunFigures("cpu", 1, "fp32", "m", 3, device_flops=1e10, time=100.0 + k, clock="cpu",
                              busy=True), root=tmp_path)
    runs = read_runs(fitted_path("cpu", 1, "fp32", tmp_path))
    assert len(runs) == 2 * KEEP_RUNS
    fit = fitted_figures(runs)
    assert (fit.device_flops, fit.flops_runs, fit.busy_runs) == (4e10, KEEP_RUNS, KEEP_RUNS)
