"""RNGD runtime settings without a card: the warm-up before step 1, the runtime.furiosa / placement
configuration reaching the plan and the card processes, the first-step line's compile time."""
from __future__ import annotations

import dataclasses

import io

import pytest
import torch
from omegaconf import OmegaConf

from npu_train.backends.cpu import CPUBackend
from npu_train.backends.furiosa_compile import FuriosaCompileOptions
from npu_train.config import Config, ConfigError, validate
from npu_train.model.config import LlamaConfig
from npu_train.model.llama import StageModule
from npu_train.planner import plan_table
from npu_train.runtime.warmup import warm_up_stage

GIB = 2**30


def _cfg(**over):
    cfg = OmegaConf.structured(Config)
    for k, v in over.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def _tiny():
    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=4,
                       num_heads=4, num_kv_heads=2, tie_word_embeddings=False, name="tiny")


# ---------------------------------------------------------------- warm-up
@pytest.mark.parametrize("first,last", [(True, True), (True, False), (False, False), (False, True)])
def test_warm_up_compiles_without_changing_training_state(first, last):
    torch.manual_seed(0)
    m = StageModule(_tiny(), 1, 3, first, last)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    rng = torch.get_rng_state()
    ops = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Count():
        dt = warm_up_stage(m, CPUBackend(), first=first, last=last, micro_batch=2, seq_len=8,
                           hidden_size=32, dtype=torch.float32)
    assert dt >= 0.0
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())   # weights unchanged
    assert all(p.grad is None for p in m.parameters())                      # no gradient left
    assert torch.equal(torch.get_rng_state(), rng)                          # no random numbers drawn
    # it ran a backward (mm of every projection's weight gradient) and an AdamW step
    assert any("addcdiv" in o for o in ops) and any("mm" in o for o in ops)


# ---------------------------------------------------------------- configuration
@pytest.mark.parametrize("key,value,match", [
    ("placement.headroom", 0.5, "placement.headroom"),
    ("placement.headroom", -0.1, "placement.headroom"),
    ("runtime.furiosa.loaded_modules", -1, "loaded_modules"),
    ("runtime.furiosa.accounting", "rss", "accounting"),
])
def test_config_validation(key, value, match):
    with pytest.raises(ConfigError, match=match):
        validate(_cfg(**{key: value}))


def test_dry_run_plan_carries_headroom_cache_dir_and_module_cache(tmp_path, monkeypatch):
    from npu_train.runtime.job import furiosa_runtime_fields, prepare

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(**{"plan": True, "model.path": "llama-3.1-8b", "backend": ["furiosa:auto", "furiosa:auto"],
                  "data.seq_len": 512, "train.micro_batch": 1, "train.accum": 4,
                  "placement.headroom": 0.1, "runtime.furiosa.loaded_modules": 1024})
    plan = prepare(cfg, str(tmp_path), probe=False).plan
    assert plan.headroom == 0.1
    assert all(st.mem["total"] <= 0.9 * st.card.capacity_bytes for st in plan.stages)
    assert all(st.mem["modules"] == 1024 * 2**20 for st in plan.stages)
    assert plan.compiler_cache_dir == str(tmp_path / "cache" / "furiosa" / "compiler")
    text = plan_table(plan)
    assert "headroom 10% of capacity" in text
    assert f"compiler cache (runtime.furiosa.compiler_cache_dir): {plan.compiler_cache_dir}" in text
    assert "loaded-module cache 1024 x 1.0 MiB (configured" in text
    fields = furiosa_runtime_fields(cfg, plan)
    assert fields["furiosa"] == FuriosaCompileOptions(plan.compiler_cache_dir, 1024, False)
    assert fields["warmup"] is True and fields["furiosa_accounting"] == "dispatch"


def test_a_dry_run_for_accelerators_prints_no_thread_count_of_this_machine(tmp_path, monkeypatch):
    """``plan=true`` for RNGD cards plans another machine: it printed this machine's cores and the threads they
    give. Unless runtime.threads says otherwise it plans 1 thread per card process with no oversubscription,
    whatever the cores here, and says how to plan the server's."""
    from npu_train.planner import threads as T
    from npu_train.runtime.job import prepare

    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(T, "usable_cores", lambda: 64)
    cfg = _cfg(**{"plan": True, "model.path": "llama-3.1-8b", "backend": ["furiosa:auto", "furiosa:auto"]})
    prep = prepare(cfg, str(tmp_path), probe=False)
    first = plan_table(prep.plan).splitlines()[0]
    assert prep.plan.threads == 1 and "64" not in first and "32" not in first, first
    assert first.startswith("threads: 1 torch thread(s) per card process (a dry run for another machine: "
                            "runtime.threads=<its cores per card> plans its host terms)")
    cfg = _cfg(**{"plan": True, "model.path": "llama-3.1-8b", "backend": ["furiosa:auto", "furiosa:auto"],
                  "runtime.threads": 8})
    first = plan_table(prepare(cfg, str(tmp_path), probe=False).plan).splitlines()[0]
    assert first.startswith("threads: 8 torch thread(s) per card process, ") and "usable host core(s)" in first


