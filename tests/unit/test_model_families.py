"""Model families beside Llama (issue 26): Qwen2/2.5, Qwen3, Mistral, against Hugging Face transformers.

Tiny random models made with ``transformers`` (``<Family>ForCausalLM(config)``, non-zero q/k/v biases and
non-trivial norm gains, q/k norms included, so each feature changes the logits), saved with ``save_pretrained``:

- logits of the whole model and of a 2-stage split equal transformers' within 1e-5 relative (fp32), with GQA
  (4 heads, 2 kv heads) and a Qwen3 ``head_dim`` (24) != hidden / heads (16);
- one step's gradients of every parameter equal transformers' autograd within 1e-5 relative;
- the same models converted to GGUF here (llama.cpp names ``attn_q.bias``, ``attn_q_norm``; arch ``qwen2`` /
  ``qwen3``; no q/k permutation for Qwen) give the same logits;
- parameter counts (the planner's) equal transformers' module's; presets equal the published totals;
- LoRA keeps the biases frozen; the export config loads in transformers as the same class with no missing or
  unexpected keys; unsupported families and features are refused with one line naming the fix.
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from npu_train.model import ModelFormatError, check_weights, load_config, load_tensors  # noqa: E402
from npu_train.model.llama import StageModule, full_model, stage_param_names  # noqa: E402

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TOL = 1e-5
_CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
#: (family, tied, extra config): GQA everywhere; Qwen3 with head_dim 24 != 64 / 4
CASES = [("qwen2", False, {}), ("qwen2", True, {}), ("qwen3", False, {"head_dim": 24}), ("mistral", False, {})]


def _hf_config(family: str, tie: bool, **kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    base.update(kw)
    return getattr(transformers, _CLASSES[family][0])(**base)


def _make(tmp_path, family: str, tie: bool = False, seed: int = 0, attn: str = "eager", shard: bool = False, **kw):
    """Save a tiny random ``family`` model in ``tmp_path``; returns ``(dir, fp32 reference model)`` (attention
    implementation ``attn``)."""
    torch.manual_seed(seed)
    cls = getattr(transformers, _CLASSES[family][1])
    model = cls(_hf_config(family, tie, **kw)).eval()
    with torch.no_grad():  # every feature must move the logits: norm gains != 1, biases != 0
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.5)
    d = tmp_path / f"{family}_tie{int(tie)}_sh{int(shard)}"
    model.save_pretrained(str(d), safe_serialization=True, **({"max_shard_size": "40KB"} if shard else {}))
    ref = cls.from_pretrained(str(d), attn_implementation=attn, dtype=torch.float32, local_files_only=True)
    return str(d), ref.eval()


def _ids(V=256, B=2, S=24, seed=1):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _load(path, cfg, first, last, has_embed, has_head) -> StageModule:
    m = StageModule(cfg, first, last, has_embed, has_head)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    return m.eval()


# ----------------------------------------------------------------------------------------------
# logits, split, parameter names and counts
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,tie,kw", CASES)
def test_logits_match_transformers(tmp_path, family, tie, kw):
    path, ref = _make(tmp_path, family, tie, **kw)
    cfg = load_config(path)
    assert cfg.family == family and cfg.tie_word_embeddings is tie
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, kw.get("head_dim", 16))
    assert cfg.qkv_bias is (family == "qwen2") and cfg.qk_norm is (family == "qwen3")
    m = full_model(cfg)
    names = m.param_names()
    assert names == stage_param_names(cfg, 0, 3, True, True)
    hf_names = [n for n, _ in ref.named_parameters()]  # the same names as transformers' module
    assert sorted(names) == sorted(n for n in hf_names if not (tie and n == "lm_head.weight"))
    # the planner's exact counts are the module's
    assert cfg.params_per_layer() == sum(p.numel() for n, p in ref.named_parameters() if ".layers.0." in n)
    assert cfg.total_params() == sum(p.numel() for p in ref.parameters())
    m.load_named_tensors(load_tensors(path, cfg, names))
    m.eval()
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = m(ids)
        assert _rel(got, want) < TOL, _rel(got, want)
        for k in (1, 2):  # 2-stage splits
            h = _load(path, cfg, 0, k, True, False)(ids)
            out = _load(path, cfg, k, 3, False, True)(h)
            assert _rel(out, want) < TOL, (k, _rel(out, want))


@pytest.mark.parametrize("family,tie,kw", CASES[:1] + CASES[2:])
def test_one_step_gradients_match_transformers(tmp_path, family, tie, kw):
    """Summed next-token cross-entropy / target tokens: d loss / d every parameter vs transformers' autograd, both
    in fp64 with HF's SDPA attention (its eager attention takes the softmax in fp32; the RMSNorm statistics stay
    fp32 in both, as in HF). In fp32, or against fp64 eager, rounding alone gives 1.8e-5 / 1.1e-5 on q_proj."""
    path, ref = _make(tmp_path, family, tie, attn="sdpa", **kw)
    cfg = load_config(path)
    m = full_model(cfg)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    m, ref = m.double(), ref.double()
    ids = _ids(S=20)
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    labels[0, :5] = -100  # some masked targets

    def loss_of(logits):  # written from the definition, not the product's loss helper
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100, reduction="sum") / int((labels != -100).sum())

    loss_of(m(ids)).backward()
    loss_of(ref(ids).logits).backward()
    ours = dict(m.named_parameters())
    checked = 0
    for n, p in ref.named_parameters():
        g = ours[n].grad
        assert g is not None, n
        rel = float((g.double() - p.grad.double()).norm() / p.grad.double().norm().clamp_min(1e-30))
        assert rel < TOL, f"{n}: gradient rel diff {rel:.2e}"
        checked += 1
    assert checked == len(ours)
    if family == "qwen2":
        assert ours["model.layers.1.self_attn.k_proj.bias"].grad.abs().sum() > 0
    if family == "qwen3":
        assert ours["model.layers.1.self_attn.q_norm.weight"].grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sharded_safetensors(tmp_path, family):
    path, ref = _make(tmp_path, family, shard=True, **({"head_dim": 24} if family == "qwen3" else {}))
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    cfg = load_config(path)
    check_weights(path, cfg)
    m = _load(path, cfg, 0, 3, True, True)
    ids = _ids()
    with torch.no_grad():
        assert _rel(m(ids), ref(ids).logits) < TOL


# ----------------------------------------------------------------------------------------------
# GGUF (llama.cpp convert_hf_to_gguf layout for qwen2 / qwen3)
# ----------------------------------------------------------------------------------------------
_HF2GGUF = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def write_qwen_gguf(path, hf_model, arch: str, omit=()):
    """Minimal llama.cpp-style Qwen converter: ``<arch>.*`` keys, HF row order (NEOX RoPE: no permute)."""
    hcfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-qwen")
    w.add_block_count(hcfg.num_hidden_layers)
    w.add_context_length(hcfg.max_position_embeddings)
    w.add_embedding_length(hcfg.hidden_size)
    w.add_feed_forward_length(hcfg.intermediate_size)
    w.add_head_count(hcfg.num_attention_heads)
    w.add_head_count_kv(hcfg.num_key_value_heads)
    hd = getattr(hcfg, "head_dim", None) or hcfg.hidden_size // hcfg.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(hcfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(hcfg.rms_norm_eps)
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, t in hf_model.state_dict().items():
        if name == "lm_head.weight" and hcfg.tie_word_embeddings:
            continue
        g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}.get(name)
        if g is None:
            parts = name.split(".")
            g = f"blk.{parts[2]}.{_HF2GGUF['.'.join(parts[3:])]}"
        if g not in omit:
            w.add_tensor(g, np.ascontiguousarray(t.detach().float().numpy()))
    w.add_vocab_size(hcfg.vocab_size)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("family,tie,kw", [("qwen2", True, {}), ("qwen3", False, {"head_dim": 24})])
def test_qwen_gguf_matches_transformers(tmp_path, family, tie, kw):
    _, ref = _make(tmp_path, family, tie, **kw)
    g = write_qwen_gguf(tmp_path / f"{family}.gguf", ref, family)
    cfg = load_config(g)
    assert (cfg.family, cfg.head_dim, cfg.tie_word_embeddings) == (family, kw.get("head_dim", 16), tie)
    check_weights(g, cfg)
    m = full_model(cfg)
    m.load_named_tensors(load_tensors(g, cfg, m.param_names()))
    ids = _ids()
    with torch.no_grad():
        assert _rel(m.eval()(ids), ref(ids).logits) < TOL
    missing = "blk.1.attn_k.bias" if family == "qwen2" else "blk.1.attn_k_norm.weight"
    g2 = write_qwen_gguf(tmp_path / "miss.gguf", ref, family, omit=(missing,))
    with pytest.raises(ModelFormatError, match=f"{missing}.*not found"):
        check_weights(g2, load_config(g2))


def test_qwen2_pre_tokenizer_splits_digits():
    from npu_train.model.tokenizer import pre_tokenizer_for

    pieces = [p for p, _ in pre_tokenizer_for("qwen2").pre_tokenize_str("abc 12345 don't")]
    assert pieces[:7] == ["abc", "Ġ", "1", "2", "3", "4", "5"]  # digits one by one (Llama 3: up to 3)
    assert "Ġdon" in pieces and "'t" in pieces


# ----------------------------------------------------------------------------------------------
# refusals, sliding window, presets
# ----------------------------------------------------------------------------------------------
def _write_cfg(d, family="qwen2", **over):
    raw = _hf_config(family, False).to_dict()
    raw["architectures"] = [_CLASSES[family][1]]
    raw.update(over)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


def test_refusals_name_the_fix(tmp_path):
    for i, arch in enumerate(["GemmaForCausalLM", "Phi3ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM"]):
        with pytest.raises(ModelFormatError, match=r"unsupported architecture.*Qwen2ForCausalLM.*Qwen3ForCausalLM"
                                                   r".*MistralForCausalLM"):
            load_config(_write_cfg(tmp_path / f"a{i}", architectures=[arch], model_type="x"))
    with pytest.raises(ModelFormatError, match=r"config.json: use_sliding_window=true .*set use_sliding_window=false"):
        load_config(_write_cfg(tmp_path / "b", use_sliding_window=True))
    with pytest.raises(ModelFormatError, match=r"config.json: use_sliding_window=true"):
        load_config(_write_cfg(tmp_path / "b3", "qwen3", use_sliding_window=True))
    with pytest.raises(ModelFormatError, match=r"attention_bias=true is not supported for qwen3"):
        load_config(_write_cfg(tmp_path / "c", "qwen3", attention_bias=True))
    with pytest.raises(ModelFormatError, match=r"config.json: num_key_value_heads=3 does not divide "
                                               r"num_attention_heads=4; fix config.json"):
        load_config(_write_cfg(tmp_path / "d", num_key_value_heads=3))
    with pytest.raises(ModelFormatError, match=r"config.json: num_hidden_layers=0: .*fix config.json"):
        load_config(_write_cfg(tmp_path / "e", num_hidden_layers=0))


def test_mistral_sliding_window(tmp_path):
    assert load_config(_write_cfg(tmp_path / "a", "mistral", sliding_window=None)).sliding_window is None
    cfg = load_config(_write_cfg(tmp_path / "b", "mistral", sliding_window=16))
    assert cfg.sliding_window == 16
    m = full_model(cfg)
    with torch.no_grad():
        assert m(_ids(S=16)).shape == (2, 16, 256)  # S <= window: full causal attention is exact
        with pytest.raises(ValueError, match=r"sliding_window=16.*data.seq_len<=16"):
            m(_ids(S=17))
    # a Qwen config's (unused) sliding_window is not honoured: use_sliding_window=false means full attention
    assert load_config(_write_cfg(tmp_path / "c", sliding_window=8)).sliding_window is None


def test_presets_match_published_totals():
    from npu_train.model.presets import get_preset

    # parameter totals of the published checkpoints (HF model cards / safetensors metadata)
    assert get_preset("qwen2.5-7b").total_params() == 7_615_616_512
    assert get_preset("Qwen/Qwen3-8B").total_params() == 8_190_735_360
    assert get_preset("mistral-7b").total_params() == 7_248_023_552
    assert get_preset("qwen2.5-7b").family == "qwen2" and get_preset("qwen3-8b").qk_norm


# ----------------------------------------------------------------------------------------------
# LoRA, export
# ----------------------------------------------------------------------------------------------
def test_lora_keeps_bias_frozen(tmp_path):
    from npu_train.model.lora import LoraSpec, apply_lora

    path, ref = _make(tmp_path, "qwen2")
    cfg = load_config(path)
    m = full_model(cfg)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names()))
    ids = _ids()
    with torch.no_grad():
        before = m(ids)
    apply_lora(m, LoraSpec(r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")), seed=0)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert "model.layers.0.self_attn.q_proj.bias" in dict(m.named_parameters())
    with torch.no_grad():  # B = 0: the adapted model still adds the (frozen) biases
        assert torch.equal(m(ids), before)


@pytest.mark.parametrize("family,kw", [("qwen2", {}), ("qwen3", {"head_dim": 24}), ("mistral", {})])
def test_export_config_loads_as_same_class(tmp_path, family, kw):
    from safetensors.torch import save_file

    from npu_train.checkpoint.export import hf_config_dict

    path, ref = _make(tmp_path, family, **kw)
    cfg = load_config(path)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg, "fp32")))
    save_file(load_tensors(path, cfg, stage_param_names(cfg, 0, 3, True, True)), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert type(hf) is type(ref)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _ids()
    with torch.no_grad():
        assert _rel(hf.eval()(ids).logits, ref(ids).logits) < TOL


@pytest.mark.parametrize("dtype,name,e", [(torch.float32, "fp32", 4), (torch.bfloat16, "bf16", 2)])
def test_planner_activation_terms_follow_the_family(dtype, name, e):
    """Saved activations of one decoder layer, measured with autograd's saved-tensor hooks: Qwen3's q/k norms
    add exactly the planner's term, s*b*((4 + e)*(q + kv) + 4*(a + a_kv)) (their fp32 input, normalized value in
    the compute dtype, fp32 statistic per head; at fp32 the input is the projection's own output); Qwen2's biases
    add nothing."""
    from npu_train.model.config import LlamaConfig
    from npu_train.model.llama import DecoderLayer, rope_cos_sin
    from npu_train.planner.memory import activation_bytes_per_layer
    from npu_train.planner.spec import RunShape

    def measured(cfg, S=64, B=2):
        layer = DecoderLayer(cfg, 0).to(dtype)
        params = {p.untyped_storage()._cdata for p in layer.parameters()}
        seen: dict = {}

        def pack(t):
            if t.untyped_storage()._cdata not in params:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        cos, sin = rope_cos_sin(cfg, S, dtype=dtype)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True), cos, sin)
        return sum(seen.values())

    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=24)
    shape = RunShape(seq_len=64, micro_batch=2, micro_batches=1, schedule="1f1b", dtype=name)
    llama, qwen2, qwen3 = (LlamaConfig(**base, family=f) for f in ("llama", "qwen2", "qwen3"))
    assert measured(qwen2) == measured(llama)
    q, kv = 4 * 24, 2 * 24
    assert measured(qwen3) - measured(llama) == 64 * 2 * ((4 + e) * (q + kv) + 4 * (4 + 2))
    for att in ("sdpa", "eager"):
        assert activation_bytes_per_layer(qwen2, shape, att) == activation_bytes_per_layer(llama, shape, att)
        assert (activation_bytes_per_layer(qwen3, shape, att) - activation_bytes_per_layer(llama, shape, att)
                == measured(qwen3) - measured(llama))


def test_generate_loads_a_qwen_gguf_as_its_class(tmp_path):
    """``npu_train.generate`` on a Qwen GGUF builds transformers' ``Qwen3ForCausalLM`` with the file's weights."""
    from npu_train.generate import _gguf_model

    _, ref = _make(tmp_path, "qwen3", head_dim=24)
    m = _gguf_model(write_qwen_gguf(tmp_path / "q3.gguf", ref, "qwen3"))
    assert type(m) is type(ref)
    ids = _ids()
    with torch.no_grad():
        assert _rel(m.eval()(ids).logits, ref(ids).logits) < TOL
