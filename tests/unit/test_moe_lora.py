"""LoRA on mixture-of-experts models (issue 37): every expert's projections get their own adapters, the routers are
frozen unless ``lora.train_router``; the adapter written in PEFT's layout loads with ``peft.PeftModel`` onto the
model as transformers 5 builds it (stacked experts: PEFT 0.21 fuses the per-expert adapters, block-diagonally for
gate/up) and gives the same logits (fp32, 1e-5 relative); the planner's adapter count is the module's.
"""
from __future__ import annotations

import json
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from npu_train.model import load_config, load_tensors  # noqa: E402
from npu_train.model.llama import full_model  # noqa: E402
from npu_train.model.lora import (LoraSpec, adapter_shapes, apply_lora, lora_param_names, peft_config,  # noqa: E402
                                  peft_state_dict)

from test_moe_model import _ids, _rel, make_moe  # noqa: E402

peft = pytest.importorskip("peft")

TOL = 1e-5
ATTN_AND_MLP = ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")


def _ours(path, spec, seed=0):
    cfg = load_config(path)
    m = full_model(cfg)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    init = apply_lora(m, spec, seed)
    return cfg, m.eval(), init


def load_peft(base, adapter_dir):
    """``peft.PeftModel.from_pretrained`` with any ``RuntimeWarning`` an error: PEFT warns that way when part of an
    adapter's config matched nothing in the model (e.g. a ``rank_pattern`` key), which a user would see."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def _perturb(m, seed=1):
    """Non-zero B (and routers, when trained): the adapters change the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("train_router,targets", [(False, ATTN_AND_MLP), (True, ATTN_AND_MLP),
                                                  (False, ("v_proj", "up_proj")), (False, ("gate_proj",))])
def test_adapter_loads_in_peft_with_equal_logits(tmp_path, case, train_router, targets):
    """Also one of the experts' fused pair (gate / up) alone: the export adds the partner's zero adapter, without
    which PEFT 0.21 refuses to fuse them, and a zero ``down_proj`` one, without which PEFT loads none ("missing
    adapter keys"); ``gate_proj`` alone: no attention target, no rank pattern. Qwen2-MoE (shared expert) too."""
    path, ref = make_moe(tmp_path, case)
    spec = LoraSpec(r=4, alpha=8.0, targets=targets, train_router=train_router)
    # Qwen3-MoE's case has a dense layer 1 (mlp_only_layers): PEFT 0.21 moves gate/up/down to the stacked experts
    # and drops them from the dense layers, so the adapters here stay on the sparse layers' experts
    cfg, m, init = _ours(path, spec)
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    want = set()
    for i in range(cfg.num_layers):
        want |= set(lora_param_names(i, spec.targets, cfg, train_router))
    assert trainable == want == set(init)
    assert any(".experts.7." in n and ".lora_A." in n for n in trainable)  # every expert has its adapters
    assert any(n.endswith(".gate.weight") for n in trainable) is train_router
    ids = _ids()
    with torch.no_grad():
        base = m(ids)
        assert _rel(base, ref(ids).logits) < TOL  # B = 0: the base model
    _perturb(m)
    # none on Qwen3-MoE's dense layer (see above) nor on Qwen2-MoE's shared expert: PEFT 0.21 would not load them
    dropped = {"qwen3_moe": ".layers.1.mlp.", "qwen2_moe": ".shared_expert."}.get(case, "-")
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad and dropped in n:
                p.zero_()
    trained = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    out = tmp_path / "adapter"
    out.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in peft_state_dict(trained, spec, cfg.family).items()
               if dropped not in k}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(spec, path, cfg.family)))
    pm = load_peft(ref, out)
    with torch.no_grad():
        got, mine = pm(ids).logits, m(ids)
        assert _rel(mine, base) > 1e-3  # the adapters matter
        assert _rel(mine, got) < TOL, _rel(mine, got)


def test_modules_to_save_lists_only_the_routers_the_family_has():
    """A Mixtral adapter's ``modules_to_save`` listed ``shared_expert_gate``, which only Qwen2-MoE has (PEFT loads
    it with equal logits either way: test_adapter_loads_in_peft_with_equal_logits); without trained routers, none."""
    spec = LoraSpec(r=4, alpha=8.0, targets=ATTN_AND_MLP, train_router=True)
    assert peft_config(spec, "m", "mixtral")["modules_to_save"] == ["gate"]
    assert peft_config(spec, "m", "qwen3_moe")["modules_to_save"] == ["gate"]
    assert peft_config(spec, "m", "qwen2_moe")["modules_to_save"] == ["gate", "shared_expert_gate"]
    assert peft_config(LoraSpec(r=4, alpha=8.0, targets=ATTN_AND_MLP), "m", "mixtral")["modules_to_save"] is None


