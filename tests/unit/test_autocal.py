"""Automatic first-run calibration (``planner.autocal``): when it measures, what it measures with
which loop bounds, cache reuse, corrupt and concurrent caches, and the sources the plan prints.

Measurements run in quick mode (tiny sizes); no test times anything."""
from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os

import pytest

from npu_train.errors import ConfigError
from npu_train.planner import autocal, load_rates, make_cards, make_plan, measure, splitcost
from npu_train.planner.autocal import (
    AUTO_ADAMW_PARAMS,
    calibrate_mode,
    ensure_profile,
    here_fingerprint,
    measure_for_job,
    profile_status,
)
from npu_train.planner.loadgen import BackgroundLoad
from npu_train.planner.measure import AUTO, LoopBounds
from npu_train.planner.spec import RunShape

from test_calibrate import tiny


@pytest.fixture(autouse=True)
def _auto(monkeypatch, tmp_path):
    """The suite sets NPT_CALIBRATE=never (tests/conftest.py); these tests use the real default,
    with a cache of their own."""
    monkeypatch.delenv("NPT_CALIBRATE", raising=False)
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))


def _quick(path, threads=1, mode="auto", log=None):
    lines = []
    res = ensure_profile("cpu", None, threads=threads, dtype="fp32", mode=mode, quick=True,
                         path=path, log=log or lines.append)
    return res, lines


def test_first_call_measures_and_caches_then_reuses(tmp_path):
    path = tmp_path / "cal" / "cpu.json"
    res, lines = _quick(path)
    assert res["calibrated"] and path.is_file()
    assert len(lines) == 1 and lines[0].startswith("calibrating cpu (first run on this machine, ~")
    assert f"cached in {path})" in lines[0]
    doc = json.loads(path.read_text())
    assert doc["rates"]["threads"] == 1 and doc["details"]["quick"] is True
    assert doc["machine"]["cpu_flags"] == here_fingerprint("cpu")["cpu_flags"]
    before = path.stat().st_mtime_ns
    res2, lines2 = _quick(path)
    assert not res2["calibrated"] and lines2 == [] and path.stat().st_mtime_ns == before
    # never: nothing measured even without a profile
    res3, lines3 = _quick(tmp_path / "other.json", mode="never")
    assert not res3["calibrated"] and lines3 == [] and not (tmp_path / "other.json").exists()


def test_always_measures_again(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path)
    res, lines = _quick(path, mode="always")
    assert res["calibrated"] and "placement.calibrate=always" in lines[0]


