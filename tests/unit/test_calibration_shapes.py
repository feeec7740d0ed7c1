"""Calibration figures belong to the shapes they were measured on (``planner.rates``): every
profile entry records its layer/head ``shapes``, and the plan names them and says when they are
another model's. Hand-written profiles: nothing is timed."""
from __future__ import annotations

import json

from npu_train.calibrate.profile import PROFILE_VERSION, machine_info, save_profile
from npu_train.hardware import make_cards
from npu_train.planner import PlanRequest, load_rates, make_plan, plan_table
from npu_train.planner.rates import Rates, job_shapes, shape_signature, shapes_differ
from npu_train.planner.spec import RunShape

from test_calibrate import tiny

SMOL = tiny(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
            num_kv_heads=3, name="SmolLM2-135M")
TINY = tiny(name="tiny")
BS = (2, 128)
A = job_shapes("cpu", False, SMOL, BS)  # SmolLM2's layer and head
B = job_shapes("cpu", False, TINY, BS)  # the tiny test model's


def _entry(flops: dict, head=1.19, split=1.08, shapes=A, **kw) -> dict:
    """A measured profile entry."""
    e = {"device_flops": next(iter(flops.values())), "h2d_bytes_per_s": 9e9, "d2h_bytes_per_s": 8e9,
         "host_adamw_params_per_s": 3e8, "device_adamw_params_per_s": 3e8, "head_flops_ratio": head,
         "split_backward_ratio": split, "flops_by_dtype": dict(flops), "concurrent": 1}
    if shapes is not None:
        e["shapes"] = shapes
    e.update(kw)
    return e


def _write(path, top: dict, threads=1, by_threads=None):
    """A full (not quick) profile with a measured process baseline."""
    rates = dict(top, threads=threads, process_baseline_bytes=400 * 2**20, by_threads=by_threads or {})
    doc = {"version": PROFILE_VERSION, "kind": "cpu", "created": "2026-12-01T00:00:00",
           "rates": rates, "machine": {"cpu_model": "test"}, "details": {"quick": False, "assumed_fields": []}}
    path.write_text(json.dumps(doc))


def test_the_signature_names_layer_and_head_shapes():
    assert A == "layer 576x1536 heads 9/3, head 49152x576"
    assert B == shape_signature((64, 176, 4, 2, 2, 128), (1024, 64, 256)) and A != B
    assert job_shapes("cpu", False, SMOL, (4, 64)) == A  # micro-batch and sequence length do not count
    assert shapes_differ(A, B) and not shapes_differ(A, A)
    assert not shapes_differ("", A) and not shapes_differ(A, None)  # unknown fits


def test_save_and_load_keep_the_shapes(tmp_path):
    r = Rates(device_flops=4e10, h2d_bytes_per_s=9e9, d2h_bytes_per_s=8e9, host_adamw_params_per_s=3e8,
              threads=2, shapes=A, flops_by_dtype={"fp32": 4e10},
              by_threads={1: {"device_flops": 2e10, "flops_by_dtype": {"fp32": 2e10}, "shapes": B}})
    path = save_profile("cpu", r, tmp_path / "cpu.json", details={"machine": machine_info("cpu")})
    doc = json.loads(path.read_text())
    assert doc["rates"]["shapes"] == A and doc["rates"]["by_threads"]["1"]["shapes"] == B
    back = load_rates("cpu", path)
    assert back.shapes == A and back.by_threads[1]["shapes"] == B
    assert back.resolve("fp32", 2).shapes == A and back.resolve("fp32", 1).shapes == B
    assert back.resolve("fp32", 3).shapes == A  # scaled from the nearest count (2): its shapes


def test_the_plan_names_the_shapes_its_figures_were_measured_on(tmp_path):
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=B))
    shape = RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    table = plan_table(make_plan(PlanRequest(TINY, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1)))
    line = [ln for ln in table.splitlines() if ln.startswith("rates cpu")][0]
    assert line.endswith(f"measured = calibration profile {path} (2026-12-01T00:00:00), on {B}")


def test_the_plan_says_when_the_profile_was_measured_on_another_model(tmp_path):
    """A dry run (plan=true) does not calibrate: a profile measured on another model's shapes is used
    as it is, and the rates line says so and how to measure the job's (review P3 of 2026-12-02)."""
    path = tmp_path / "cpu.json"
    _write(path, _entry({"fp32": 40e9}, shapes=A))  # measured on SmolLM2
    shape = RunShape(seq_len=32, micro_batch=1, micro_batches=2, dtype="fp32")
    cards = make_cards("cpu", 2, capacity_bytes=8 * 2**30)
    plan = make_plan(PlanRequest(TINY, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1))
    line = [ln for ln in plan_table(plan).splitlines() if ln.startswith("rates cpu")][0]
    want = job_shapes("cpu", False, TINY, (1, 32))
    assert line.endswith(f"on {A} -- not this job's shapes ({want}): its FLOP/s, head and split-backward "
                         "figures are another model's; calibrate=true with this model.path (and "
                         "placement.profile, if set) measures them")
    # the job's own shapes: no note
    plan = make_plan(PlanRequest(SMOL, shape, cards, [load_rates("cpu", path, threads=1)] * 2, threads=1))
    line = [ln for ln in plan_table(plan).splitlines() if ln.startswith("rates cpu")][0]
    assert "not this job's" not in line