def test_cpu_plan_names_no_compiler_cache(tmp_path):
    from npu_train.runtime.job import prepare

    cfg = _cfg(**{"plan": True, "model.path": "smollm2-135m", "backend": ["cpu", "cpu"]})
    plan = prepare(cfg, str(tmp_path), probe=False).plan
    assert plan.compiler_cache_dir == "" and "compiler cache" not in plan_table(plan)
    assert all(st.mem["modules"] == 0 for st in plan.stages)


def test_runtime_spec_backend_kwargs():
    from npu_train.runtime.spec import RuntimeSpec

    opts = FuriosaCompileOptions("/c", 512, False)
    rt = RuntimeSpec(heartbeat_interval_s=1.0, transport="shm", threads=4, recv_timeout_s=120.0,
                     collective_timeout_s=120.0, furiosa=opts, furiosa_accounting="uploads", warmup=True)
    assert rt.backend_kwargs("furiosa") == {"accounting": "uploads", "compile_options": opts}
    assert rt.backend_kwargs("cpu") == {} == rt.backend_kwargs("cuda")


# ---------------------------------------------------------------- the first step's line
def test_first_step_line_says_how_long_compilation_took(tmp_path):
    from npu_train.metrics.report import Reporter

    out = io.StringIO()
    rep = Reporter(str(tmp_path), 2, stream=out, tensorboard=False)
    base = dict(loss=2.0, lr=1e-4, grad_norm=1.0, tokens=100, time_s=1.0, compute_s=0.5,
                optimizer_s=0.1, transfer_s=0.0, send_s=0.0, mem_peak=GIB)
    rec = rep.step([dict(base, step=1, compile_s=150.0, cpu_fallbacks=0),
                    dict(base, step=1, compile_s=120.5, cpu_fallbacks=3)])
    assert rec["compile_s"] == 150.0 and rec["cpu_fallbacks"] == 3
    rec2 = rep.step([dict(base, step=2, compile_s=0.0), dict(base, step=2, compile_s=0.0)])
    rep.close()
    first, second = out.getvalue().split("\nstep ")  # each step folded over lines of at most 100 columns
    assert "compiled before the step in 150.0 s" in first and "3 op(s) fell back to the CPU" in first
    assert "compiled" not in second and rec2["compile_s"] == 0.0


# ---------------------------------------------------------------- whole-layer compiled path (stand-in)
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_compiled_layers_wiring_matches_eager_with_stand_in_builders(family):
    """furiosa-torch's DfgModule + autograd builder replaced by stand-ins that run the given
    function eagerly (forward) and differentiate it with torch.autograd (backward): the stage's
    output and every gradient equal the eager stage's, parameter names stay, one graph per shape,
    and the saved tensors and outputs go to ``track``. The layer function takes every named parameter,
    so Qwen2's q/k/v biases and Qwen3's q/k norms (random here, so they matter) go through the graph too."""
    from npu_train.backends.furiosa_layer import install_compiled_layers

    built = []

    def dfg_from_module(fn, example):
        assert all(t.device.type == "cpu" for t in example)          # furiosa: CPU example args
        return fn

    def build_autograd(fn, name):
        built.append(name)

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *args):
                ctx.save_for_backward(*args)
                return (fn(*args),)

            @staticmethod
            def backward(ctx, g):
                args = [a.detach().requires_grad_(a.is_floating_point()) for a in ctx.saved_tensors]
                with torch.enable_grad():
                    out = fn(*args)
                diff = [a for a in args if a.requires_grad]  # not the packed rows' bool mask
                grads = iter(torch.autograd.grad(out, diff, g, allow_unused=True))
                return tuple(next(grads) if a.requires_grad else None for a in args)

        return Fn

    torch.manual_seed(0)
    cfg = dataclasses.replace(_tiny(), family=family)
    ref = StageModule(cfg, 0, 3, True, True)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith((".bias", "norm.weight")):
                p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.3)
    test = StageModule(cfg, 0, 3, True, True)
    test.load_state_dict(ref.state_dict())
    names = [n for n, _ in test.named_parameters()]
    tracked = []
    n = install_compiled_layers(test, lambda t: tracked.append(t) or t, (dfg_from_module, build_autograd))
    assert n == 3 and [n for n, _ in test.named_parameters()] == names
    x = torch.randint(0, 128, (2, 8))
    for m in (ref, test):
        m(x).float().pow(2).mean().backward()
    assert torch.allclose(test(x), ref(x), rtol=1e-5, atol=1e-6)
    for (na, a), (nb, b) in zip(ref.named_parameters(), test.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), na
    assert built == ["npu_train_decoder_layer"]                         # 3 layers, one shape
    # packed rows: the mask is one more graph input (a second graph per shape)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 0, 1, 0]])
    n_graphs = len(built)
    for m in (ref, test):
        m.zero_grad()
        m(x, positions=pos).float().pow(2).mean().backward()
    assert len(built) == n_graphs + 1                                   # 3 layers, one packed shape
    assert torch.allclose(test(x, positions=pos), ref(x, positions=pos), rtol=1e-5, atol=1e-6)
    for (na, a), (nb, b) in zip(ref.named_parameters(), test.named_parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), na
    assert len(tracked) >= 3 * (3 + 9 + 1)                               # h, cos, sin, 9 weights, out


def test_compiled_layers_off_by_default():
    from npu_train.backends.furiosa import FuriosaBackend

    assert FuriosaBackend(0).prepare_module(StageModule(_tiny(), 0, 1, True, False)) == 0
    assert CPUBackend().prepare_module(None) == 0
