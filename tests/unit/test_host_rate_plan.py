"""The host AdamW term of accelerator cards in the plan (issue 39), from the formulas:

- host params/s = min(threads x the per-thread figure, host memory B/s / card processes on the host / B/param),
  B/param = gradient bytes + 24 (fp32 master, m, v read and written) + the compute-dtype copy (0 in fp32);
- host seconds a step = offloaded parameters / that rate;
- a calibration profile's figures at one thread count resolve to another scaling the host AdamW only on an
  accelerator card (its FLOP/s are the card's: measured at 1 thread and run at 8, RNGD compute stayed 8x too
  fast before), and every compute figure on a cpu card;
- the ``bound:`` line names the largest term of the slowest card, "the largest term" below half the step.
"""
from __future__ import annotations

import json

import pytest

from npu_train.hardware import make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import PlanRequest, RunShape, load_rates, make_plan
from npu_train.planner.cost import capped_host_rate, host_update_bytes
from npu_train.planner.rates import DEFAULT_RATES
from npu_train.planner.table import bound_line, plan_table

M8B = get_preset("llama-3.1-8b")
SHAPE = RunShape(micro_batch=1, seq_len=512, micro_batches=4, dtype="bf16")


def _plan(threads: int, cards_per_host: int = 0, resident=(6, 6), rates=None):
    return make_plan(PlanRequest(M8B, SHAPE, make_cards("furiosa", 2), rates or load_rates("furiosa"),
                                 resident_layers=list(resident), threads=threads, split=[16, 16],
                                 cards_per_host=cards_per_host))


@pytest.mark.parametrize("dtype,accum,want", [("bf16", "fp32", 30), ("bf16", "compute", 28), ("fp32", "fp32", 28)])
def test_bytes_per_parameter_of_the_one_pass(dtype, accum, want):
    assert host_update_bytes(RunShape(1, 8, 1, dtype=dtype, grad_accum=accum)) == want


@pytest.mark.parametrize("threads,cards_per_host", [(1, 0), (4, 0), (16, 0), (16, 8), (1, 64)])
def test_host_seconds_are_params_over_threads_capped_by_shared_bandwidth(threads, cards_per_host):
    d = DEFAULT_RATES["furiosa"]
    p = _plan(threads, cards_per_host)
    per_thread, bw = d.host_adamw_params_per_s / d.threads, d.host_bytes_per_s
    procs = cards_per_host or 2
    rate = min(threads * per_thread, bw / procs / 30)
    # card 0: 10 offloaded layers and the embedding (its state is offloaded unless every layer is resident)
    off_params = 10 * M8B.params_per_layer() + M8B.vocab_size * M8B.hidden_size
    st = p.stages[0]
    assert st.time["host_optimizer"] == pytest.approx(off_params / rate, rel=1e-9)
    src = p.rates[0].source("host_adamw_params_per_s")
    assert ("capped: host memory" in src) == (bw / procs / 30 < threads * per_thread)


def test_capped_rate_names_the_bounding_figure():
    r = DEFAULT_RATES["furiosa"].resolve("bf16", 8)
    rate, src = capped_host_rate(r, 4, 30)
    assert rate == pytest.approx(min(8 * 1e9, 1e11 / 4 / 30))
    assert src.startswith("capped: host memory 100 GB/s") and "8 thread(s) alone: 8,000 M" in src


def _profile(tmp_path, kind: str):
    p = tmp_path / f"{kind}.json"
    p.write_text(json.dumps({"rates": {"device_flops": 1e14, "h2d_bytes_per_s": 6e9, "d2h_bytes_per_s": 6e9,
                                       "host_adamw_params_per_s": 7e8, "device_adamw_params_per_s": 1e10,
                                       "host_bytes_per_s": 2e11, "threads": 1,
                                       "flops_by_dtype": {"bf16": 1e14}}, "created": "2026-12-06"}))
    return p


def test_a_profile_at_one_thread_scales_only_the_host_of_an_accelerator(tmp_path):
    r8 = load_rates("furiosa", _profile(tmp_path, "furiosa"), threads=8).resolve("bf16", 8)
    assert r8.device_flops == 1e14 and r8.flops("bf16") == 1e14  # the card's compute: not the host's threads
    assert r8.device_adamw_params_per_s == 1e10
    assert r8.host_adamw_params_per_s == pytest.approx(8 * 7e8) and r8.host_bytes_per_s == 2e11
    c8 = load_rates("cpu", _profile(tmp_path, "cpu"), threads=8)
    assert c8.device_flops == pytest.approx(8e14) and c8.host_adamw_params_per_s == pytest.approx(8 * 7e8)


def test_a_plan_at_eight_threads_keeps_the_cards_compute(tmp_path):
    prof = load_rates("furiosa", _profile(tmp_path, "furiosa"))
    one, eight = _plan(1, rates=prof), _plan(8, rates=prof)
    assert eight.stages[0].time["compute"] == pytest.approx(one.stages[0].time["compute"], rel=1e-12)
    assert eight.stages[0].time["host_optimizer"] < one.stages[0].time["host_optimizer"]


def test_bound_line_names_the_largest_term_even_below_half():
    for p in (_plan(1), _plan(16)):
        st = max(p.stages, key=lambda s: s.time["total"])
        terms = dict(st.time)
        terms["host_optimizer"] -= terms["host_hidden"]
        names = {"compute": "compute", "bubble": "the pipeline bubble", "host_optimizer": "host AdamW of offloaded "
                 "layers", "device_optimizer": "AdamW on the card", "transfer": "host<->device transfers",
                 "dp_comm": "the data-parallel gradient exchange"}
        key = max(names, key=lambda k: terms[k])
        share = terms[key] / st.time["total"]
        line = bound_line(p)
        assert line.startswith(f"bound: {names[key]} {terms[key]:.3g} of {st.time['total']:.3g} s")
        assert (", the largest term)" in line) == (share < 0.5)
        assert line in plan_table(p).splitlines()


def test_calibration_probes_and_profile_round_trip(tmp_path):
    """``calibrate=true`` on an accelerator measures the one-pass host update on one thread and the host memory
    bandwidth; the profile keeps both (threads=1: the host figure is one thread's) and the plan reads them."""
    import torch

    from npu_train.calibrate.measure import _onepass_rate, host_memory_bandwidth
    from npu_train.calibrate.profile import save_profile
    from npu_train.calibrate.timing import QUICK

    threads = torch.get_num_threads()
    assert _onepass_rate(100_000, QUICK) > 0 and host_memory_bandwidth(1_000_000, QUICK) > 0
    assert torch.get_num_threads() == threads  # restored
    r = DEFAULT_RATES["furiosa"]
    prof = type(r)(**{**{k: getattr(r, k) for k in ("device_flops", "h2d_bytes_per_s", "d2h_bytes_per_s",
                                                     "device_adamw_params_per_s")},
                      "host_adamw_params_per_s": 1.2e9, "host_bytes_per_s": 3e10, "threads": 1, "kind": "furiosa"})
    path = save_profile("furiosa", prof, tmp_path / "f.json", details={"machine": {}})
    back = load_rates("furiosa", path, threads=4)
    assert back.host_bytes_per_s == 3e10 and back.source("host_bytes_per_s") == "measured"
    assert back.host_adamw_params_per_s == pytest.approx(4 * 1.2e9)
    p = _plan(4, rates=load_rates("furiosa", path))
    assert p.rates[0].host_adamw_params_per_s == pytest.approx(3e10 / 2 / 30)  # capped: 500 M < 4.8 G
