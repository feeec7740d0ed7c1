"""GGUF ``qwen3moe`` files (issue 37): a tiny file written with gguf-py's ``GGUFWriter`` as llama.cpp's
``convert_hf_to_gguf.py`` lays it out (the experts of a layer stacked in ``blk.<i>.ffn_{gate,up,down}_exps.weight``
``[E, out, in]``, the router in ``ffn_gate_inp.weight``, a dense layer with ``ffn_gate`` / ``ffn_up`` / ``ffn_down``)
reads back as the source arrays: every expert's projection is row ``e`` of its stacked tensor, through the whole
reader, the launcher's tensor index and the chunked reader; the config carries the experts' metadata."""
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
