"""Calibration (``calibrate=true``, quick mode) and how its figures enter the placement model."""
from __future__ import annotations

import json
import math

import pytest

from npu_train.hardware import GIB, make_cards
from npu_train.model.config import LlamaConfig
from npu_train.calibrate import calibrate, main_calibrate, save_profile, thread_counts
from npu_train.planner import DEFAULT_RATES, PlanRequest, Rates, RunShape, load_rates, make_plan

RATE_FIELDS = ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s", "host_adamw_params_per_s",
               "device_adamw_params_per_s", "head_flops_ratio", "process_baseline_bytes")


def tiny(**kw) -> LlamaConfig:
    d = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_layers=8, num_heads=4,
             num_kv_heads=2, tie_word_embeddings=True, name="tiny")
    d.update(kw)
    return LlamaConfig(**d)


@pytest.fixture(scope="module")
def quick_cpu() -> Rates:
    return calibrate("cpu", quick=True, threads=[1])


def test_quick_calibration_gives_positive_finite_rates(quick_cpu):
    r = quick_cpu
    for k in RATE_FIELDS:
        v = getattr(r, k)
        assert v > 0 and math.isfinite(v), (k, v)
    assert r.threads == 1 and r.by_threads == {}
    assert set(r.flops_by_dtype) == {"fp32", "bf16"} and r.device_flops == r.flops_by_dtype["fp32"]
    # a fresh python + torch + npu_train process: more than 100 MiB, less than 4 GiB
    assert 100 * 2**20 < r.process_baseline_bytes < 4 * GIB
    det = r.calibration
    assert det["quick"] and det["machine"]["torch"] and det["machine"]["cores_logical"] >= 1
    # the shapes the figures were measured on (calibrate=true: the model's, reference micro-batch x seq)
    from npu_train.planner.rates import job_shapes

    assert r.shapes == job_shapes("cpu", True, None) and r.shapes.startswith("layer ")


def test_save_load_round_trip(quick_cpu, tmp_path):
    r = quick_cpu
    r.by_threads = {2: {"device_flops": 2 * r.device_flops, "flops_by_dtype": {"fp32": 3e10}}}
    try:
        path = save_profile("cpu", r, tmp_path / "cpu.json")
    finally:
        r.by_threads = {}
    doc = json.loads(path.read_text())
    assert doc["kind"] == "cpu" and doc["machine"]["cpu_model"] and doc["machine"]["date"]
    back = load_rates("cpu", path)
    for k in RATE_FIELDS:
        assert getattr(back, k) == pytest.approx(getattr(r, k)), k
    assert back.threads == 1 and back.flops_by_dtype == pytest.approx(r.flops_by_dtype)
    assert back.shapes == r.shapes and doc["rates"]["shapes"] == r.shapes
    assert back.by_threads[2]["device_flops"] == pytest.approx(2 * r.device_flops)
    # the planner picks the entry of the card process's thread count
    assert back.resolve("fp32", 2).device_flops == pytest.approx(3e10)
    assert back.resolve("fp32", 1).device_flops == pytest.approx(r.flops_by_dtype["fp32"])
    assert back.resolve("bf16", 1).device_flops == pytest.approx(r.flops_by_dtype["bf16"])
    # no entry for 4 threads: linear scaling from the nearest measured count (2: 4/2 * 3e10)
    assert back.resolve("fp32", 4).device_flops == pytest.approx(4 / 2 * 3e10)


def test_main_calibrate_prints_and_saves(tmp_path, capsys):
    out = main_calibrate(["cpu", "cpu"], quick=True, model_path=None,
                         profile=tmp_path / "p.json")
    assert out == [str(tmp_path / "p.json")]
    text = capsys.readouterr().out
    assert "device_flops" in text and "process_baseline_bytes" in text and "saved to" in text
    assert load_rates("cpu", out[0]).device_flops > 0
    with pytest.raises(ValueError):
        main_calibrate(["tpu"], quick=True)


def test_thread_counts():
    assert thread_counts(1) == [1]
    assert thread_counts(2) == [1, 2]
    assert thread_counts(6) == [1, 2, 4, 6]


