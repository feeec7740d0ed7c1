"""HF safetensors checkpoints (``config.json`` + ``model.safetensors`` or a sharded index), as written by
transformers ``save_pretrained``. Tensors come back as fp32 CPU tensors under HF names; only requested ones are read."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

import torch

from .config import FAMILIES, MOE_FAMILIES, LlamaConfig
from .files import ModelFormatError, SUPPORTED_HINT, check_finite, shape_error
from .limits import WINDOW_TYPES

__all__ = ["hf_config", "hf_family", "normalise_rope_scaling", "first_id", "safetensors_index", "safetensors_walk",
           "safetensors_tensors", "iter_safetensors_tensors"]


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")


def _npt_checkpoint_error(d: str) -> Optional[str]:
    """The error for ``model.path`` naming an npu-train checkpoint (``step_N`` with ``manifest.json``) or a
    checkpoint root (``step_N`` directories): not a model directory; says how to resume it or export it. None
    for any other directory."""
    try:
        steps = sorted(n for n in os.listdir(d) if n.startswith("step_") and
                       os.path.isfile(os.path.join(d, n, "manifest.json")))
    except OSError:
        return None
    if os.path.isfile(os.path.join(d, "manifest.json")):
        one, root = os.path.abspath(d), os.path.dirname(os.path.abspath(d))
    elif steps:
        one, root = os.path.join(os.path.abspath(d), steps[-1]), os.path.abspath(d)
    else:
        return None
    base = ""
    try:
        with open(os.path.join(one, "manifest.json"), encoding="utf-8") as f:
            recorded = json.load(f).get("model_path")
        base = f" (its run's model.path={recorded})" if recorded else ""
    except (OSError, ValueError, AttributeError):
        pass
    return (f"model.path={d} is an npu-train checkpoint{' root' if one != os.path.abspath(d) else ''}, not a model "
            f"directory (it has no config.json): to continue that run, keep its model.path{base} and add "
            f"train.resume=latest checkpoint.dir={root}; to start a new run from its weights, export them first: "
            f"python -m npu_train.checkpoint.export {d} <out dir>, then model.path=<out dir>")


def hf_config(d: str) -> LlamaConfig:
    """The :class:`LlamaConfig` of the HF directory ``d``; :class:`ModelFormatError` for a missing or invalid
    config.json, an architecture outside :data:`~npu_train.model.config.FAMILIES`, missing keys, inconsistent
    head/layer counts or unsupported features."""
    cfg_path = os.path.join(d, "config.json")
    if not os.path.isfile(cfg_path):
        ck = _npt_checkpoint_error(d)
        if ck:
            raise ModelFormatError(ck)
        ggufs = sorted(f for f in os.listdir(d) if f.lower().endswith(".gguf"))
        hint = f" (found GGUF file(s) {ggufs}: pass one of them as the model path)" if ggufs else ""
        raise ModelFormatError(f"{d!r} has no config.json{hint}; {SUPPORTED_HINT}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{cfg_path}: expected a JSON object")
    family = hf_family(raw, cfg_path)
    for k in _HF_REQUIRED:
        if k not in raw or raw[k] is None:
            raise ModelFormatError(
                f"{cfg_path}: required key {k!r} is missing; re-export the model with "
                f"transformers `save_pretrained` or add {k!r} to config.json"
            )
    _check_features(raw, family, cfg_path)
    heads, kv_heads, n_layers = _check_counts(raw, cfg_path)
    # RoPE: transformers >= 5 writes `rope_parameters` {rope_type, rope_theta, ...};
    # older versions write top-level `rope_theta` + `rope_scaling`.
    rp = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta", rp.get("rope_theta", 10000.0))
    scaling_src = raw.get("rope_scaling") or rp
    rope_scaling = normalise_rope_scaling(scaling_src, cfg_path)

    window = raw.get("sliding_window") if family in WINDOW_TYPES else None
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=raw.get("head_dim"),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=first_id(raw.get("bos_token_id")),
        eos_token_id=first_id(raw.get("eos_token_id")),
        name=raw.get("_name_or_path") or os.path.basename(os.path.normpath(os.path.abspath(d))),
        family=family,
        sliding_window=None if window is None else int(window),
        **(moe_fields(raw, family, cfg_path) if family in MOE_FAMILIES else {}),
    )


def moe_fields(raw: dict, family: str, cfg_path: str) -> dict:
    """The mixture-of-experts fields of :class:`LlamaConfig` from config.json ``raw`` of a ``family`` in
    :data:`~npu_train.model.config.MOE_FAMILIES` (transformers' names: Qwen3MoeConfig / Qwen2MoeConfig
    ``num_experts``, ``moe_intermediate_size``; MixtralConfig ``num_local_experts``, experts of width
    ``intermediate_size``, always renormalised). :class:`ModelFormatError` for a missing key or Mixtral's
    router jitter (random noise on the router input during training: not reproducible)."""
    mixtral = family == "mixtral"
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map); the Hub has both
    experts = raw.get("num_local_experts") if raw.get("num_experts") is None else raw.get("num_experts")
    need = {"num_experts (or num_local_experts)": experts, "num_experts_per_tok": raw.get("num_experts_per_tok"),
            "intermediate_size" if mixtral else "moe_intermediate_size":
                raw.get("intermediate_size" if mixtral else "moe_intermediate_size")}
    for k, v in need.items():
        if v is None:
            raise ModelFormatError(f"{cfg_path}: required key {k!r} of a {family} model is missing; re-export the "
                                   "model with transformers `save_pretrained` or add it to config.json")
    if mixtral and float(raw.get("router_jitter_noise") or 0.0) > 0:
        raise ModelFormatError(f"{cfg_path}: router_jitter_noise={raw['router_jitter_noise']} (random noise on the "
                               "router input) is not supported; set router_jitter_noise=0.0 in config.json")
    out = dict(
        num_experts=int(experts),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"] if mixtral else raw["moe_intermediate_size"]),
        norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef") or 0.0),
        output_router_logits=bool(raw.get("output_router_logits", False)),
    )
    if not mixtral:
        out.update(decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in (raw.get("mlp_only_layers") or ())))
    if family == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(raw.get("shared_expert_intermediate_size") or 0)
    return out


def hf_family(raw: dict, cfg_path: str) -> str:
    """The :data:`~npu_train.model.config.FAMILIES` name of config.json ``raw`` (by ``architectures``, else
    ``model_type``); :class:`ModelFormatError` naming the supported list for any other model."""
    archs = raw.get("architectures") or []
    mtype = raw.get("model_type")
    loadable = FAMILIES
    for name, fam in loadable.items():
        if fam.architecture in archs:
            return name
    if not archs:
        for name, fam in loadable.items():
            if fam.model_type == mtype:
                return name
    raise ModelFormatError(f"{cfg_path}: unsupported architecture {archs or mtype!r}; {SUPPORTED_HINT}")


def _check_features(raw: dict, family: str, cfg_path: str) -> None:
    """Refuse config.json features the family's module does not implement (one line naming the key)."""
    if family == "qwen2_moe" and raw.get("qkv_bias") is False:
        raise ModelFormatError(f"{cfg_path}: qkv_bias=false is not supported for qwen2_moe (npu-train's Qwen2-MoE "
                               "attention has q/k/v biases, as every released Qwen2-MoE)")
    if family not in ("qwen2", "qwen2_moe") and raw.get("attention_bias"):  # (Qwen2's biases are not a config key)
        raise ModelFormatError(f"{cfg_path}: attention_bias=true is not supported for {family} "
                               f"(npu-train's {family} has no attention biases)")
    if raw.get("mlp_bias"):
        raise ModelFormatError(f"{cfg_path}: mlp_bias=true is not supported (npu-train's MLP has no biases)")
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ModelFormatError(
                f"{cfg_path}: use_sliding_window=true (per-layer sliding-window attention) is not supported for "
                f"{family}; every released Qwen2/2.5/Qwen3 config sets it to false: set use_sliding_window=false")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFormatError(f"{cfg_path}: hidden_act={act!r} not supported (only silu)")


