"""Mixture-of-experts decoders (issue 37): Qwen3-MoE, Qwen2-MoE (shared expert) and Mixtral against transformers.

Tiny random models made with ``transformers`` (``<Family>ForCausalLM(config)``; router weights scaled up so the
routing is far from uniform, norm gains != 1, biases != 0), saved with ``save_pretrained`` (one tensor per
expert, as the Hub holds them) and loaded by npu-train:

- logits of the whole model and of 2-stage splits equal transformers' within 1e-5 relative (fp32);
- the gradients of next-token cross-entropy + ``router_aux_loss_coef`` * transformers' load-balancing loss of
  every parameter equal transformers' autograd within 1e-5 relative (fp64);
- the routing is the family's: with ``norm_topk_prob`` changed on our side only, the logits differ;
- sharded checkpoints load; parameter counts are the module's; the export's config.json + the same tensors load
  in ``AutoModelForCausalLM`` as the same class with no missing or unexpected keys and equal logits.
"""
from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from npu_train.model import ModelFormatError, check_weights, load_config, load_tensors  # noqa: E402
from npu_train.model.llama import StageModule, full_model, stage_param_names  # noqa: E402

transformers = pytest.importorskip("transformers")

TOL = 1e-5
_CLASSES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
            "mixtral": ("MixtralConfig", "MixtralForCausalLM")}
#: (case id, family, config): 8 / 4 experts, hidden 64, 3-4 layers, dense layers mixed in for the Qwens
CASES = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1], head_dim=24)),
    "qwen3_moe_step2": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=48,
                                          norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=96, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=40)),
}


def _hf_config(family: str, **kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, router_aux_loss_coef=0.02)
    base.update(kw)
    return getattr(transformers, _CLASSES[family][0])(**base)


def make_moe(tmp_path, case: str, seed: int = 0, attn: str = "eager", shard: bool = False, experts=None, **over):
    """Save a tiny random model of ``CASES[case]`` in ``tmp_path``; returns ``(dir, fp32 transformers model)`` with
    the attention implementation ``attn`` and the experts implementation ``experts`` (None: transformers' default,
    ``grouped_mm``, which has no fp64 kernel)."""
    family, kw = CASES[case]
    torch.manual_seed(seed)
    cls = getattr(transformers, _CLASSES[family][1])
    model = cls(_hf_config(family, **{**kw, **over})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif n.endswith("mlp.gate.weight"):  # the router: far from uniform, so the top-k matters
                p.normal_(0.0, 0.5)
            elif n.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.5)
    d = tmp_path / f"{case}_sh{int(shard)}"
    model.save_pretrained(str(d), safe_serialization=True, **({"max_shard_size": "60KB"} if shard else {}))
    ref = cls.from_pretrained(str(d), attn_implementation=attn, dtype=torch.float32, local_files_only=True,
                              **({} if experts is None else {"experts_implementation": experts}))
    return str(d), ref.eval()


def _ids(V=256, B=2, S=24, seed=1):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _load(path, cfg, first, last, has_embed, has_head) -> StageModule:
    m = StageModule(cfg, first, last, has_embed, has_head)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    return m.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    path, ref = make_moe(tmp_path, case)
    cfg = load_config(path)
    family, kw = CASES[case]
    assert cfg.family == family and cfg.is_moe
    L = cfg.num_layers
    assert [cfg.is_moe_layer(i) for i in range(L)] == [
        type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in ref.model.layers]
    m = full_model(cfg)
    names = m.param_names()
    assert names == stage_param_names(cfg, 0, L, True, True)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:  # the file's names are ours
        assert sorted(names) == sorted(f.keys())
    assert cfg.total_params() == sum(p.numel() for p in ref.parameters())
    check_weights(path, cfg)
    m.load_named_tensors(load_tensors(path, cfg, names))
    m.eval()
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = m(ids)
        assert _rel(got, want) < TOL, _rel(got, want)
        for k in range(1, L):  # 2-stage splits
            h = _load(path, cfg, 0, k, True, False)(ids)
            out = _load(path, cfg, k, L, False, True)(h)
            assert _rel(out, want) < TOL, (k, _rel(out, want))


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen3_moe_step2", "mixtral"])
def test_routing_is_the_familys(tmp_path, case):
    """Renormalising (or not) the top-k weights changes the logits: the parity above is not an accident."""
    path, ref = make_moe(tmp_path, case)
    cfg = load_config(path)
    flipped = dataclasses.replace(cfg, norm_topk_prob=not cfg.norm_topk_prob)
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
        m = _load(path, flipped, 0, cfg.num_layers, True, True)
        if case == "mixtral":  # Mixtral always renormalises, whatever the field says
            assert _rel(m(ids), want) < TOL
            for blk in (lay.ffn for lay in m.model.layers.values()):
                blk.norm_topk_prob = False
        assert _rel(m(ids), want) > 1e-3