def test_process_baseline_enters_cpu_memory_prediction():
    m = tiny()
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=4, dtype="fp32")
    cards = make_cards("cpu", 2, 2**40)
    base = Rates(50e9, 10e9, 10e9, 2e8)
    plus = Rates(50e9, 10e9, 10e9, 2e8, process_baseline_bytes=0.5 * GIB)
    p0 = make_plan(PlanRequest(m, shape, cards, base, host_cores=2))
    p1 = make_plan(PlanRequest(m, shape, cards, plus, host_cores=2))
    for a, b in zip(p0.stages, p1.stages):
        assert a.mem["baseline"] == 0 and b.mem["baseline"] == int(0.5 * GIB)
        assert b.mem["total"] - a.mem["total"] == int(0.5 * GIB)
    # the default cpu rates carry a baseline; furiosa's memory excludes the host process
    assert DEFAULT_RATES["cpu"].process_baseline_bytes > 0
    assert DEFAULT_RATES["furiosa"].process_baseline_bytes == 0
    f = make_plan(PlanRequest(m, shape, make_cards("furiosa", 2), DEFAULT_RATES["furiosa"]))
    assert all(st.mem["baseline"] == 0 for st in f.stages)


def test_cpu_card_holds_all_optimizer_state_and_sums():
    m = tiny()
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=4, dtype="fp32")
    cards = make_cards("cpu", 2, 2**40)
    # the same split for both (without it, resident 0 gets its own fastest split)
    res = make_plan(PlanRequest(m, shape, cards, DEFAULT_RATES["cpu"], split=[4, 4], resident_layers=4, host_cores=2))
    off = make_plan(PlanRequest(m, shape, cards, DEFAULT_RATES["cpu"], split=[4, 4], resident_layers=0, host_cores=2))
    for a, b in zip(res.stages, off.stages):
        n = a.mem["weights"] // 4
        # fp32 compute: resident parameters are their own masters (m + v = 8 B/param); offloaded
        # ones keep a separate host master (12 B/param), which a cpu card's RSS holds as well
        assert a.mem["optimizer"] == 8 * n and b.mem["optimizer"] == 12 * n
        assert b.host_bytes == 0                       # already in the card's memory
        # (modules and heap are parts of workspace, reported alone)
        assert a.mem["total"] == sum(a.mem[k] for k in a.mem if k not in ("total", "modules", "heap"))
    # the offloaded path pays copies and a host AdamW
    assert off.stages[0].time["transfer"] > res.stages[0].time["transfer"]
    assert off.stages[0].time["host_optimizer"] > 0 == res.stages[0].time["host_optimizer"]
    assert res.stages[0].time["device_optimizer"] > 0


def test_cpu_cards_share_cores():
    m = tiny()
    M = 4
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=M, dtype="fp32")
    cards = make_cards("cpu", 3, 2**40)
    r = DEFAULT_RATES["cpu"]
    own = make_plan(PlanRequest(m, shape, cards, r, split=[3, 3, 2], resident_layers="auto", host_cores=3))
    shared = make_plan(PlanRequest(m, shape, cards, r, split=[3, 3, 2], resident_layers="auto", host_cores=2))
    # the pipeline's M+P-1 = 6 slots have 1, 2, 3, 3, 2, 1 stages computing, and the two slots
    # with 3 one-thread stages on 2 cores take 1.5x as long: 7 slot-times instead of 6
    phase = lambda p: p.stages[0].time["compute"] + p.stages[0].time["bubble"]
    assert phase(shared) == pytest.approx(7 / 6 * phase(own))
    assert shared.stages[0].time["compute"] == pytest.approx(7 / 6 * own.stages[0].time["compute"])
    # the three optimizers run at the same time on 2 cores
    assert shared.stages[0].time["device_optimizer"] == pytest.approx(
        1.5 * own.stages[0].time["device_optimizer"])


def test_head_flops_ratio_slows_only_the_last_stage():
    m = tiny(vocab_size=32000)
    shape = RunShape(seq_len=32, micro_batch=2, micro_batches=4, dtype="fp32")
    cards = make_cards("cpu", 2, 2**40)
    fast = make_plan(PlanRequest(m, shape, cards, Rates(50e9, 1e10, 1e10, 2e8), split=[4, 4], host_cores=2))
    slow = make_plan(PlanRequest(m, shape, cards, Rates(50e9, 1e10, 1e10, 2e8, head_flops_ratio=0.5),
                                 split=[4, 4], host_cores=2))
    assert slow.stages[0].time["compute"] == pytest.approx(fast.stages[0].time["compute"])
    # the head's 6*tokens*V*H FLOPs take twice as long: M micro-batches * one extra head time
    extra = 4 * 6.0 * 64 * m.embedding_params() / 50e9
    assert slow.stages[1].time["compute"] == pytest.approx(fast.stages[1].time["compute"] + extra)


