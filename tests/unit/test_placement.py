"""Presets (exact parameter counts) and the placement model (memory / time arithmetic)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from npu_train.backends.spec import default_capacity
from npu_train.hardware import Card, make_cards
from npu_train.model.config import LlamaConfig
from npu_train.model.presets import PRESETS, get_preset
from npu_train.planner import (
    ATTENTION,
    DEFAULT_RATES,
    PlacementError,
    PlanRequest,
    Rates,
    RunShape,
    activation_bytes_per_layer,
    balanced_split,
    format_plan,
    gb,
    gib,
    in_flight_micro_batches,
    load_rates,
    logits_bytes,
    make_plan,
    plan_table,
    saved_logits_bytes,
    threads_per_card,
)
from npu_train.planner import threads as planner_threads
from npu_train.pipeline.schedule import SCHEDULES, build_schedule, peak_in_flight

PUBLISHED = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,
    "smollm2-135m": 134_515_008,
}

FURIOSA = DEFAULT_RATES["furiosa"]
CAP = int(47.5 * 2**30)
# the field record's conditions: the predecessor accumulated gradients in bf16 (issue 12)
REF_SHAPE = RunShape(seq_len=512, micro_batch=1, micro_batches=4, schedule="1f1b", dtype="bf16",
                     recompute=False, grad_accum="compute")


def static_bytes(stage) -> int:
    return stage.mem["weights"] + stage.mem["grads"] + stage.mem["optimizer"]


def tiny(**kw) -> LlamaConfig:
    d = dict(vocab_size=1024, hidden_size=64, intermediate_size=176, num_layers=8, num_heads=4,
             num_kv_heads=2, tie_word_embeddings=False, name="tiny")
    d.update(kw)
    return LlamaConfig(**d)


# ---------------------------------------------------------------- presets
@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_preset_param_counts_match_published(name, count):
    assert get_preset(name).total_params() == count


def _meta_count(cfg: LlamaConfig) -> int:
    """Build the tensors of cfg.param_shapes on the meta device and count their elements."""
    # every decoder layer has layer 0's shapes, so build layer 0 once and count it L times
    for i in range(1, cfg.num_layers):
        assert list(cfg.param_shapes(i).values()) == list(cfg.param_shapes(0).values())
    total = 0
    for i, times in ((None, 1), (0, cfg.num_layers)):
        for pname, shape in cfg.param_shapes(i).items():
            if pname.endswith("embed_tokens.weight"):
                mod = torch.nn.Embedding(shape[0], shape[1], device="meta")
            elif len(shape) == 2:
                mod = torch.nn.Linear(shape[1], shape[0], bias=False, device="meta")
                assert mod.weight.shape == shape
            else:
                mod = torch.nn.Parameter(torch.empty(shape, device="meta"))
            total += times * sum(p.numel() for p in (mod.parameters()
                                                     if isinstance(mod, torch.nn.Module)
                                                     else [mod]))
    return total


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_param_counts_match_meta_construction(name):
    cfg = get_preset(name)
    assert _meta_count(cfg) == cfg.total_params()


def test_preset_values():
    c8 = get_preset("llama-3.1-8b")
    assert (c8.vocab_size, c8.hidden_size, c8.intermediate_size, c8.num_layers, c8.num_heads,
            c8.num_kv_heads, c8.head_dim) == (128256, 4096, 14336, 32, 32, 8, 128)
    assert c8.rope_theta == 500000.0 and c8.max_position_embeddings == 131072
    assert c8.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert not c8.tie_word_embeddings
    c1 = get_preset("llama-3.2-1b")
    assert c1.tie_word_embeddings and c1.head_dim == 64 and c1.rope_scaling["factor"] == 32.0
    s = get_preset("smollm2-135m")
    assert (s.vocab_size, s.hidden_size, s.num_heads, s.num_kv_heads, s.rope_theta,
            s.max_position_embeddings, s.tie_word_embeddings) == (49152, 576, 9, 3, 100000.0,
                                                                  8192, True)
    assert get_preset("meta-llama/Llama-3.1-8B") == c8
    # returned configs are copies: mutating one does not leak into the registry
    get_preset("llama-3.1-8b").rope_scaling["factor"] = 1.0
    assert PRESETS["llama-3.1-8b"].rope_scaling["factor"] == 8.0


def test_unknown_preset_lists_known_names():
    with pytest.raises(KeyError) as ei:
        get_preset("llama-9b")
    msg = str(ei.value)
    for name in PUBLISHED:
        assert name in msg


# ---------------------------------------------------------------- reference figures
def test_reference_optimizer_bytes_per_resident_layer():
    m = get_preset("llama-3.1-8b")
    assert m.params_per_layer() == 218_112_000
    p0 = make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA, resident_layers=0))
    p1 = make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA, resident_layers=1))
    per_layer = p1.stages[1].mem["optimizer"] - p0.stages[1].mem["optimizer"]
    assert per_layer == 218_112_000 * 12
    assert round(gb(per_layer), 2) == 2.62


def test_reference_one_card_eight_resident_does_not_fit():
    m = get_preset("llama-3.1-8b")
    cards = make_cards("furiosa", 1)
    assert cards[0].capacity_bytes == CAP == default_capacity("furiosa")
    plan = make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, resident_layers=8, strict=False))
    st = plan.stages[0]
    assert (len(st.resident), len(st.offloaded)) == (8, 24)
    # "~50 GB": weights + grads + optimizer, in binary units (49.4 GiB = 53.1 GB)
    assert abs(gib(static_bytes(st)) - 50) / 50 < 0.05
    assert static_bytes(st) > CAP                       # over capacity before activations
    assert st.mem["total"] > CAP and not plan.fits
    with pytest.raises(PlacementError) as ei:
        make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, resident_layers=8))
    msg = str(ei.value)
    assert "card 0 (furiosa:0)" in msg and "GiB" in msg and "47.50 GiB" in msg
    assert f"{gib(st.mem['total']):.2f} GiB" in msg
    assert "fewer resident layers" in msg and "recompute" in msg


def test_reference_two_cards_no_resident_about_15_gb_per_card():
    m = get_preset("llama-3.1-8b")
    plan = make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA, resident_layers=0))
    assert plan.split == [16, 16] and plan.fits
    for st in plan.stages:
        assert st.mem["optimizer"] == 0 and not st.resident
        assert abs(gb(static_bytes(st)) - 15) / 15 < 0.10      # 16.06 GB decimal
        assert abs(gib(static_bytes(st)) - 15) / 15 < 0.05     # 14.96 GiB
        assert st.mem["total"] > static_bytes(st)              # + activations + workspace
    assert plan.stages[0].has_embed and not plan.stages[0].has_head
    assert plan.stages[1].has_head and not plan.stages[1].has_embed


# ---------------------------------------------------------------- activations / schedules
def test_activation_formula_llama8b():
    m = get_preset("llama-3.1-8b")
    a = activation_bytes_per_layer(m, REF_SHAPE)
    s, h, heads = 512, 4096, 32
    # eager (math kernel), bf16, q = h, i = 3.5h: norms 2(4 + 2e)h + 8, attention (12 + e)q, MLP 4ei per token,
    # fp32 probabilities 4*a*s*s: s*b*(58h + 8) + 4*a*b*s*s
    assert a == s * (58 * h + 8) + 4 * heads * s * s
    assert logits_bytes(m, REF_SHAPE) == 512 * 128256 * 8


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("M", [1, 2, 8])
def test_in_flight_and_activation_memory(schedule, M):
    m = tiny()
    P = 4
    shape = RunShape(seq_len=64, micro_batch=2, micro_batches=M, schedule=schedule)
    plan = make_plan(PlanRequest(m, shape, make_cards("cpu", P, 2**40), DEFAULT_RATES["cpu"],
                                 resident_layers=0))
    per_layer = activation_bytes_per_layer(m, shape, ATTENTION["cpu"])
    for i, st in enumerate(plan.stages):
        k = min(M, P - i) if schedule == "1f1b" else M
        assert st.in_flight == k == in_flight_micro_batches(i, P, M, schedule)
        expect = k * st.num_layers * per_layer + (k * saved_logits_bytes(m, shape)
                                                  if st.has_head else 0)
        assert st.mem["activations"] == expect


def test_recompute_keeps_layer_inputs_plus_one_layer():
    m = tiny()
    shape = RunShape(seq_len=64, micro_batch=2, micro_batches=4, recompute=True)
    plan = make_plan(PlanRequest(m, shape, make_cards("cpu", 2, 2**40), DEFAULT_RATES["cpu"],
                                 resident_layers=0))
    st = plan.stages[0]
    expect = st.in_flight * st.num_layers * 64 * 2 * m.hidden_size * 2 \
        + activation_bytes_per_layer(m, shape, ATTENTION["cpu"])
    assert st.mem["activations"] == expect
    base = make_plan(PlanRequest(m, RunShape(seq_len=64, micro_batch=2, micro_batches=4),
                                 make_cards("cpu", 2, 2**40), DEFAULT_RATES["cpu"], resident_layers=0))
    assert st.time["compute"] == pytest.approx(base.stages[0].time["compute"] * 8 / 6)


def test_bubble_fraction_balanced():
    m = tiny(num_layers=8, tie_word_embeddings=True)
    M, P = 4, 4
    plan = make_plan(PlanRequest(m, RunShape(seq_len=64, micro_batches=M), make_cards("cpu", P, 2**40),
                                 DEFAULT_RATES["cpu"], split=[2, 2, 2, 2], resident_layers=2))
    st = plan.stages[1]                                   # a middle stage: no head FLOPs
    t_mid = st.time["compute"] / M
    t_last = plan.stages[-1].time["compute"] / M          # + lm_head: the slowest stage
    assert t_last > t_mid == pytest.approx(plan.stages[0].time["compute"] / M)
    # 1F1B timeline with F = t/3, B = 2t/3 on every stage (2 of 6 FLOPs/param/token, 4 of 12 of
    # attention): the last stage starts after P-1 forwards, then computes M (F+B) without a gap;
    # the last micro-batch's gradient then crosses P-1 stages: (P-1)/3 t_mid + M t_last + (P-1) 2/3 t_mid
    assert st.time["compute"] + st.time["bubble"] == pytest.approx((P - 1) * t_mid + M * t_last)
    # equal stages would give the classical (M + P - 1) t: the head's extra time is paid M times, not M+P-1
    assert st.time["compute"] + st.time["bubble"] < (M + P - 1) * t_last
    assert plan.step_time_s == pytest.approx(
        max(s.time["total"] for s in plan.stages))


def test_tied_embedding_copy_on_last_stage():
    m = get_preset("llama-3.2-1b")
    shape = RunShape(seq_len=256, micro_batches=2)
    one = make_plan(PlanRequest(m, shape, make_cards("furiosa", 1), FURIOSA, resident_layers=0))
    two = make_plan(PlanRequest(m, shape, make_cards("furiosa", 2), FURIOSA, resident_layers=0))
    E, Pl = m.embedding_params(), m.params_per_layer()
    assert one.stages[0].mem["weights"] == 2 * (16 * Pl + E + m.hidden_size)
    assert two.stages[0].mem["weights"] == 2 * (8 * Pl + E)
    assert two.stages[1].mem["weights"] == 2 * (8 * Pl + E + m.hidden_size)   # copy as lm_head
    # one card: the tied matrix's optimizer state lives once; two cards: the last stage's
    # optimizer also keeps master + moments of its lm_head copy (on the host here)
    assert one.host_bytes == 12 * m.total_params()
    assert two.host_bytes == one.host_bytes + 12 * E


# ---------------------------------------------------------------- auto placement
def test_auto_more_resident_with_more_capacity_and_never_over():
    m = get_preset("llama-3.1-8b")
    prev = -1
    for cap_gib in range(22, 94, 3):
        cards = make_cards("furiosa", 2, cap_gib * 2**30)
        plan = make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, split=[16, 16], headroom=0.0))
        assert plan.fits
        for st in plan.stages:
            assert st.mem["total"] <= st.card.capacity_bytes
            if len(st.resident) < st.num_layers:          # one more would not fit
                with pytest.raises(PlacementError):
                    make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, split=[16, 16],
                                          resident_layers=[len(s.resident) + (s is st)
                                               for s in plan.stages]))
        n = sum(plan.resident_counts)
        assert n >= prev
        prev = n
        # the split search also stays within capacity
        auto = make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, headroom=0.0))
        assert all(st.mem["total"] <= st.card.capacity_bytes for st in auto.stages)
        assert auto.step_time_s <= plan.step_time_s * (1 + 1e-9)
    assert prev == 32


def test_auto_reference_two_cards():
    m = get_preset("llama-3.1-8b")
    t0 = time.perf_counter()
    plan = make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA))
    assert time.perf_counter() - t0 < 1.0
    assert plan.fits and sum(plan.split) == 32
    assert all(0 < len(st.resident) < st.num_layers for st in plan.stages)
    assert plan.step_time_s < make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA,
                                                    resident_layers=0)).step_time_s
    text = format_plan(plan)
    assert "furiosa:0" in text and "tokens/s" in text and "GiB" in text and "0-" in text


def test_auto_chooses_uneven_split_when_faster():
    # big vocabulary: the lm_head costs ~10 layers of compute, everything fits resident
    m = tiny(vocab_size=32000, hidden_size=256, intermediate_size=688, num_layers=8,
             num_heads=4, num_kv_heads=4)
    rates = DEFAULT_RATES["cpu"]
    shape = RunShape(seq_len=128, micro_batches=4)
    cards = make_cards("cpu", 2, 2**40)
    auto = make_plan(PlanRequest(m, shape, cards, rates))
    bal = make_plan(PlanRequest(m, shape, cards, rates, split=balanced_split(8, 2)))
    assert auto.split[1] < auto.split[0]
    assert auto.step_time_s < bal.step_time_s
    assert all(len(st.resident) == st.num_layers for st in auto.stages)


def test_auto_nothing_fits_raises_with_card_and_gib():
    m = get_preset("llama-3.1-8b")
    cards = make_cards("furiosa", 2, 10 * 2**30)
    with pytest.raises(PlacementError) as ei:
        make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA))
    msg = str(ei.value)
    assert "card 0 (furiosa:0)" in msg and "10.00 GiB" in msg and "more cards" in msg
    plan = make_plan(PlanRequest(m, REF_SHAPE, cards, FURIOSA, strict=False))
    assert not plan.fits and "DOES NOT FIT" in plan_table(plan)


def test_host_ram_too_small():
    m = get_preset("llama-3.1-8b")
    with pytest.raises(PlacementError, match="host RAM"):
        make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA, resident_layers=0,
                              host_ram_bytes=32 * 2**30))
    ok = make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2), FURIOSA, resident_layers=0,
                               host_ram_bytes=512 * 2**30))
    assert ok.host_bytes == 12 * m.total_params()


# ---------------------------------------------------------------- layout errors
def test_resident_more_than_layers_is_error():
    m = get_preset("llama-3.1-8b")
    with pytest.raises(PlacementError, match=r"card 0 \(furiosa:0\) holds 16 layers"):
        make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2, 2**40), FURIOSA, resident_layers=17))
    with pytest.raises(PlacementError, match=r"card 1 \(furiosa:1\)"):
        make_plan(PlanRequest(m, REF_SHAPE, make_cards("furiosa", 2, 2**40), FURIOSA, split=[30, 2],
                              resident_layers=[2, 3]))


def test_more_cards_than_layers_is_error():
    with pytest.raises(PlacementError, match="more cards"):
        make_plan(PlanRequest(tiny(num_layers=2), RunShape(seq_len=16), make_cards("cpu", 3, 2**30),
                              DEFAULT_RATES["cpu"]))


def test_bad_split_is_error():
    m = tiny()
    cards = make_cards("cpu", 2, 2**40)
    for split in ([4, 3], [8, 0], [8]):
        with pytest.raises(PlacementError):
            make_plan(PlanRequest(m, RunShape(seq_len=16), cards, DEFAULT_RATES["cpu"], split=split))


# ---------------------------------------------------------------- rates / cards / units
def test_units_and_cards():
    assert gb(1e9) == 1.0 and gib(2**30) == 1.0
    assert Card("furiosa", 1, CAP).name == "furiosa:1"
    assert Card("cpu", None, 1).name == "cpu"
    with pytest.raises(ValueError):
        make_cards("tpu", 1, 1)
    with pytest.raises(ValueError, match="card kind"):
        make_plan(PlanRequest(tiny(), RunShape(seq_len=16), [Card("tpu", 0, 2**40)], DEFAULT_RATES["cpu"]))
    assert default_capacity("cuda") > 0 and default_capacity("cpu") > 0
    cpu = make_cards("cpu", 4)
    assert cpu[0].capacity_bytes == default_capacity("cpu") // 4 and cpu[3].name == "cpu:3"


def test_dry_run_needs_no_torch():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "from npu_train.model.presets import get_preset\n"
        "from npu_train.hardware import make_cards\n"
        "from npu_train.planner import *\n"
        "p = make_plan(PlanRequest(get_preset('llama-3.1-8b'), RunShape(512, 1, 4), make_cards('furiosa', 2),"
        " load_rates('furiosa', '/nonexistent.json')))\n"
        "text = format_plan(p)\n"
        "assert 'torch' not in sys.modules, 'the planner imported torch'\n"
        "print(time.perf_counter() - t)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                         env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    float(out.stdout.strip())  # the seconds it took (no timed assertion: the CI host's load varies)


def test_load_rates_profile(tmp_path):
    assert load_rates("furiosa", tmp_path / "missing.json") == FURIOSA
    assert FURIOSA.device_flops == pytest.approx(256e12 * 0.4)
    p = tmp_path / "furiosa.json"
    p.write_text(json.dumps({"rates": {"h2d_bytes_per_s": 3e9}, "note": "x"}))
    r = load_rates("furiosa", p)
    assert r.h2d_bytes_per_s == 3e9 and r.device_flops == FURIOSA.device_flops
    p.write_text(json.dumps({"host_adamw_params_per_s": 1e9}))
    assert load_rates("furiosa", p).host_adamw_params_per_s == 1e9
    p.write_text("{not json")
    with pytest.raises(ValueError):
        load_rates("furiosa", p)


def test_per_card_rates_list():
    m = tiny()
    cards = make_cards("cpu", 2, 2**40)
    slow = Rates(1e9, 1e9, 1e9, 1e7)
    plan = make_plan(PlanRequest(m, RunShape(seq_len=32), cards, [DEFAULT_RATES["cpu"], slow],
                                 split=[4, 4], resident_layers=4))
    assert plan.stages[1].time["compute"] > plan.stages[0].time["compute"]
    with pytest.raises(ValueError):
        make_plan(PlanRequest(m, RunShape(seq_len=32), cards, [slow]))


# ---------------------------------------------------------------- schedule facts
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb", "zb-h1"])
def test_in_flight_is_the_schedules_peak(schedule):
    assert schedule in SCHEDULES
    for P in range(1, 5):
        for M in range(1, 9):
            for s in range(P):
                # 1F1B and zb: min(M, P - s) (Narayanan et al. 2021, sec. 2.2); GPipe: all M;
                # ZB-H1 (Qi et al. 2024): every stage min(M, P)
                k = {"1f1b": min(M, P - s), "zb": min(M, P - s), "gpipe": M, "zb-h1": min(M, P)}[schedule]
                sched = peak_in_flight(schedule, s, P, M)
                assert in_flight_micro_batches(s, P, M, schedule) == sched == k, (P, M, s)


# ---------------------------------------------------------------- threads: one fact
F1, F8 = 10e9, 75e9        # training FLOP/s at 1 and 8 threads (7.5x: sublinear, like a real host)
A1, A8 = 1e8, 5e8          # host AdamW params/s at 1 and 8 threads


def _two_count_profile(tmp_path) -> Path:
    """A cpu profile in save_profile's format, measured at 8 (top level) and 1 thread(s)."""
    doc = {
        "version": 1, "kind": "cpu",
        "rates": {
            "device_flops": F8, "h2d_bytes_per_s": 1e10, "d2h_bytes_per_s": 1e10,
            "host_adamw_params_per_s": A8, "device_adamw_params_per_s": 0.0,
            "head_flops_ratio": 1.0, "process_baseline_bytes": 0, "threads": 8,
            "flops_by_dtype": {"fp32": F8, "bf16": F8 / 2},
            "by_threads": {"1": {"device_flops": F1, "h2d_bytes_per_s": 1e10,
                                 "d2h_bytes_per_s": 1e10, "host_adamw_params_per_s": A1,
                                 "device_adamw_params_per_s": 0.0, "head_flops_ratio": 1.0,
                                 "flops_by_dtype": {"fp32": F1, "bf16": F1 / 2}}},
        },
        "machine": {}, "details": {},
    }
    p = tmp_path / "cpu.json"
    p.write_text(json.dumps(doc))
    return p