def test_corrupt_profile_is_measured_again_with_a_warning(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text('{"version": 1, "rates": {"device_flops": 1e1')  # torn write
    assert profile_status(path, "cpu", 1, "fp32", quick=True)[0] == "corrupt"
    res, lines = _quick(path)
    assert res["calibrated"]
    assert lines[0].startswith(f"warning: calibration profile {path}: unreadable profile")
    assert "measuring it again" in lines[0] and lines[1].startswith("calibrating cpu")
    assert load_rates("cpu", path).device_flops > 0  # readable again


def test_another_machine_or_torch_replaces_the_profile(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path)
    doc = json.loads(path.read_text())
    doc["machine"]["torch"] = "1.0.0"
    doc["rates"]["by_threads"] = {"4": {"device_flops": 1.0}}
    path.write_text(json.dumps(doc))
    status, why = profile_status(path, "cpu", 1, "fp32", quick=True)
    assert status == "stale" and "torch 1.0.0 !=" in why
    res, lines = _quick(path)
    assert res["calibrated"] and "machine changed: torch 1.0.0" in lines[0]
    new = json.loads(path.read_text())
    assert new["machine"]["torch"] != "1.0.0" and new["rates"]["by_threads"] == {}  # replaced
    # a full profile does not satisfy a quick run and vice versa; flags are compared too
    doc = json.loads(path.read_text())
    doc["machine"]["cpu_flags"] = "000000000000"
    path.write_text(json.dumps(doc))
    assert "cpu_flags 000000000000 !=" in profile_status(path, "cpu", 1, "fp32", quick=True)[1]


def test_a_new_thread_count_is_merged_into_this_machines_profile(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path, threads=1)
    one = load_rates("cpu", path)
    status, why = profile_status(path, "cpu", 2, "fp32", quick=True)
    assert (status, why) == ("partial", "no figures for 2 thread(s)")
    res, lines = _quick(path, threads=2)
    assert res["calibrated"] and "no figures for 2 thread(s)" in lines[0]
    both = load_rates("cpu", path)
    assert both.threads == 2 and set(both.by_threads) == {1}  # top level = the larger count
    assert both.by_threads[1]["device_flops"] == pytest.approx(one.device_flops, rel=1e-12)
    assert profile_status(path, "cpu", 1, "fp32", quick=True)[0] == "ok"
    assert profile_status(path, "cpu", 2, "bf16", quick=True) == ("partial", "no bf16 figures at 2 thread(s)")


def test_mode_setting_and_environment():
    assert calibrate_mode("auto") == "auto" and calibrate_mode("never") == "never"
    os.environ["NPT_CALIBRATE"] = "never"
    try:
        assert calibrate_mode("auto") == "never" and calibrate_mode("always") == "always"
        os.environ["NPT_CALIBRATE"] = "sometimes"
        with pytest.raises(ConfigError, match="NPT_CALIBRATE"):
            calibrate_mode("auto")
    finally:
        del os.environ["NPT_CALIBRATE"]
    with pytest.raises(ConfigError, match="placement.calibrate='maybe'"):
        calibrate_mode("maybe")


def test_job_calibration_measures_only_what_the_plan_needs_within_the_auto_bounds(monkeypatch):
    """The automatic path passes the AUTO loop bounds, the job's dtype, shape and thread count,
    no bare-matmul figure and the smaller AdamW size; AUTO's bounds keep the six timed loops
    within the 15 s budget. Checked on what the code passes, not on a clock."""
    seen = {}

    def fake_measure_at(kind, backend, quick, model_cfg=None, **kw):
        import torch

        seen.update(kw, kind=kind, quick=quick, threads=torch.get_num_threads())
        return {"device_flops": 1e10, "h2d_bytes_per_s": 1e9, "d2h_bytes_per_s": 1e9,
                "host_adamw_params_per_s": 1e8, "device_adamw_params_per_s": 1e8,
                "head_flops_ratio": 0.8, "flops_by_dtype": {"bf16": 1e10}}

    class FakeLoad(BackgroundLoad):  # no processes: the baseline "measured" by the load
        def spawn(self):
            pass

        def give_work(self, **kw):
            assert kw["adamw_params"] == AUTO_ADAMW_PARAMS

        def wait_ready(self, **kw):
            pass

        def baseline_bytes(self):
            return 123 * 2**20

    monkeypatch.setattr(autocal, "measure_at", fake_measure_at)
    load = FakeLoad(0, threads=1, baseline=(None, None))
    entry, baseline, det = measure_for_job("cpu", None, 1, "bf16", batch_seq=(4, 64), load=load)
    assert seen["loop"] is AUTO and seen["dtypes"] == ("bf16",) and seen["matmul"] is False
    assert seen["batch_seq"] == (4, 64) and seen["adamw_params"] == AUTO_ADAMW_PARAMS
    assert seen["threads"] == 1 and not seen["quick"]
    assert baseline == 123 * 2**20 and entry["flops_by_dtype"] == {"bf16": 1e10}
    assert AUTO == LoopBounds(min_time=0.3, max_time=1.2, max_reps=20, min_reps=2, warmup=1)
    # layer, head, upload, download, host AdamW, device AdamW: 6 loops of at most max_time each
    assert 6 * AUTO.max_time <= 15 - 5  # 5 s left for set-up, imports and the backend


def test_every_timed_loop_gets_the_bounds_it_is_given(monkeypatch):
    from npu_train.backends import make_backend

    loops = []
    real = measure.timed

    def spy(fn, sync, loop):
        loops.append(loop)
        return real(fn, sync, measure.QUICK)

    monkeypatch.setattr(measure, "timed", spy)
    be = make_backend("cpu")
    be.setup()
    out = measure.measure_at("cpu", be, True, loop=AUTO, dtypes=("fp32",), matmul=False)
    R = measure.HEAD_ROUNDS
    assert splitcost.SPLIT_ROUNDS == R  # both interleaved figures derive their bounds alike

    def derived(lp, base):  # the head / split figures: R rounds of 2 timings, each with 1/R of the bounds
        return (lp.min_time, lp.max_time, lp.max_reps, lp.min_reps, lp.warmup) == (
            base.min_time / R, base.max_time / R, base.max_reps, 1, 0)

    # layer, R x (full, split backward), R x (layer, head), upload, download, host AdamW, device AdamW
    assert len(loops) == 5 + 4 * R and all(lp is AUTO or derived(lp, AUTO) for lp in loops)
    assert out["split_backward_ratio"] > 0
    assert sum(lp is AUTO for lp in loops) == 5
    assert set(out["flops_by_dtype"]) == {"fp32"} and out["matmul_flops_by_dtype"] == {}
    loops.clear()
    measure.measure_at("cpu", be, True)  # calibrate=true's defaults: both dtypes + matmul, QUICK
    # 2 dtypes x (layer + matmul), R x (full, split), R x (layer, head), upload, download, host AdamW,
    # device AdamW
    assert len(loops) == 8 + 4 * R and all(lp is measure.QUICK or derived(lp, measure.QUICK) for lp in loops)


def test_job_shape_sets_the_benchmark_shapes():
    m = tiny(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, vocab_size=49152)
    layer, head, what = measure.reference_shapes("cpu", False, m, (4, 64))
    assert layer == (576, 1536, 9, 3, 4, 64) and head == (49152, 576, 256) and what.startswith("model")
    big = tiny(hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8)
    layer, _, _ = measure.reference_shapes("cpu", False, big, (8, 4096))
    b, s = layer[4], layer[5]
    assert b == 1 and 6.0 * b * s * big.params_per_layer() <= 20e9  # halved into the FLOP budget


def _hold_lock_then_write(path, started, go):
    """Child: take the lock, signal, wait, write a quick profile as another launcher would."""
    from npu_train.planner.autocal import measure_for_job as m
    from npu_train.planner.autocal import save_profile
    from npu_train.planner.rates import Rates

    fd = os.open(str(path) + ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    started.set()
    go.wait(60)

    entry, _, det = m("cpu", None, 1, "fp32", quick=True)
    rates = Rates(**{k: v for k, v in entry.items() if k != "flops_by_dtype"}, threads=1,
                  flops_by_dtype=entry["flops_by_dtype"])
    save_profile("cpu", rates, path, details={"machine": det["machine"], "quick": True})
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def test_a_launcher_waiting_for_anothers_calibration_reuses_it(tmp_path):
    path = tmp_path / "cpu.json"
    ctx = mp.get_context("spawn")
    started, go = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_lock_then_write, args=(path, started, go))
    other.start()
    try:
        assert started.wait(60)
        go.set()  # the other launcher measures while this one waits for the lock
        res, lines = _quick(path)
    finally:
        other.join(60)
    assert other.exitcode == 0
    assert not res["calibrated"] and res["why"] == "measured by another launcher" and lines == []
    assert load_rates("cpu", path).device_flops > 0


def _launch(path, q):
    res = ensure_profile("cpu", None, threads=1, dtype="fp32", mode="auto", quick=True, path=path,
                         log=lambda s: None)
    q.put(res["calibrated"])


def test_concurrent_calibrations_leave_a_whole_profile(tmp_path):
    path = tmp_path / "cpu.json"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_launch, args=(path, q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    # one measured; the other waited for the lock and reused it, or found it cached
    assert sorted(q.get(timeout=5) for _ in procs) == [False, True]
    doc = json.loads(path.read_text())  # one whole JSON document
    assert doc["rates"]["device_flops"] > 0
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # no temp file left


def test_plan_names_the_source_of_every_rate(tmp_path):
    path = tmp_path / "cpu.json"
    _quick(path)
    model, shape = tiny(), RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    measured = make_plan(model, shape, cards, [load_rates("cpu", path)] * 2, threads=1).table()
    line = [ln for ln in measured.splitlines() if ln.startswith("rates cpu")]
    assert len(line) == 1
    created = json.loads(path.read_text())["created"]
    assert f"measured = calibration profile {path} ({created})" in line[0]
    for label in ("compute", "lm_head+loss", "h2d", "d2h", "host AdamW", "device AdamW",
                  "process baseline"):
        assert f"{label}" in line[0]
    # quick mode measures no process baseline: the default stays, labelled assumed
    assert line[0].count("[measured]") == 6 and "process baseline 0.35 GiB [assumed (profile)]" in line[0]
    assumed = make_plan(model, shape, cards, [load_rates("cpu", tmp_path / "none.json")] * 2,
                        threads=1).table()
    line = [ln for ln in assumed.splitlines() if ln.startswith("rates cpu")][0]
    assert line.count("[assumed]") == 7 and "no calibration profile" in line
    # figures of another thread count are scaled, and say so
    scaled = make_plan(model, shape, make_cards("cpu", 1, capacity_bytes=8 * 2**30),
                       [load_rates("cpu", path)], threads=2).table()
    assert "compute" in scaled and "[measured, scaled from 1 thread(s)]" in scaled


def test_others_cores_subtracts_this_process_and_its_children():
    # 10 s wall; the machine used 12 CPU s, this process and its children 5: others used 0.7 cores
    assert autocal.others_cores((100.0, 50.0, 3.0), (110.0, 62.0, 8.0)) == pytest.approx(0.7)
    assert autocal.others_cores((0.0, 0.0, 0.0), (1.0, 1.0, 2.0)) == 0.0  # never negative
    wall, machine, own = autocal.cpu_snapshot()
    assert wall > 0 and machine >= own >= 0


def test_plan_true_with_calibrate_always_says_it_measures_nothing(tmp_path, capsys):
    """A dry run (plan=true) never calibrates; asking for placement.calibrate=always there gets a note
    naming calibrate=true instead of silence."""
    from omegaconf import OmegaConf

    from npu_train.config import Config
    from npu_train.runtime.job import run_job

    def dry(mode):
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([
            "plan=true", "model.path=smollm2-135m", "backend=[cpu,cpu]", f"placement.calibrate={mode}"]))
        assert run_job(cfg, str(tmp_path)) == {"plan": True}
        return capsys.readouterr().out

    assert "placement.calibrate=always does not run with plan=true" in dry("always")
    assert "does not run with plan=true" not in dry("auto")