def _aux_from_records(records, E: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` written from its formula over the recorded layers:
    ``E * sum_e (T_e / R) * (P_e / R)``, ``T_e`` top-k assignments of expert ``e`` summed over layers, ``P_e`` its
    routing probabilities summed over layers and tokens, ``R`` the rows summed over layers."""
    T = sum(r.counts for r in records)
    P = sum(r.prob_sum for r in records)
    R = sum(r.rows for r in records)
    return E * torch.sum((T / R) * (P / R))


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_with_aux_loss_match_transformers(tmp_path, case):
    """d (CE / target tokens + coef * aux) / d every parameter vs transformers (``output_router_logits=True``,
    ``labels``: its own loss), fp64, SDPA attention on both sides, transformers' eager experts (its grouped_mm
    has no fp64 kernel; the two differ only in the order of the per-token sum)."""
    path, ref = make_moe(tmp_path, case, attn="sdpa", experts="eager")
    cfg = load_config(path)
    assert cfg.router_aux_loss_coef == pytest.approx(0.02)
    m = full_model(cfg)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    m, ref = m.double(), ref.double()
    ids = _ids(S=20)
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    labels[0, :5] = -100
    rec = m.router_recorder
    rec.start(with_probs=True)
    logits = m(ids)
    records = rec.take()
    assert len(records) == len(cfg.moe_layers())
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                         reduction="sum") / int((labels != -100).sum())
    aux = _aux_from_records(records, cfg.num_experts)
    (ce + cfg.router_aux_loss_coef * aux).backward()
    hf_labels = torch.cat([torch.full((ids.shape[0], 1), -100), labels[:, :-1]], dim=1)  # HF shifts them itself
    out = ref(ids, labels=hf_labels, output_router_logits=True)
    assert abs(float(out.aux_loss.detach()) - float(aux.detach())) < 1e-9 * max(1.0, float(aux.detach()))
    out.loss.backward()
    # an expert no token was sent to has no gradient (transformers': zeros in its stacked tensor)
    ours = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in m.named_parameters()}
    assert all(p.grad is not None for n, p in m.named_parameters() if ".experts." not in n)
    as_hf = hf_layout(ours, cfg)
    assert len(as_hf) == len(list(ref.parameters()))
    for n, p in ref.named_parameters():
        rel = float((as_hf[n] - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
        assert rel < TOL, f"{n}: gradient rel diff {rel:.2e}"
    router = [n for n in ours if n.endswith(".gate.weight")]
    assert router and all(ours[n].abs().sum() > 0 for n in router)


def hf_layout(tensors: dict, cfg) -> dict:
    """Checkpoint-named tensors (one per expert) in transformers 5's module layout: Mixtral's ``block_sparse_moe``
    renamed ``mlp``; per layer the experts stacked as ``experts.gate_up_proj`` [E, 2 I, H] (gate rows, then up)
    and ``experts.down_proj`` [E, H, I] (``conversion_mapping.py``: MergeModulelist + Concatenate)."""
    from npu_train.model.config import FAMILIES

    g, u, d = FAMILIES[cfg.family].expert_projs
    out, E = {}, cfg.num_experts
    for n, t in tensors.items():
        if ".experts." not in n:
            out[n.replace(".block_sparse_moe.", ".mlp.")] = t
    for i in cfg.moe_layers():
        p = f"model.layers.{i}.{FAMILIES[cfg.family].moe_prefix}.experts."
        q = f"model.layers.{i}.mlp.experts."
        out[q + "gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}{e}.{g}.weight"], tensors[f"{p}{e}.{u}.weight"]]) for e in range(E)])
        out[q + "down_proj"] = torch.stack([tensors[f"{p}{e}.{d}.weight"] for e in range(E)])
    return out


def test_sharded_checkpoint(tmp_path):
    path, ref = make_moe(tmp_path, "qwen3_moe", shard=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    cfg = load_config(path)
    check_weights(path, cfg)
    m = _load(path, cfg, 0, cfg.num_layers, True, True)
    ids = _ids()
    with torch.no_grad():
        assert _rel(m(ids), ref(ids).logits) < TOL


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_config_loads_as_same_class(tmp_path, case):
    from safetensors.torch import save_file

    from npu_train.checkpoint.export import hf_config_dict

    path, ref = make_moe(tmp_path, case)
    cfg = load_config(path)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, "fp32")))
    save_file(load_tensors(path, cfg, stage_param_names(cfg, 0, cfg.num_layers, True, True)),
              str(out / "model.safetensors"), metadata={"format": "pt"})
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert type(hf) is type(ref)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert dataclasses.replace(load_config(str(out)), name=cfg.name) == cfg
    ids = _ids()
    with torch.no_grad():
        assert _rel(hf.eval()(ids).logits, ref(ids).logits) < TOL


def test_refusals_name_the_fix(tmp_path):
    raw = _hf_config("mixtral", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1).to_dict()
    raw["architectures"] = ["MixtralForCausalLM"]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=r"router_jitter_noise=0.1 .*set router_jitter_noise=0.0"):
        load_config(str(tmp_path / "a"))
    raw = _hf_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8).to_dict()
    raw["architectures"] = ["Qwen3MoeForCausalLM"]
    del raw["moe_intermediate_size"]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFormatError, match=r"'moe_intermediate_size' of a qwen3_moe model is missing"):
        load_config(str(tmp_path / "b"))
