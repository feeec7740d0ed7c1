"""GGUF files (llama.cpp ``convert_hf_to_gguf.py`` output, architectures ``llama``, ``qwen2``, ``qwen3``,
``qwen3moe``, ``qwen2moe``: one expert's projection is a row of the stacked ``ffn_*_exps`` tensors,
:func:`gguf_source`; Qwen2-MoE's shared expert is ``ffn_*_shexp``, its gate ``ffn_gate_inp_shexp``): tensors
dequantised to fp32; a ``llama`` file's q/k rows un-permuted from llama.cpp's interleaved RoPE to HF's rotate-half
(:func:`gguf_unpermute`; Qwen files keep HF's row order: llama.cpp runs them with NEOX rotate-half RoPE).
"""
from __future__ import annotations

import functools
import math
import os
import re
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .config import FAMILIES, MOE_FAMILIES, LlamaConfig
from .files import LAYER_RE, ModelFormatError, SUPPORTED_HINT, check_finite, shape_error
from .hf import first_id

__all__ = ["gguf_reader", "gguf_field", "gguf_config", "gguf_tensors", "iter_gguf_tensors", "gguf_wanted_tensors", "gguf_unpermute",
           "hf_to_gguf_name", "gguf_source", "clear_gguf_cache", "file_key", "gguf_tensor_index"]


def file_key(path: str) -> tuple[str, int, int]:
    """``(realpath, size in bytes, mtime in ns)``: identifies a file version for caches."""
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=2)
def _gguf_reader_cached(real: str, size: int, mtime_ns: int):
    import gguf

    try:
        reader = gguf.GGUFReader(real)
    except Exception as e:  # noqa: BLE001 - any parse failure means a bad file
        raise ModelFormatError(
            f"{real}: cannot parse GGUF ({type(e).__name__}: {e}); the file is truncated or not "
            f"a GGUF file — re-download it or re-convert with llama.cpp convert_hf_to_gguf.py"
        ) from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFormatError(
                f"{real}: tensor {t.name!r} extends past the end of the file ({size} bytes); "
                f"the file is truncated or not a GGUF file — re-download it"
            )
    return reader


def clear_gguf_cache() -> None:
    """Drop the cached ``GGUFReader`` objects once loading is done."""
    _gguf_reader_cached.cache_clear()


def gguf_reader(path: str):
    """The cached ``gguf.GGUFReader`` of ``path`` (validated: no tensor past the end of the file);
    :class:`ModelFormatError` for a truncated or non-GGUF file."""
    return _gguf_reader_cached(*file_key(path))


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The decoded value of metadata ``key`` of ``reader``, or ``default``."""
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001
        return default


def _gguf_model_name(reader, path: str) -> str:
    """How messages name a GGUF model: the file's stem when it contains ``general.basename``,
    else ``general.name``, else the file's name."""
    stem = os.path.basename(path)
    stem = stem[:-len(".gguf")] if stem.lower().endswith(".gguf") else stem
    base = str(gguf_field(reader, "general.basename") or "").strip().lower()
    if base and base in stem.lower():
        return stem
    return str(gguf_field(reader, "general.name") or "").strip() or stem


#: GGUF ``general.architecture`` -> family (a Mistral-7B GGUF is written as ``llama``)
GGUF_FAMILIES = {f.gguf_arch: name for name, f in FAMILIES.items() if f.gguf_arch}


