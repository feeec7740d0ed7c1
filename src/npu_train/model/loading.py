"""Compatibility facade: the model loaders now live in :mod:`npu_train.model.hf`,
:mod:`~npu_train.model.gguf`, :mod:`~npu_train.model.tokenizer`, :mod:`~npu_train.model.weights`
and :mod:`~npu_train.model.files`; import from ``npu_train.model`` instead.

The underscore aliases below exist only for ``runtime/launcher.py`` and ``optim/calibrate.py``
until they switch to :func:`npu_train.model.check_weights` / :func:`npu_train.model.gguf.gguf_reader`;
delete this module then.
"""
from __future__ import annotations

from .files import (EMBEDDED_MODEL_FILE, EMBEDDED_MODEL_PACKAGE, ModelFormatError, embedded_model_path,
                    resolve_model_path)
from .files import expected_shape as _expected_shape  # noqa: F401
from .files import hf_dir as _hf_dir  # noqa: F401
from .files import is_gguf_path as _is_gguf_path  # noqa: F401
from .files import shape_error as _shape_error  # noqa: F401
from .gguf import clear_gguf_cache, gguf_unpermute
from .gguf import gguf_field as _gguf_field  # noqa: F401
from .gguf import gguf_reader as _gguf_reader  # noqa: F401
from .gguf import hf_to_gguf_name as _hf_to_gguf_name  # noqa: F401
from .hf import safetensors_index as _safetensors_index  # noqa: F401
from .tokenizer import load_tokenizer
from .weights import check_weights, load_config, load_tensors

__all__ = [
    "ModelFormatError", "load_config", "load_tensors", "load_tokenizer", "check_weights",
    "embedded_model_path", "resolve_model_path", "gguf_unpermute", "clear_gguf_cache",
    "EMBEDDED_MODEL_FILE", "EMBEDDED_MODEL_PACKAGE",
]
