"""Llama model: config, stage modules, and loading of HF / GGUF weights and tokenizers.

Layout: ``config.py`` (LlamaConfig), ``llama.py`` (stage modules, loss, ``IGNORE_INDEX``),
``files.py`` (ModelFormatError, paths, expected shapes), ``hf.py`` (config.json + safetensors),
``gguf.py`` (GGUF reading, dequantization, q/k un-permute), ``weights.py`` (format dispatch,
:func:`check_weights`), ``tokenizer.py`` (tokenizers, chat templates), ``presets.py``.
"""
from .files import ModelFormatError, embedded_model_path, resolve_model_path
from .gguf import clear_gguf_cache, gguf_unpermute
from .tokenizer import chat_template, load_tokenizer, special_tokens
from .weights import check_weights, load_config, load_tensors

__all__ = [
    "ModelFormatError", "check_weights", "load_config", "load_tensors", "load_tokenizer",
    "chat_template", "special_tokens", "embedded_model_path", "resolve_model_path",
    "gguf_unpermute", "clear_gguf_cache",
]
