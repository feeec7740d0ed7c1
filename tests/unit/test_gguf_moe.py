"""GGUF ``qwen3moe`` files (issue 37): a tiny file written with gguf-py's ``GGUFWriter`` as llama.cpp's
``convert_hf_to_gguf.py`` lays it out (the experts of a layer stacked in ``blk.<i>.ffn_{gate,up,down}_exps.weight``
``[E, out, in]``, the router in ``ffn_gate_inp.weight``, a dense layer with ``ffn_gate`` / ``ffn_up`` / ``ffn_down``)
reads back as the source arrays: every expert's projection is row ``e`` of its stacked tensor, through the whole
reader, the launcher's tensor index and the chunked reader; the config carries the experts' metadata. A ``qwen2moe``
file (shared expert ``ffn_*_shexp``, its gate ``ffn_gate_inp_shexp``) of a tiny transformers ``Qwen2MoeForCausalLM``
gives that model's logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from npu_train.model import ModelFormatError, load_config, load_tensors
from npu_train.model.chunks import iter_chunks
from npu_train.model.gguf import gguf_tensor_index
from npu_train.model.llama import stage_param_names

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

H, HEADS, KV, HD, E, K, IE, DENSE, V, LAYERS = 32, 4, 2, 8, 4, 2, 16, 48, 40, 3


def _source() -> dict[str, np.ndarray]:
    """GGUF name -> numpy array (HF row-major shape; stacked experts ``[E, out, in]``), layer 1 dense."""
    rng = np.random.default_rng(0)
    t = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H)}
    for i in range(LAYERS):
        b = f"blk.{i}."
        t.update({b + "attn_norm.weight": (H,), b + "ffn_norm.weight": (H,), b + "attn_q.weight": (HEADS * HD, H),
                  b + "attn_k.weight": (KV * HD, H), b + "attn_v.weight": (KV * HD, H),
                  b + "attn_output.weight": (H, HEADS * HD), b + "attn_q_norm.weight": (HD,),
                  b + "attn_k_norm.weight": (HD,)})
        if i == 1:
            t.update({b + "ffn_gate.weight": (DENSE, H), b + "ffn_up.weight": (DENSE, H),
                      b + "ffn_down.weight": (H, DENSE)})
        else:
            t.update({b + "ffn_gate_inp.weight": (E, H), b + "ffn_gate_exps.weight": (E, IE, H),
                      b + "ffn_up_exps.weight": (E, IE, H), b + "ffn_down_exps.weight": (E, H, IE)})
    return {n: (rng.standard_normal(s) * 0.1 + (1.0 if len(s) == 1 else 0.0)).astype(np.float32)
            for n, s in t.items()}


def _write(path, src: dict, quantised: str = "blk.2.ffn_up_exps.weight") -> dict:
    """Write ``src`` (``quantised`` as Q8_0, the rest F32) to ``path``; returns the values as stored."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny-qwen3moe")
    for fn, v in [(w.add_block_count, LAYERS), (w.add_context_length, 128), (w.add_embedding_length, H),
                  (w.add_feed_forward_length, DENSE), (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                  (w.add_key_length, HD), (w.add_value_length, HD), (w.add_rope_freq_base, 1e6),
                  (w.add_layer_norm_rms_eps, 1e-6), (w.add_vocab_size, V), (w.add_expert_count, E),
                  (w.add_expert_used_count, K), (w.add_expert_feed_forward_length, IE)]:
        fn(v)
    stored = dict(src)
    for name, a in src.items():
        if name == quantised:
            q = gguf.quants.quantize(a, Q.Q8_0)
            w.add_tensor(name, q, raw_dtype=Q.Q8_0)
            stored[name] = gguf.quants.dequantize(q, Q.Q8_0).reshape(a.shape)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _expected(stored: dict) -> dict[str, np.ndarray]:
    """HF name -> value, written from llama.cpp's layout (not from the reader): expert ``e`` = row ``e``."""
    out = {"model.embed_tokens.weight": stored["token_embd.weight"], "model.norm.weight": stored["output_norm.weight"],
           "lm_head.weight": stored["output.weight"]}
    whole = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for i in range(LAYERS):
        pre, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in whole.items():
            out[f"{pre}{hf}.weight"] = stored[f"{b}{g}.weight"]
        if i == 1:
            for p in ("gate", "up", "down"):
                out[f"{pre}mlp.{p}_proj.weight"] = stored[f"{b}ffn_{p}.weight"]
            continue
        out[f"{pre}mlp.gate.weight"] = stored[f"{b}ffn_gate_inp.weight"]
        for e in range(E):
            for p in ("gate", "up", "down"):
                out[f"{pre}mlp.experts.{e}.{p}_proj.weight"] = stored[f"{b}ffn_{p}_exps.weight"][e]
    return out


def test_qwen3moe_reads_as_the_source(tmp_path):
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    want = _expected(_write(path, _source()))
    cfg = load_config(path)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.mlp_only_layers, cfg.intermediate_size, cfg.head_dim) == ("qwen3_moe", E, K, IE, True, (1,), DENSE, HD)
    names = stage_param_names(cfg, 0, cfg.num_layers, True, True)
    assert sorted(names) == sorted(want)
    index = gguf_tensor_index(path)
    for got in (load_tensors(path, cfg, names), load_tensors(path, cfg, names, index=index)):
        for n in names:
            assert torch.equal(got[n], torch.from_numpy(want[n])), n
    parts: dict[str, list] = {}
    for c in iter_chunks(path, cfg, names, index=index, max_elements=100):
        parts.setdefault(c.name, []).append((c.start, c.part))
    for n in names:
        rows = torch.cat([p for _, p in sorted(parts[n], key=lambda x: x[0])])
        assert torch.equal(rows, torch.from_numpy(want[n])), n