def test_adapter_shapes_are_the_modules_and_the_planners(tmp_path):
    from npu_train.planner.moe import lora_layer_params

    path, _ = make_moe(tmp_path, "qwen2_moe")
    spec = LoraSpec(r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                    train_router=True)
    cfg, m, _ = _ours(path, spec)
    params = dict(m.named_parameters())
    for i in range(cfg.num_layers):
        shapes = adapter_shapes(cfg, i, spec)
        assert all(tuple(params[n].shape) == s for n, s in shapes.items())
        n = sum(torch.Size(s).numel() for s in shapes.values())
        assert n == lora_layer_params(cfg, i, spec.r, spec.targets, True).total
    assert "model.layers.0.mlp.shared_expert.gate_proj.lora_A.weight" in params
    assert params["model.layers.0.mlp.shared_expert_gate.weight"].requires_grad


def test_routers_frozen_by_default_and_their_gradient_flows_when_trained(tmp_path):
    path, _ = make_moe(tmp_path, "mixtral")
    for train_router in (False, True):
        cfg, m, _ = _ours(path, LoraSpec(r=2, targets=("gate_proj",), train_router=train_router))
        m.train()
        m(_ids()).float().pow(2).mean().backward()
        gate = dict(m.named_parameters())["model.layers.0.block_sparse_moe.gate.weight"]
        assert gate.requires_grad is train_router
        assert (gate.grad is not None and bool(gate.grad.abs().sum() > 0)) is train_router


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("train_router", [False, True])
def test_exported_lora_checkpoint_loads_in_peft_and_transformers_with_equal_logits(tmp_path, case, train_router):
    """The export CLI's path end to end: a LoRA checkpoint (adapters on every expert's gate/up/down and on the
    attention, written with the store's writers as a run writes them) through :func:`export_hf`; its ``adapter/``
    loads with ``peft.PeftModel`` onto the base as transformers builds it, and its merged fp32 ``model.safetensors``
    loads with ``from_pretrained`` as the same class with no missing or unexpected keys; both give the trained
    model's logits (ours: the base + the adapters as two paths) within 1e-5 relative."""
    from transformers import AutoModelForCausalLM

    from npu_train.checkpoint.export import export_hf
    from npu_train.checkpoint.store import finalize, save_shard, tmp_dir

    # every layer sparse: PEFT 0.21 drops the MLP adapters of a MoE model's dense layers (see above)
    path, ref = make_moe(tmp_path, case, **({"mlp_only_layers": []} if case == "qwen3_moe" else {}))
    spec = LoraSpec(r=4, alpha=8.0, targets=ATTN_AND_MLP, train_router=train_router)
    cfg, m, _ = _ours(path, spec)
    _perturb(m)
    trained = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    assert sum(".experts." in n for n in trained) == 2 * 3 * cfg.num_layers * cfg.num_experts
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    st = tmp_dir(root, 1, "job1")
    save_shard(st, 0, {f"master.{n}": t for n, t in trained.items()}, {"rank": 0})
    train = {"mode": "lora", "lora_rank": spec.r, "lora_alpha": spec.alpha, "lora_dropout": 0.0,
             "lora_targets": list(spec.targets), "lora_train_router": train_router}
    ck = finalize(root, st, 1, {"model": cfg.to_dict(), "train": train, "model_path": os.path.abspath(path)})
    out = export_hf(ck, str(tmp_path / "hf"), "fp32")
    ids = _ids()
    with torch.no_grad():
        want, base = m(ids), ref(ids).logits
        merged, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager",
                                                            output_loading_info=True)
        assert type(merged) is type(ref) and not any(info.values()), info
        got_merged = merged.eval()(input_ids=ids).logits
        got_peft = load_peft(ref, os.path.join(out, "adapter"))(input_ids=ids).logits
    assert _rel(want, base) > 1e-3  # the adapters (and routers) matter
    assert _rel(got_peft, want) < TOL, _rel(got_peft, want)
    assert _rel(got_merged, want) < TOL, _rel(got_merged, want)
