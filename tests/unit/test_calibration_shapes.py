"""Calibration figures belong to the shapes they were measured on (``planner.autocal`` +
``planner.rates``): every profile entry records its layer/head ``shapes``; figures at the job's
thread count measured on other shapes are ``"partial"`` and replaced with all their dtypes (a tiny
model's bf16 measurement no longer overwrites SmolLM2's head and split-backward ratios under the
same entry); profiles written before the field still fit; the plan names the shapes.

Hand-written profiles and a stubbed measurement: nothing is timed."""
from __future__ import annotations

import json

import pytest

from npu_train.planner import autocal, load_rates, make_cards, make_plan
from npu_train.planner.autocal import ensure_profile, here_fingerprint, profile_status, start_early
from npu_train.planner.calibration import PROFILE_VERSION, save_profile
from npu_train.planner.measure import job_shapes, shape_signature
from npu_train.planner.rates import Rates, shapes_differ
from npu_train.planner.spec import RunShape

from test_calibrate import tiny

SMOL = tiny(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, name="SmolLM2-135M")
TINY = tiny(name="tiny")
BS = (2, 128)
A = job_shapes("cpu", False, SMOL, BS)  # SmolLM2's layer and head
B = job_shapes("cpu", False, TINY, BS)  # the tiny test model's


@pytest.fixture(autouse=True)
def _auto(monkeypatch, tmp_path):
    monkeypatch.delenv("NPT_CALIBRATE", raising=False)  # tests/conftest.py sets never
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))


def _entry(flops: dict, head=1.19, split=1.08, shapes=A, **kw) -> dict:
    """A measured profile entry (what :func:`autocal.measure_for_job` returns)."""
    e = {"device_flops": next(iter(flops.values())), "h2d_bytes_per_s": 9e9, "d2h_bytes_per_s": 8e9,
         "host_adamw_params_per_s": 3e8, "device_adamw_params_per_s": 3e8, "head_flops_ratio": head,
         "split_backward_ratio": split, "flops_by_dtype": dict(flops), "concurrent": 1}
    if shapes is not None:
        e["shapes"] = shapes
    e.update(kw)
    return e


def _write(path, top: dict, threads=1, by_threads=None):
    """A full (not quick) profile of this machine with a measured process baseline."""
    rates = dict(top, threads=threads, process_baseline_bytes=400 * 2**20, by_threads=by_threads or {})
    doc = {"version": PROFILE_VERSION, "kind": "cpu", "created": "2026-12-01T00:00:00",
           "rates": rates, "machine": here_fingerprint("cpu"), "details": {"quick": False, "assumed_fields": []}}
    path.write_text(json.dumps(doc))


def _stub_measure(monkeypatch, entry: dict, seen: list):
    """``measure_for_job`` returning ``entry`` (and recording its call) instead of timing anything."""
    def fake(kind, index, threads, dtype, **kw):
        seen.append((threads, dtype, kw.get("model_cfg")))
        return dict(entry), None, {"machine": dict(here_fingerprint("cpu")), "seconds": 0.0}

    monkeypatch.setattr(autocal, "measure_for_job", fake)


def _ensure(path, model, dtype):
    lines: list[str] = []
    res = ensure_profile("cpu", None, threads=1, dtype=dtype, mode="auto", model_cfg=model, batch_seq=BS,
                         path=path, log=lines.append)
    return res, lines


def test_the_signature_names_layer_and_head_shapes():
    assert A == "layer 576x1536 heads 9/3, head 49152x576"
    assert B == shape_signature((64, 176, 4, 2, 2, 128), (1024, 64, 256)) and A != B
    assert job_shapes("cpu", False, SMOL, (4, 64)) == A  # micro-batch and sequence length do not count
    assert shapes_differ(A, B) and not shapes_differ(A, A)
    assert not shapes_differ("", A) and not shapes_differ(A, None)  # unknown fits