def gguf_config(path: str) -> LlamaConfig:
    """The :class:`LlamaConfig` read from the ``<arch>.*`` metadata of a GGUF file (arch ``llama``, ``qwen2``,
    ``qwen3``, ``qwen3moe`` or ``qwen2moe``); :class:`ModelFormatError` for another architecture or
    missing/inconsistent keys."""
    r = gguf_reader(path)
    arch = gguf_field(r, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ModelFormatError(
            f"{path}: GGUF general.architecture is {arch!r}, not one of {sorted(GGUF_FAMILIES)}; {SUPPORTED_HINT}"
        )

    def req(key: str) -> Any:
        v = gguf_field(r, f"{arch}.{key}")
        if v is None:
            raise ModelFormatError(f"{path}: required GGUF key '{arch}.{key}' is missing; "
                                   f"re-convert with llama.cpp convert_hf_to_gguf.py")
        return v

    def opt(key: str, default: Any) -> Any:
        return gguf_field(r, f"{arch}.{key}", default)

    n_layers = int(req("block_count"))
    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv = opt("attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer array form
        if len(set(kv)) != 1:
            raise ModelFormatError(f"{path}: per-layer head_count_kv {kv} not supported")
        kv = kv[0]
    if n_layers <= 0 or heads <= 0 or int(kv) <= 0 or heads % int(kv):
        raise ModelFormatError(f"{path}: GGUF {arch}.block_count={n_layers}, {arch}.attention.head_count={heads}, "
                               f"head_count_kv={kv}: need >= 1 layer and head_count_kv dividing head_count; "
                               "re-convert the model")
    head_dim = int(opt("attention.key_length", hidden // heads))
    rope_dims = int(opt("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFormatError(f"{path}: partial rotary (rope.dimension_count={rope_dims} < "
                               f"head_dim={head_dim}) is not supported")
    tensor_names = {t.name for t in r.tensors}
    vocab = opt("vocab_size", None)
    if vocab is None:
        toks = r.fields.get("tokenizer.ggml.tokens")
        if toks is not None:
            vocab = len(toks.data)
        else:
            emb = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
            if emb is None:
                raise ModelFormatError(f"{path}: cannot determine vocab size (no {arch}.vocab_size, "
                                       f"tokenizer.ggml.tokens or token_embd.weight)")
            vocab = int(emb.shape[-1])
    theta = float(opt("rope.freq_base", 10000.0))
    moe = _gguf_moe(GGUF_FAMILIES[arch], req, opt, n_layers, tensor_names) if GGUF_FAMILIES[arch] in MOE_FAMILIES \
        else {}
    cfg_kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(opt("feed_forward_length", moe["moe_intermediate_size"])) if moe else
        int(req("feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(opt("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(opt("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=first_id(gguf_field(r, "tokenizer.ggml.bos_token_id")),
        eos_token_id=first_id(gguf_field(r, "tokenizer.ggml.eos_token_id")),
        name=_gguf_model_name(r, path),
        family=GGUF_FAMILIES[arch],
    )
    cfg_kwargs["rope_scaling"] = _gguf_rope_scaling(r, path, arch, theta, head_dim, tensor_names)
    return LlamaConfig(**cfg_kwargs, **moe)


def _gguf_moe(family: str, req, opt, n_layers: int, tensor_names: set) -> dict:
    """The mixture-of-experts fields of a ``qwen3moe`` or ``qwen2moe`` file (llama.cpp ``convert_hf_to_gguf.py``
    ``Qwen3MoeModel`` / ``Qwen2MoeModel``): ``<arch>.expert_count``, ``expert_used_count``,
    ``expert_feed_forward_length``; Qwen2-MoE's shared expert width from ``expert_shared_feed_forward_length``.
    ``norm_topk_prob`` from ``expert_weights_norm`` when written, else what llama.cpp's graph does for the
    architecture (``src/models/qwen3moe.cpp`` renormalises the top-k weights, ``qwen2moe.cpp`` does not, as
    Qwen1.5-MoE-A2.7B's and Qwen2-57B-A14B's ``norm_topk_prob=false``); the layers without
    ``blk.<i>.ffn_gate_exps.weight`` keep a dense MLP (``mlp_only_layers``). The load-balancing loss settings are
    not in GGUF files: off unless ``train.moe_aux_loss`` sets them."""
    out = dict(num_experts=int(req("expert_count")), num_experts_per_tok=int(req("expert_used_count")),
               moe_intermediate_size=int(req("expert_feed_forward_length")),
               norm_topk_prob=bool(opt("expert_weights_norm", family == "qwen3_moe")),
               mlp_only_layers=tuple(i for i in range(n_layers)
                                     if f"blk.{i}.ffn_gate_exps.weight" not in tensor_names))
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(req("expert_shared_feed_forward_length"))
    return out


def _gguf_rope_scaling(r, path: str, arch: str, theta: float, head_dim: int,
                       tensor_names: set[str]) -> Optional[dict]:
    kind = gguf_field(r, f"{arch}.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama-3 scaling as per-frequency divisors; recover the HF parameters.
        t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        import gguf

        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        return _fit_llama3_scaling(factors, theta, head_dim, path)
    if kind in (None, "none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf_field(r, f"{arch}.rope.scaling.factor", 1.0))}
    raise ModelFormatError(f"{path}: GGUF rope scaling type {kind!r} is not supported "
                           f"(supported: none, linear, llama3 rope_freqs)")


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                    orig: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf rope_factors (divisor of each inverse frequency)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wl = 2 * math.pi / inv
    out = np.empty_like(inv)
    for i, w in enumerate(wl):
        if w < orig / high:
            out[i] = 1.0
        elif w > orig / low:
            out[i] = factor
        else:
            s = (orig / w - low) / (high - low)
            out[i] = 1.0 / ((1 - s) / factor + s)
    return out


def _fit_llama3_scaling(factors: np.ndarray, theta: float, head_dim: int, path: str) -> dict:
    if factors.shape[0] != head_dim // 2:
        raise ModelFormatError(f"{path}: rope_freqs.weight has {factors.shape[0]} entries, "
                               f"expected head_dim/2 = {head_dim // 2}")
    factor = float(np.round(factors.max(), 4))

    def ok(low: float, high: float, orig: float) -> bool:
        cand = _llama3_factors(theta, head_dim, factor, low, high, orig)
        return bool(np.allclose(cand, factors, rtol=1e-4, atol=1e-6))

    def result(low: float, high: float, orig: float) -> dict:
        return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": orig}

    # the usual published values first (Llama 3.1/3.2: low 1, high 4, original 8192)
    # (only orig/low and orig/high matter, so prefer low = 1 to pin the scale)
    for low in (1.0, 0.5, 2.0, 4.0):
        for high in (4.0, 2.0, 8.0, 16.0, 32.0):
            for orig in [2 ** k for k in (13, 12, 14, 15, 16, 17, 11, 10, 9, 8, 7, 6, 5, 4)]:
                if high > low and ok(low, high, orig):
                    return result(low, high, orig)
    # otherwise solve for the smoothing band: the factors depend only on orig/low and
    # orig/high, so fix low = 1 and fit s = (orig/wavelen - 1) / (high - 1) linearly.
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wl = 2 * math.pi / inv
    med = ~np.isclose(factors, 1.0, rtol=1e-5) & ~np.isclose(factors, factor, rtol=1e-5)
    if factor > 1 and med.sum() >= 2:
        s = (1.0 / factors[med] - 1.0 / factor) / (1.0 - 1.0 / factor)
        a, b = np.polyfit(1.0 / wl[med], s, 1)
        if b < 0:
            high = float(1.0 - 1.0 / b)
            orig = float(a * (high - 1.0))
            if orig > 0 and ok(1.0, high, orig):
                return result(1.0, high, orig)
    raise ModelFormatError(f"{path}: rope_freqs.weight does not match any Llama-3 rope scaling "
                           f"(factor={factor}); use the HF safetensors checkpoint instead")


_GGUF_LAYER_SUFFIX = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # a sparse layer's router [E, H]
    # Qwen2-MoE's shared expert and its sigmoid gate [1, H] (written [H] by converters that squeezed it)
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
#: one expert's projection (``mlp.experts.<e>.<proj>.weight``) -> the stacked GGUF tensor [E, out, in] it is row e of
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                 "down_proj": "ffn_down_exps.weight"}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf_name(name: str) -> str:
    """GGUF tensor name of an HF parameter name (``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``)."""
    m = LAYER_RE.match(name)
    if m:
        return f"blk.{m.group(1)}.{_GGUF_LAYER_SUFFIX[m.group(2)]}"
    return _GGUF_GLOBAL[name]


def gguf_source(name: str) -> tuple[str, Optional[int]]:
    """``(GGUF tensor name, expert)`` holding HF parameter ``name``: an expert's projection is row ``expert`` of a
    stacked ``blk.<i>.ffn_*_exps.weight`` (``mlp.experts.5.up_proj.weight`` -> ``("blk.<i>.ffn_up_exps.weight",
    5)``); every other tensor is whole (expert None, :func:`hf_to_gguf_name`)."""
    m = LAYER_RE.match(name)
    e = _EXPERT_RE.match(m.group(2)) if m else None
    if e:
        return f"blk.{m.group(1)}.{_GGUF_EXPERTS[e.group(2)]}", int(e.group(1))
    return hf_to_gguf_name(name), None


class _ExpertSlice:
    """Expert ``e`` of a stacked GGUF experts tensor (``ReaderTensor`` or :class:`_IndexedTensor`), with the
    fields the readers use: ``name`` (``<gguf name>[e]``), ``tensor_type``, ``shape`` (innermost first, the
    experts axis, outermost, dropped), ``data`` (row ``e`` of the memory-mapped numbers or quantised blocks)."""

    def __init__(self, t, e: int):
        self.name, self.tensor_type = f"{t.name}[{e}]", t.tensor_type
        self.shape = [int(x) for x in t.shape[:-1]]
        self.data = t.data[e]


def gguf_unpermute(w: torch.Tensor | np.ndarray, n_head: int):
    """Undo llama.cpp's ``permute(w, n_head)`` on a q/k projection [rows, cols]:
    ``w.reshape(n_head, rows//n_head//2, 2, cols).swapaxes(1, 2)`` (interleaved pairs -> rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_tensor_index(path: str) -> dict:
    """The tensor table of GGUF ``path`` for :func:`gguf_tensors` ``index=``: ``{"file", "byte_order", "tensors":
    {name: {"type", "shape" (innermost first), "offset" (absolute bytes), "n_bytes"}}}``, pickle-safe.
    Raises :class:`ModelFormatError` for a truncated or non-GGUF file."""
    r = gguf_reader(path)
    return {"file": list(file_key(path)), "byte_order": str(r.byte_order),
            "tensors": {t.name: {"type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
                                 "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)}
                        for t in r.tensors}}


#: numpy item type of the GGML types ``GGUFReader._build_tensors`` (gguf 0.19) reads as numbers;
#: every other (quantised) type is read as raw bytes (uint8) of the byte shape of its blocks
_PLAIN_GGML = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _IndexedTensor:
    """A :func:`gguf_tensor_index` entry with the ``gguf.ReaderTensor`` fields :func:`gguf_tensors`
    reads (``name``, ``tensor_type``, ``shape``, ``data``: a numpy view of the memory map)."""

    def __init__(self, name: str, entry: dict, mm: np.ndarray, byte_order: str):
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.name, self.shape = name, [int(x) for x in entry["shape"]]
        self.tensor_type = GGMLQuantizationType(int(entry["type"]))
        np_dims = tuple(reversed(self.shape))
        item_type = _PLAIN_GGML.get(self.tensor_type.name)
        if item_type is None:  # quantised: the block bytes, rows of (ne0 / block size) blocks
            item_type, count = np.uint8, int(entry["n_bytes"])
            np_dims = quant_shape_to_byte_shape(np_dims, self.tensor_type)
        else:
            count = math.prod(self.shape)
        off, end = int(entry["offset"]), int(entry["offset"]) + np.dtype(item_type).itemsize * count
        arr = mm[off:end].view(dtype=item_type)[:count]
        self.data = arr.view(arr.dtype.newbyteorder(byte_order)).reshape(np_dims)


def _index_tensors(path: str, index: Optional[dict]) -> Optional[dict]:
    """``{GGUF name: _IndexedTensor}`` of ``index`` over a read-only memory map of ``path``; None
    when ``index`` is None or its ``file`` key no longer matches ``path`` (the file changed)."""
    if index is None or tuple(index["file"]) != file_key(path):
        return None
    mm = np.memmap(index["file"][0], mode="r")  # the realpath; read-only, shared by the views
    return {name: _IndexedTensor(name, e, mm, index["byte_order"]) for name, e in index["tensors"].items()}


def gguf_tensors(path: str, cfg: LlamaConfig, wanted: dict, unpermute: bool,
                 index: Optional[dict] = None) -> dict[str, torch.Tensor]:
    """:func:`iter_gguf_tensors` as a dict."""
    return dict(iter_gguf_tensors(path, cfg, wanted, unpermute, index))


def gguf_wanted_tensors(path: str, wanted: dict, index: Optional[dict] = None) -> Iterator[tuple]:
    """``(name, stored_name, gguf_name, ReaderTensor)`` for each ``wanted = {name: (stored_name, HF shape)}``
    of the GGUF file (``index``: read at its offsets unless stale), its shape checked. Raises
    :class:`ModelFormatError` for a missing tensor or a wrong shape."""
    by_name = _index_tensors(path, index)
    if by_name is None:
        by_name = {t.name: t for t in gguf_reader(path).tensors}
    for name, (src, shape) in wanted.items():
        gname, expert = gguf_source(src)
        t = by_name.get(gname)
        if t is None:
            raise ModelFormatError(f"tensor {src!r} (GGUF {gname!r}) not found in {path}")
        if expert is not None:
            if len(t.shape) != 3 or expert >= int(t.shape[-1]):
                raise ModelFormatError(f"{path}: GGUF {gname!r} has shape {list(reversed(t.shape))}, not "
                                       f"[experts > {expert}, out, in]; re-convert with llama.cpp convert_hf_to_gguf.py")
            t = _ExpertSlice(t, expert)
            gname = t.name
        found = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (innermost) first
        if found != tuple(shape) and found != _squeezed(shape):
            raise shape_error(name, src, path, shape, found)
        yield name, src, gname, t


def _squeezed(shape) -> tuple:
    """``shape`` without its leading 1s: how a converter that squeezed tensors wrote it (Qwen2-MoE's shared
    expert gate ``[1, H]`` as ``[H]``); the numbers are the same in the same order."""
    shape = tuple(shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def iter_gguf_tensors(path: str, cfg: LlamaConfig, wanted: dict, unpermute: bool,
                      index: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Read ``wanted = {name: (stored_name, HF shape)}`` from a GGUF file one tensor at a time as fp32:
    yields ``(name, tensor)`` (q/k weights un-permuted when ``unpermute`` and the file is a ``llama`` one; ``index``: read at its offsets unless
    stale). Raises :class:`ModelFormatError` for a missing tensor, wrong shape, unsupported GGML type or
    non-finite value."""
    import gguf

    unpermute = unpermute and cfg.family in ("llama", "mistral")  # Qwen GGUFs keep HF row order
    for name, _, gname, t in gguf_wanted_tensors(path, wanted, index):
        shape = tuple(wanted[name][1])
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelFormatError(f"{path}: tensor {gname!r} uses unsupported GGML type "
                                   f"{t.tensor_type.name}") from e
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if unpermute and gname.endswith(".attn_q.weight"):
            arr = gguf_unpermute(arr, cfg.num_heads)
        elif unpermute and gname.endswith(".attn_k.weight"):
            arr = gguf_unpermute(arr, cfg.num_kv_heads)
        t = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
        check_finite(t, gname, path)
        yield name, t