def test_too_few_experts_is_a_clear_error(tmp_path):
    path = str(tmp_path / "short.gguf")
    src = _source()
    src["blk.0.ffn_down_exps.weight"] = src["blk.0.ffn_down_exps.weight"][: E - 1]
    _write(path, src)
    cfg = load_config(path)
    with pytest.raises(ModelFormatError, match="ffn_down_exps"):
        load_tensors(path, cfg, stage_param_names(cfg, 0, 1, True, False))


# ---------------------------------------------------------------------------------------------------- qwen2moe
#: HF (transformers ``save_pretrained``: one tensor per expert) -> GGUF names of a Qwen2-MoE layer, from llama.cpp
#: ``gguf-py`` ``TENSOR_NAMES`` / ``MODEL_ARCH.QWEN2MOE`` (attention biases, a shared expert and its gate)
_QWEN2MOE_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                   "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                   "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
                   "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                   "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate.weight": "ffn_gate_inp.weight",
                   "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
                   "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
                   "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
                   "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}


def _write_qwen2moe(path: str, hf_dir: str, squeeze_gate: bool) -> None:
    """A ``qwen2moe`` GGUF of the transformers checkpoint ``hf_dir`` laid out as llama.cpp's
    ``convert_hf_to_gguf.py`` ``Qwen2MoeModel`` writes it: each layer's experts stacked ``[E, out, in]`` per
    projection (``torch.stack`` over the expert index), every other tensor whole, F32; the shared expert's gate
    ``[1, H]`` as is, or as ``[H]`` (``squeeze_gate``: converters that squeezed tensors wrote it so); metadata from
    the config (``expert_shared_feed_forward_length`` for ``shared_expert_intermediate_size``)."""
    import json
    import os

    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        c = json.load(f)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    L, E, H = c["num_hidden_layers"], c["num_experts"], c["hidden_size"]
    t = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    for i in range(L):
        pre, b = f"model.layers.{i}.", f"blk.{i}."
        for hf, g in _QWEN2MOE_LAYER.items():
            t[b + g] = sd[pre + hf]
        if squeeze_gate:
            t[b + "ffn_gate_inp_shexp.weight"] = t[b + "ffn_gate_inp_shexp.weight"].reshape(H)
        for p in ("gate", "up", "down"):
            t[f"{b}ffn_{p}_exps.weight"] = np.stack([sd[f"{pre}mlp.experts.{e}.{p}_proj.weight"] for e in range(E)])
    w = gguf.GGUFWriter(path, "qwen2moe")
    w.add_name("tiny-qwen2moe")
    for fn, v in [(w.add_block_count, L), (w.add_context_length, c["max_position_embeddings"]),
                  (w.add_embedding_length, H), (w.add_feed_forward_length, c["intermediate_size"]),
                  (w.add_head_count, c["num_attention_heads"]), (w.add_head_count_kv, c["num_key_value_heads"]),
                  (w.add_rope_freq_base, float(c["rope_parameters"]["rope_theta"])),
                  (w.add_layer_norm_rms_eps, c["rms_norm_eps"]), (w.add_vocab_size, c["vocab_size"]),
                  (w.add_expert_count, E), (w.add_expert_used_count, c["num_experts_per_tok"]),
                  (w.add_expert_feed_forward_length, c["moe_intermediate_size"]),
                  (w.add_expert_shared_feed_forward_length, c["shared_expert_intermediate_size"])]:
        fn(v)
    for name, a in t.items():
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("squeeze_gate", [False, True])
def test_qwen2moe_logits_equal_transformers(tmp_path, squeeze_gate):
    """A ``qwen2moe`` file of a tiny random Qwen2-MoE (8 experts, top-2, no renormalisation, shared expert 96)
    gives the logits of transformers' ``Qwen2MoeForCausalLM`` on the same weights (fp32, 1e-5 relative), through
    the whole reader, the launcher's tensor index and the chunked reader."""
    from test_moe_model import _ids, _rel, make_moe

    from npu_train.model.llama import full_model

    hf_dir, ref = make_moe(tmp_path, "qwen2_moe")
    path = str(tmp_path / "tiny-qwen2moe.gguf")
    _write_qwen2moe(path, hf_dir, squeeze_gate)
    cfg, want = load_config(path), load_config(hf_dir)
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
            cfg.shared_expert_intermediate_size, cfg.mlp_only_layers) == ("qwen2_moe", 8, 2, 32, False, 96, ())
    m = full_model(cfg)
    names = m.param_names()
    assert sorted(names) == sorted(full_model(want).param_names())
    index = gguf_tensor_index(path)
    direct, indexed = load_tensors(path, cfg, names), load_tensors(path, cfg, names, index=index)
    parts: dict[str, list] = {}
    for c in iter_chunks(path, cfg, names, index=index, max_elements=100):
        parts.setdefault(c.name, []).append((c.start, c.part))
    for n in names:
        rows = torch.cat([p for _, p in sorted(parts[n], key=lambda x: x[0])])
        assert torch.equal(indexed[n], direct[n]) and torch.equal(rows, direct[n]), n
    m.load_named_tensors(direct)
    ids = _ids()
    with torch.no_grad():
        assert _rel(m.eval()(ids), ref(ids).logits) < 1e-5