def test_a_tiny_models_bf16_measurement_does_not_leave_smollm2s_figures_under_its_shapes(monkeypatch, tmp_path):
    """The reported case: fp32 on SmolLM2 (head 1.19, split 1.08), then a tiny model's job in bf16
    found the profile partial and merged its ratios (6.4, 1.39) into the same entry; the next fp32
    SmolLM2 job planned with them."""
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}))
    assert profile_status(path, "cpu", 1, "fp32", shapes=A) == ("ok", "cached")
    status, why = profile_status(path, "cpu", 1, "bf16", shapes=B)
    assert status == "partial" and why == f"figures at 1 thread(s) measured on other shapes ({A}), the job's are {B}"
    seen: list = []
    _stub_measure(monkeypatch, _entry({"bf16": 20e9}, head=6.4, split=1.39, shapes=B), seen)
    res, lines = _ensure(path, TINY, "bf16")
    assert res["calibrated"] and seen == [(1, "bf16", TINY)] and "measured on other shapes" in lines[0]
    rates = load_rates("cpu", path)
    # the fp32-on-A figures did not survive under B's signature
    assert rates.shapes == B and rates.flops_by_dtype == {"bf16": 20e9} and rates.head_flops_ratio == 6.4
    assert load_rates("cpu", path, threads=1).shapes == B
    # the next SmolLM2 job re-measures instead of planning with the tiny model's ratios
    status, why = profile_status(path, "cpu", 1, "fp32", shapes=A)
    assert status == "partial" and "measured on other shapes" in why
    _stub_measure(monkeypatch, _entry({"fp32": 41e9}), seen)
    res, _ = _ensure(path, SMOL, "fp32")
    assert res["calibrated"] and len(seen) == 2
    rates = load_rates("cpu", path, threads=1)
    assert (rates.shapes, rates.head_flops_ratio, rates.split_backward_ratio) == (A, 1.19, 1.08)
    assert rates.flops_by_dtype == {"fp32": 41e9}  # the tiny model's bf16 figure went with its shapes
    assert profile_status(path, "cpu", 1, "fp32", shapes=A) == ("ok", "cached")
    assert profile_status(path, "cpu", 1, "bf16", shapes=A) == ("partial", "no bf16 figures at 1 thread(s)")


def test_same_shapes_another_dtype_is_merged_as_before(monkeypatch, tmp_path):
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}))
    assert profile_status(path, "cpu", 1, "bf16", shapes=A) == ("partial", "no bf16 figures at 1 thread(s)")
    seen: list = []
    _stub_measure(monkeypatch, _entry({"bf16": 20e9}, head=1.25, split=1.1), seen)
    res, _ = _ensure(path, SMOL, "bf16")
    assert res["calibrated"]
    rates = load_rates("cpu", path)
    assert rates.shapes == A and rates.flops_by_dtype == {"fp32": 40e9, "bf16": 20e9}  # fp32 kept
    assert profile_status(path, "cpu", 1, "fp32", shapes=A) == ("ok", "cached")
    assert profile_status(path, "cpu", 1, "bf16", shapes=A) == ("ok", "cached")


def test_other_thread_counts_keep_their_own_shapes(monkeypatch, tmp_path):
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 80e9}), threads=2, by_threads={"1": _entry({"fp32": 40e9})})
    seen: list = []
    _stub_measure(monkeypatch, _entry({"bf16": 20e9}, head=6.4, shapes=B), seen)
    _ensure(path, TINY, "bf16")  # 1 thread, on B: the 1-thread entry is replaced
    rates = load_rates("cpu", path)
    assert rates.threads == 2 and rates.shapes == A and rates.flops_by_dtype == {"fp32": 80e9}
    assert rates.shapes_at(1) == B and rates.by_threads[1]["flops_by_dtype"] == {"bf16": 20e9}
    assert load_rates("cpu", path, threads=2).shapes == A and load_rates("cpu", path, threads=1).shapes == B
    assert profile_status(path, "cpu", 2, "fp32", shapes=A) == ("ok", "cached")
    assert profile_status(path, "cpu", 2, "fp32", shapes=B)[0] == "partial"
    # a new top count: the old top level moves into by_threads with its shapes
    _stub_measure(monkeypatch, _entry({"fp32": 150e9}, shapes=B), seen)
    lines: list[str] = []
    ensure_profile("cpu", None, threads=4, dtype="fp32", model_cfg=TINY, batch_seq=BS, path=path, log=lines.append)
    rates = load_rates("cpu", path)
    assert rates.threads == 4 and rates.shapes == B and rates.shapes_at(2) == A and rates.shapes_at(1) == B