def test_load_rates_rejects_bad_profiles(tmp_path):
    p = tmp_path / "cpu.json"
    p.write_text(json.dumps({"rates": {"process_baseline_bytes": -1}}))
    with pytest.raises(ValueError):
        load_rates("cpu", p)
    p.write_text(json.dumps({"rates": {"by_threads": {"2": 5}}}))
    with pytest.raises(ValueError):
        load_rates("cpu", p)
    p.write_text(json.dumps({"rates": {"process_baseline_bytes": 0, "device_adamw_params_per_s": 0}}))
    r = load_rates("cpu", p)
    assert r.process_baseline_bytes == 0 and r.device_adamw == r.host_adamw_params_per_s


def test_process_baseline_imports_the_given_modules():
    from npu_train.calibrate import CARD_PROCESS_MODULES, measure_process_baseline

    # the list is a parameter: a module that does not exist makes the card-like process fail
    with pytest.raises(RuntimeError, match="npu_train.no_such_module"):
        measure_process_baseline(None, 1, modules=["npu_train.no_such_module"])
    # the default names only modules below the planner's layer (the runtime passes its own)
    assert CARD_PROCESS_MODULES and not any(m.startswith(("npu_train.runtime", "npu_train.launch"))
                                            for m in CARD_PROCESS_MODULES)


def test_planner_names_no_higher_layer():
    """Not even inside a code string: the planner is below the runtime, the launcher and calibrate."""
    from pathlib import Path

    import npu_train.planner

    root = Path(npu_train.planner.__file__).parent
    for f in sorted(root.glob("*.py")):
        text = f.read_text()
        assert "npu_train.runtime" not in text and "npu_train.launch" not in text, f.name
        assert "from npu_train.calibrate" not in text and "import npu_train.calibrate" not in text, f.name


def test_head_ratio_is_timed_interleaved_with_the_layer(monkeypatch):
    """head_flops_ratio comes from rounds of (layer timing, head timing) back to back: a machine whose
    speed drifts between rounds (here 1.5x slower after every head step) still gives the true ratio.
    Fake clock and steps: no real timing."""
    from npu_train.calibrate import measure as M

    clock = {"t": 0.0, "speed": 1.0}

    def layer():
        clock["t"] += 1.0 * clock["speed"]

    def head():
        clock["t"] += 10.0 * clock["speed"]  # 10x the layer's time for 2x its FLOPs: ratio 0.2
        clock["speed"] *= 1.5

    class Be:
        def synchronize(self):
            pass

    monkeypatch.setattr(M.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(M, "_layer_step", lambda be, dt, dims: (layer, 1.0))
    monkeypatch.setattr(M, "_head_step", lambda be, dt, v, h, t: (head, 2.0))
    loop = M.LoopBounds(min_time=0.0, max_time=1e9, max_reps=1, min_reps=1, warmup=1)
    head_flops, ratio = M.head_vs_layer(Be(), "fp32", None, (1, 1, 1), loop, rounds=3)
    assert ratio == pytest.approx(0.2, rel=1e-12)


def test_best_of_keeps_the_head_ratio_measured_with_the_head_figure():
    """Re-measured figures are combined per figure; the head ratio comes from the measurement whose
    head figure is kept (timed interleaved with the layer there), not from head / layer FLOP/s of
    two different measurements."""
    from npu_train.calibrate.measure import best_of

    def m(layer, head, ratio):
        return {"device_flops": layer, "head_flops": head, "head_flops_ratio": ratio,
                "flops_by_dtype": {"fp32": layer}, "host_adamw_params_per_s": 1.0,
                "device_adamw_params_per_s": 1.0, "h2d_bytes_per_s": 1.0, "d2h_bytes_per_s": 1.0}

    a, b = m(50e9, 30e9, 0.75), m(40e9, 36e9, 0.8)
    out = best_of(a, b, "cpu")
    assert out["device_flops"] == 50e9 and out["head_flops"] == 36e9 and out["head_flops_ratio"] == 0.8
    assert best_of(b, a, "cpu")["head_flops_ratio"] == 0.8
    assert best_of(a, b, "cpu", only=["device_flops"])["head_flops_ratio"] == 0.75  # head figure not taken