def _check_counts(raw: dict, cfg_path: str) -> tuple[int, int, int]:
    """``(num_attention_heads, num_key_value_heads, num_hidden_layers)`` of config.json ``raw``, checked:
    positive, and the key/value heads dividing the attention heads (one line naming the keys, else)."""
    try:
        heads = int(raw["num_attention_heads"])
        kv = int(raw.get("num_key_value_heads") or heads)
        layers = int(raw["num_hidden_layers"])
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{cfg_path}: num_attention_heads / num_key_value_heads / num_hidden_layers must "
                               f"be integers ({e}); fix config.json") from None
    if layers <= 0:
        raise ModelFormatError(f"{cfg_path}: num_hidden_layers={layers}: a model needs at least one decoder layer; "
                               "fix config.json (or re-download the model)")
    if heads <= 0 or kv <= 0 or heads % kv:
        raise ModelFormatError(f"{cfg_path}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                               "fix config.json (or re-download the model)")
    return heads, kv, layers


def first_id(v: Any) -> Optional[int]:
    """First element of a list-valued token id (``eos_token_id: [1, 2]``), or the id, or None."""
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return None if v is None else int(v)


def normalise_rope_scaling(src: dict, where: str) -> Optional[dict]:
    """HF ``rope_scaling`` / ``rope_parameters`` -> ``None`` | linear | llama3 dict (our form)."""
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



def safetensors_index(d: str) -> tuple[dict[str, str], str]:
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
        raise ModelFormatError(f"{d}: no model.safetensors or model.safetensors.index.json{hint}; a model "
                               "directory holds config.json, the weights (model.safetensors, or shards with "
                               "model.safetensors.index.json) and tokenizer.json, as transformers' save_pretrained "
                               "writes them: point model.path at one")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for fp in files:
        try:
            with safe_open(fp, framework="pt") as f:
                for k in f.keys():
                    out.setdefault(k, fp)
        except Exception as e:  # noqa: BLE001 - header parse failure
            raise ModelFormatError(f"{fp}: not a readable safetensors file ({e}); the file is truncated or corrupt: "
                                   "re-download the model") from e
    return out, (files[0] if len(files) == 1 else f"{files}")


def safetensors_walk(d: str, wanted: dict) -> Iterator[tuple[str, str, str, Any]]:
    """Walk the HF directory ``d``'s shards for ``wanted = {name: (stored_name, shape)}``, checking headers
    only; yields ``(name, stored_name, shard path, safe_open handle)``. Raises :class:`ModelFormatError`."""
    from safetensors import safe_open

    where, source = safetensors_index(d)
    by_file: dict[str, list[str]] = {}
    for name, (src, _) in wanted.items():
        fp = where.get(src)
        if fp is None:
            raise ModelFormatError(f"tensor {src!r} not found in {source}: the weights do not match config.json "
                                   "(incomplete download or another model); re-download the model")
        by_file.setdefault(fp, []).append(name)
    for fp, names in by_file.items():
        if not os.path.isfile(fp):
            raise ModelFormatError(f"{fp}: shard listed in the index is missing; re-download the model")
        try:
            f = safe_open(fp, framework="pt")
            keys = set(f.keys())
            shapes = {src: tuple(f.get_slice(src).get_shape()) for src, _ in map(wanted.get, names) if src in keys}
        except Exception as e:  # noqa: BLE001 - unreadable header
            raise ModelFormatError(f"{fp}: not a readable safetensors file ({e}); re-download the model") from e
        with f:
            for name in names:
                src, shape = wanted[name]
                if src not in keys:
                    raise ModelFormatError(f"tensor {src!r} not found in {fp}; re-download the model")
                if shapes[src] != tuple(shape):
                    raise shape_error(name, src, fp, shape, shapes[src])
                yield name, src, fp, f


def safetensors_tensors(d: str, wanted: dict) -> dict[str, torch.Tensor]:
    """:func:`iter_safetensors_tensors` as a dict."""
    return dict(iter_safetensors_tensors(d, wanted))


def iter_safetensors_tensors(d: str, wanted: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Read ``wanted = {name: (stored_name, shape)}`` from the HF directory ``d`` one tensor at a time:
    yields ``(name, fp32 contiguous CPU tensor)``; :class:`ModelFormatError` as :func:`safetensors_walk`,
    or for a non-finite value."""
    for name, src, fp, f in safetensors_walk(d, wanted):
        t = f.get_tensor(src).to(torch.float32).contiguous()
        check_finite(t, src, fp)
        yield name, t
