"""A finished run refits the figures the next plan uses (``planner.fit``): before it the rates are
assumed, after one finished tiny run the next ``plan=true`` says ``[fitted from 1 run]`` (on a host busy with
other work: that the run was skipped, and the run's last lines say why); the removed ``placement.calibrate``
key is one error line naming ``calibrate=true``."""
from __future__ import annotations

import json
import os

from conftest import launch_to_end
from npu_train.errors import error_lines


def _rates_line(job) -> str:
    return job.stdout_line("rates cpu")


def test_the_next_plan_uses_figures_fitted_from_a_finished_run(tiny_model, tmp_path):
    before = _rates_line(launch_to_end(tmp_path, tiny_model, "plan=true", name="before"))
    assert "GFLOP/s [one layer of this model, b=2 S=32, timed here; no run fitted yet]" in before, before
    assert "fitted from" not in before
    run = launch_to_end(tmp_path, tiny_model, "train.steps=3", "checkpoint.save=false", name="run")
    path = os.path.join(os.environ["NPT_CACHE"], "fitted", "cpu-1t-fp32.json")
    assert os.path.isfile(path), run.tail()
    with open(path) as f:
        (entry,) = json.load(f)["runs"]
    after = _rates_line(launch_to_end(tmp_path, tiny_model, "plan=true", name="after"))
    if entry["busy"]:  # a host loaded by other work (a shared test machine): recorded, its speed not fitted
        assert "fitted: not this run's speed, the host was busy with other work" in run.flat_stdout, run.tail()
        assert "speed not fitted: 1 busy run skipped" in after and "fitted from" not in after, after
        return
    assert entry["busy"] is False and entry["load_avg"] is not None, entry  # sampled every step
    assert "fitted: not this run's speed" not in run.flat_stdout, run.tail()
    assert "[fitted from 1 run]" in after.split("compute ", 1)[1].split(",", 1)[0], after
    assert "host AdamW" in after and "fitted = from this job's finished runs" in after


def test_placement_calibrate_is_gone_with_a_pointer_to_calibrate_true(tiny_model, tmp_path):
    job = launch_to_end(tmp_path, tiny_model, "plan=true", "placement.calibrate=auto", name="old", expect_rc=2)
    err = error_lines(job.stderr)
    assert len(err) == 1 and "calibrate=true" in err[0], job.stderr


def test_the_users_malloc_settings_keep_the_heap_term_and_fit_no_speed(tiny_model, tmp_path):
    """Card processes keep the user's own MALLOC_* settings (npu_train.hostmem), which may keep freed memory
    whatever runtime.keep_host_memory says: the plan then counts the heap's holes (a 1 GiB threshold with
    keep_host_memory=false went 15 MB over a plan without them), and the run's speed is not fitted."""
    mine = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str((1 << 31) - 1)}

    def memory_line(job) -> str:
        return job.stdout_line("memory cpu")

    returned = memory_line(launch_to_end(tmp_path, tiny_model, "plan=true", "runtime.keep_host_memory=false",
                                         name="returned"))
    assert "no freed memory kept (runtime.keep_host_memory=false" in returned, returned
    users = memory_line(launch_to_end(tmp_path, tiny_model, "plan=true", "runtime.keep_host_memory=false",
                                      name="users", env=mine))
    assert "freed memory the heap keeps, at most" in users and "no freed memory" not in users, users
    run = launch_to_end(tmp_path, tiny_model, "train.steps=3", "checkpoint.save=false", name="run", env=mine)
    with open(os.path.join(os.environ["NPT_CACHE"], "fitted", "cpu-1t-fp32.json")) as f:
        (entry,) = json.load(f)["runs"]
    assert entry["device_flops"] is None and entry["adamw_params_per_s"] is None, run.tail()
    assert entry["process_baseline_bytes"], entry


def test_a_card_at_two_threads_reports_its_computing_threads_cpu_seconds(tiny_model, tmp_path):
    """A cpu card at runtime.threads=2 runs with passive OpenMP waits (hostmem.card_wait_env) and reports
    the CPU seconds of the thread that computes (pipeline.stage.work_clock), which the fit takes undivided: at
    most the compute's wall seconds. With spinning waits it reported none (nothing to fit from but the wall)."""
    from conftest import run_pipeline

    run = str(tmp_path / "t2")
    run_pipeline(tiny_model, run, "backend=[cpu]", "runtime.threads=2", "train.steps=2", "checkpoint.save=false")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    assert len(recs) == 2
    for r in recs:
        (cpu,), (wall,) = r["compute_cpu_s_cards"], r["compute_s_cards"]
        assert 0 < cpu <= wall + 1e-3, r
