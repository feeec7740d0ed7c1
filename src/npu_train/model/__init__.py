"""Llama model: config, stage modules, and loading of HF / GGUF weights and tokenizers.

Layout: ``config.py`` (LlamaConfig), ``llama.py`` (stage modules, loss, ``IGNORE_INDEX``),
``files.py`` (ModelFormatError, paths, expected shapes), ``hf.py`` (config.json + safetensors),
``gguf.py`` (GGUF reading, dequantization, q/k un-permute), ``weights.py`` (format dispatch,
:func:`check_weights`), ``tokenizer.py`` (tokenizers, chat templates), ``presets.py``.
"""
import importlib

#: public name -> submodule. Loaded on first use (PEP 562), so ``import npu_train.model.config``
#: (what the planner's dry run needs) does not import torch.
_EXPORTS = {
    "ModelFormatError": "files", "embedded_model_path": "files", "resolve_model_path": "files",
    "clear_gguf_cache": "gguf", "gguf_unpermute": "gguf", "gguf_tensor_index": "gguf",
    "chat_template": "tokenizer", "load_tokenizer": "tokenizer", "special_tokens": "tokenizer",
    "check_weights": "weights", "load_config": "weights", "load_tensors": "weights",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