def test_plan_uses_the_profile_figures_of_its_thread_count(tmp_path):
    m = tiny(tie_word_embeddings=True)
    M, S, b = 4, 32, 2
    shape = RunShape(seq_len=S, micro_batch=b, micro_batches=M, dtype="fp32")
    cards = make_cards("cpu", 1, 2**40)
    rates = load_rates("cpu", _two_count_profile(tmp_path))
    plans = {t: make_plan(PlanRequest(m, shape, cards, rates, split=[8], resident_layers=8, threads=t,
                                      host_cores=8)) for t in (1, 8)}
    # one stage: step = M micro-batches x (8 layers + head) FLOPs / FLOP/s (no bubble, P = 1)
    tok = S * b
    layer = 6.0 * tok * m.params_per_layer() + 12.0 * S * tok * m.num_heads * m.head_dim
    flops = M * (8 * layer + 6.0 * tok * m.embedding_params())
    params = m.total_params()
    for t, f, a in ((1, F1, A1), (8, F8, A8)):
        st = plans[t].stages[0]
        assert st.time["compute"] == pytest.approx(flops / f, rel=1e-12)
        assert st.time["device_optimizer"] == pytest.approx(params / a, rel=1e-12)
        assert plans[t].threads == t
        assert f"threads: {t} torch thread(s) per card process" in plan_table(plans[t])
    c1, c8 = (plans[t].stages[0].time["compute"] for t in (1, 8))
    assert c1 / c8 == pytest.approx(F8 / F1, rel=1e-12)          # 7.5x longer with 1 thread
    # default: the cores divided among the cards (8 cores, 1 card -> 8 threads)
    assert make_plan(PlanRequest(m, shape, cards, rates, split=[8], host_cores=8)).threads == 8


