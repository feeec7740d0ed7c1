"""Model configs and weights from HF safetensors directories or GGUF files (format dispatch).

All tensor loaders return fp32 CPU tensors under HF parameter names (see
:mod:`npu_train.model.config`) and read only the requested tensors.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .config import LlamaConfig
from .files import ModelFormatError, check_exists, expected_shape, hf_dir, is_gguf_path, shape_error
from .gguf import gguf_config, gguf_reader, gguf_tensors, hf_to_gguf_name
from .hf import hf_config, safetensors_tensors, safetensors_walk
from .llama import checkpoint_source_name

__all__ = ["load_config", "load_tensors", "check_weights"]


def load_config(path: str) -> LlamaConfig:
    """Read the architecture of the model at ``path`` (HF directory or ``.gguf`` file).

    Raises ``FileNotFoundError`` if ``path`` does not exist and :class:`ModelFormatError` for
    non-Llama models, missing required keys, unsupported features (biases, non-SiLU act,
    unknown RoPE scaling) and truncated / non-GGUF files.
    """
    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        return gguf_config(path)
    return hf_config(hf_dir(path))


def load_tensors(path: str, cfg: LlamaConfig, names: list[str], *, index: Optional[dict] = None,
                 _unpermute_qk: bool = True) -> dict[str, torch.Tensor]:
    """Read the named parameters (HF names) from the checkpoint at ``path``.

    Returns ``{name: fp32 contiguous CPU tensor}`` for exactly ``names``, with the HF shapes of
    ``cfg.param_shapes``; only those tensors are read from disk.  ``lm_head.weight`` on a tied
    model is read from the embedding (:func:`checkpoint_source_name`).  GGUF q/k projections are
    un-permuted back to HF rotate-half row order (``_unpermute_qk=False`` is for tests only).
    ``index``: a GGUF file's :func:`~npu_train.model.gguf.gguf_tensor_index` from the launcher
    (``WorkerSpec.model_index``): its tensors are then read at the indexed offsets without parsing
    the file's metadata (same bits; ignored when the file changed since, see
    :func:`~npu_train.model.gguf.gguf_tensors`; ignored for safetensors).

    Raises :class:`ModelFormatError` if a tensor is absent (naming tensor and file), has the
    wrong shape (naming expected and found shapes) or holds an inf/NaN (naming the tensor);
    ``ValueError`` for names that are not parameters of ``cfg``.
    """
    path = os.path.expanduser(path)
    check_exists(path)
    wanted = {n: (checkpoint_source_name(cfg, n), expected_shape(cfg, n)) for n in names}
    if is_gguf_path(path):
        return gguf_tensors(path, cfg, wanted, _unpermute_qk, index=index)
    return safetensors_tensors(hf_dir(path), wanted)


def check_weights(model_path: str, cfg: LlamaConfig) -> None:
    """Check that the weights file(s) hold every parameter of ``cfg`` with the right shape.

    Reads headers only (safetensors ``safe_open`` keys and ``get_slice().get_shape()``, or the
    GGUF tensor table): no tensor data, so it takes milliseconds even for an 8B model. Run
    before any card process starts, so a missing or mis-shaped tensor is a user error (exit 2)
    instead of a card process failing after every process has started. Values (inf/NaN) are
    checked when a stage loads its tensors (:func:`load_tensors`).

    Raises :class:`ModelFormatError` naming the tensor, the file and the fix.
    """
    names = list(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        names += list(cfg.param_shapes(i))
    wanted = {n: (checkpoint_source_name(cfg, n), expected_shape(cfg, n)) for n in names}
    path = os.path.expanduser(model_path)
    check_exists(path)
    if is_gguf_path(path):
        by_name = {t.name: t for t in gguf_reader(path).tensors}
        for n, (src, shape) in wanted.items():
            t = by_name.get(hf_to_gguf_name(src))
            if t is None:
                raise ModelFormatError(f"tensor {src!r} (GGUF {hf_to_gguf_name(src)!r}) not found in {path}: "
                                       "the file is incomplete or not this model; re-download or re-convert it")
            found = tuple(int(x) for x in reversed(t.shape))
            if found != tuple(shape):
                raise shape_error(n, src, path, shape, found)
        return
    for _ in safetensors_walk(hf_dir(path), wanted):  # headers only: presence and shape of each tensor
        pass