def test_a_profile_without_the_field_fits_as_before(monkeypatch, tmp_path):
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=None), threads=2, by_threads={"1": _entry({"fp32": 30e9}, shapes=None)})
    rates = load_rates("cpu", path)
    assert rates.shapes == "" and rates.shapes_at(1) == "" and load_rates("cpu", path, threads=1).shapes == ""
    for t in (1, 2):
        assert profile_status(path, "cpu", t, "fp32", shapes=A) == ("ok", "cached")
        assert profile_status(path, "cpu", t, "fp32", shapes=B) == ("ok", "cached")
    # unknown shapes count as the job's: another dtype is merged beside them
    seen: list = []
    _stub_measure(monkeypatch, _entry({"bf16": 20e9}, shapes=A), seen)
    _ensure(path, SMOL, "bf16")
    assert load_rates("cpu", path).by_threads[1]["flops_by_dtype"] == {"fp32": 30e9, "bf16": 20e9}


def test_save_and_load_keep_the_shapes(tmp_path):
    r = Rates(device_flops=4e10, h2d_bytes_per_s=9e9, d2h_bytes_per_s=8e9, host_adamw_params_per_s=3e8,
              threads=2, shapes=A, flops_by_dtype={"fp32": 4e10},
              by_threads={1: {"device_flops": 2e10, "flops_by_dtype": {"fp32": 2e10}, "shapes": B}})
    path = save_profile("cpu", r, tmp_path / "cpu.json", details={"machine": here_fingerprint("cpu")})
    doc = json.loads(path.read_text())
    assert doc["rates"]["shapes"] == A and doc["rates"]["by_threads"]["1"]["shapes"] == B
    back = load_rates("cpu", path)
    assert back.shapes == A and back.by_threads[1]["shapes"] == B
    assert back.resolve("fp32", 2).shapes == A and back.resolve("fp32", 1).shapes == B
    assert back.resolve("fp32", 3).shapes == A  # scaled from the nearest count (2): its shapes


def test_accelerator_profiles_check_the_shapes_too(tmp_path):
    path = tmp_path / "cuda.json"
    doc = {"version": PROFILE_VERSION, "kind": "cuda", "rates": _entry({"bf16": 4e14}, shapes=A, threads=0),
           "machine": here_fingerprint("cuda"), "details": {"quick": False}}
    path.write_text(json.dumps(doc))
    assert profile_status(path, "cuda", 1, "bf16", shapes=A) == ("ok", "cached")
    assert profile_status(path, "cuda", 1, "bf16", shapes=B) == (
        "partial", f"figures measured on other shapes ({A}), the job's are {B}")


def test_start_early_does_not_check_shapes_it_cannot_know_yet(tmp_path):
    """start_early runs before the model is read: a profile that fits but for its shapes starts
    nothing early (the calibration then starts its helpers itself)."""
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=B))
    assert profile_status(path, "cpu", 1, "fp32") == ("ok", "cached")
    assert start_early(make_cards("cpu", 1, capacity_bytes=2**30), "auto", threads=1, dtype="fp32", path=path) is None


def test_the_plan_names_the_shapes_its_figures_were_measured_on(tmp_path):
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=B))
    shape = RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    table = make_plan(TINY, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1).table()
    line = [ln for ln in table.splitlines() if ln.startswith("rates cpu")][0]
    assert line.endswith(f"measured = calibration profile {path} (2026-12-01T00:00:00), on {B}")


def test_the_plan_says_when_the_profile_was_measured_on_another_model(tmp_path):
    """A dry run (plan=true) does not calibrate: a profile measured on another model's shapes is used
    as it is, and the rates line says so and how to measure the job's (review P3 of 2026-12-02)."""
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=A))  # measured on SmolLM2
    shape = RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    line = [ln for ln in make_plan(TINY, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1)
            .table().splitlines() if ln.startswith("rates cpu")][0]
    want = job_shapes("cpu", False, TINY, (1, 32))
    assert line.endswith(f"on {A} -- not this job's shapes ({want}): its FLOP/s, head and split-backward "
                         "figures are another model's; calibrate=true with this model.path (and "
                         "placement.profile, if set) measures them, as does a training launch with the "
                         "default profile")
    # the job's own shapes: no note
    line = [ln for ln in make_plan(SMOL, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1)
            .table().splitlines() if ln.startswith("rates cpu")][0]
    assert "not this job's" not in line