def test_load_rates_threads_rule(tmp_path):
    p = _two_count_profile(tmp_path)
    assert load_rates("cpu", p, threads=1).device_flops == F1
    assert load_rates("cpu", p, threads=8).device_flops == F8
    # unmeasured counts: the nearest measured count, compute-bound figures scaled linearly
    r4 = load_rates("cpu", p, threads=4)                          # |4-1| < |4-8|: from 1 thread
    assert r4.device_flops == pytest.approx(4 * F1) and r4.host_adamw_params_per_s == pytest.approx(4 * A1)
    assert r4.flops("bf16") == pytest.approx(4 * F1 / 2) and r4.h2d_bytes_per_s == 1e10
    r6 = load_rates("cpu", p, threads=6)                          # from 8 threads
    assert r6.device_flops == pytest.approx(6 / 8 * F8) and r6.threads == 6
    r16 = load_rates("cpu", p, threads=16)
    assert r16.device_flops == pytest.approx(2 * F8)
    # a tie goes to the larger count (scaling down is the conservative direction)
    tie = Rates(60e9, 1e10, 1e10, 3e8, threads=6, by_threads={2: {"device_flops": 30e9}})
    assert tie.resolve(threads=4).device_flops == pytest.approx(4 / 6 * 60e9)
    # no thread count known (accelerator profiles): unchanged
    assert load_rates("furiosa", tmp_path / "none.json", threads=3).device_flops == FURIOSA.device_flops


def test_threads_per_card_honours_affinity_and_cgroup_quota(monkeypatch):
    files: dict[str, str] = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    monkeypatch.setattr(planner_threads, "read_sys_file", lambda path: files.get(path))
    assert planner_threads.usable_cores() == 6
    assert threads_per_card(0, 1) == 6 == threads_per_card(None, 1)   # runtime.threads unset
    assert threads_per_card(0, 4) == 1                 # 6 // 4; cpu and accelerator cards alike
    assert threads_per_card(0, 8) == 1                 # at least 1
    assert threads_per_card(3, 4) == 3                 # runtime.threads wins
    files["/sys/fs/cgroup/cpu.max"] = "250000 100000"  # cgroup v2: 2.5 CPUs -> 2 cores
    assert planner_threads.usable_cores() == 2 and threads_per_card(0, 1) == 2
    files["/sys/fs/cgroup/cpu.max"] = "max 100000"     # no limit
    assert threads_per_card(0, 2) == 3
    del files["/sys/fs/cgroup/cpu.max"]                # cgroup v1
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "400000"
    files["/sys/fs/cgroup/cpu/cpu.cfs_period_us"] = "100000"
    assert threads_per_card(0, 1) == 4 and threads_per_card(0, 2) == 2
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "-1"
    assert threads_per_card(0, 1) == 6
    files["/sys/fs/cgroup/cpu/cpu.cfs_quota_us"] = "50000"  # half a CPU: still one thread
    assert threads_per_card(0, 1) == 1
    # the planner's default uses the same rule
    m = tiny()
    plan = make_plan(PlanRequest(m, RunShape(seq_len=32), make_cards("cpu", 2, 2**40), DEFAULT_RATES["cpu"]))
    assert plan.threads == threads_per_card(0, 2) == 1 and plan.host_cores == 1
    with pytest.raises(ValueError):
        threads_per_card(-1, 1)
    with pytest.raises(ValueError):
        threads_per_card(0, 0)


def test_placement_error_is_a_user_error():
    from npu_train.errors import UserError

    assert issubclass(PlacementError, UserError) and issubclass(PlacementError, ValueError)
